"""ColQwen2 (Qwen2-VL): the graph wrappers and fused ops every family's graphs extend."""
