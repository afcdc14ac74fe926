"""Qwen3.5 (ColQwen3.5, family `colqwen3.5`): the Gated DeltaNet layer in standard ONNX ops, the
text side (language model, projection, normalisation; `text.py`), the checkpoint reading
(`checkpoint.py`) and the tokenizer built from its tiktoken ranks. The vision tower is Qwen3-VL's
without DeepStack. docs/reference-colqwen3_5.md pins what "the same" means for each part."""
