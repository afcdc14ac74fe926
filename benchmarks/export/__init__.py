"""The export suite (`python -m benchmarks.export`): time and peak memory per export step."""
