"""Qwen3.5 (ColQwen3.5) groundwork: the Gated DeltaNet layer in standard ONNX ops, the text side
(language model, projection, normalisation; `text.py`) and the tokenizer built from its tiktoken
ranks. Not a registered family yet (docs/reference-colqwen3_5.md says what is built and what is
not)."""
