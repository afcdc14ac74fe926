"""What every benchmark may import: machine facts, documents, data generators, the benchmark model."""
