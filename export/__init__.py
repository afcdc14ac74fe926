"""colembed_export: turns a ColQwen2 checkpoint into colembed ONNX graphs and a manifest (needs torch)."""
