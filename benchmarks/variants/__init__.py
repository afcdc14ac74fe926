"""Variant fidelity and gate measurements (`python -m benchmarks.variants.fidelity`, ...)."""
