"""Tiny random-weight checkpoints of each family's real architecture, for tests, benchmarks and the
offline demo (no download needed). Not used by an export of a real checkpoint."""
