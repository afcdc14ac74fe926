"""ColQwen3 (Qwen3-VL): checkpoint layouts and reading, DeepStack graphs, the pinned reference."""
