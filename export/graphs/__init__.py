"""Writing and editing ONNX graphs: torch export to a file, graph passes, DirectML's rules."""
