"""The index suite (`python -m benchmarks.index`): stores, ingest, long runs, large searches."""
