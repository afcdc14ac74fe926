"""Concluded one-off experiments: each opens with its question, its answer and its result note."""
