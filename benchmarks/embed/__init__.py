"""The embedding suite (`python -m benchmarks.embed`): the driver and its parts."""
