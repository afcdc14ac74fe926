"""ColQwen2.5 (Qwen2.5-VL): checkpoint layouts and reading, LoRA adapters, the windowed image graph."""
