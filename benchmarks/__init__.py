"""Benchmarks, one module or folder per suite, run as `python -m benchmarks.<suite>` from the
repository root (benchmarks/README.md)."""
