"""The torch runtimes colembed is timed against: transformers 4.57.1 `ColQwen2ForRetrieval`.

- "torch" (the reference): eager attention, fp32; every speed ratio in `results/embed*` is over it.
- "torch-bf16": what a user gets from one line of torch, `dtype=torch.bfloat16` with
  `attn_implementation="sdpa"` (the fast path on CPUs with AVX512-BF16 / AMX; on an AVX2-only CPU
  torch emulates bf16 matmuls, and the row says how much that costs there).

Each family is made runnable by the exporter's own declaration (ColQwen2.5's `get_dtype` shim;
ColQwen3, which transformers 4.57.1's `ColQwen2ForRetrieval` does not read: the exporter's strict
loader, `checkpoint_qwen3.load_colqwen3`, i.e. 4.57.1's `Qwen3VLModel` plus colpali-engine's head,
and the exporter's reference processor, with the attention implementation set on the backbone).
Outputs come back as float32 numpy rows, padding removed, like colembed's.
"""

from __future__ import annotations

# runtime name -> (torch dtype name, attention implementation)
TORCH_RUNTIMES = {"torch": ("float32", "eager"), "torch-bf16": ("bfloat16", "sdpa")}


class TorchRuntime:
    """One of `TORCH_RUNTIMES` over a checkpoint folder, with colembed's embed_* signatures."""

    def __init__(self, checkpoint: str, threads: int, family: str = "colqwen2",
                 runtime: str = "torch") -> None:
        from pathlib import Path

        import torch
        from transformers import ColQwen2ForRetrieval, ColQwen2Processor

        from colembed_export.families import export_family

        dtype_name, attention = TORCH_RUNTIMES[runtime]
        torch.set_num_threads(threads)
        self.torch = torch
        self.dtype = getattr(torch, dtype_name)
        declared = export_family(family)
        if declared.reference_processor is not None:  # not a transformers ColQwen2 checkpoint
            self.processor, _ = declared.reference_processor(Path(checkpoint))
            model = declared.load(Path(checkpoint)).to(self.dtype)
            model.vlm.model.set_attn_implementation(attention)
            self.model = declared.prepare_reference(model.eval())
            return
        self.processor = ColQwen2Processor.from_pretrained(checkpoint, use_fast=False)
        self.model = declared.prepare_reference(ColQwen2ForRetrieval.from_pretrained(
            checkpoint, dtype=self.dtype, attn_implementation=attention).eval())

    def _rows(self, batch) -> list:
        batch = {k: (v.to(self.dtype) if v.is_floating_point() else v) for k, v in batch.items()}
        with self.torch.no_grad():
            out = self.model(**batch).embeddings.float()
        return [out[i][batch["attention_mask"][i] == 1].numpy() for i in range(out.shape[0])]

    def embed_images(self, images, batch_size=4):
        return [row for i in range(0, len(images), batch_size)
                for row in self._rows(self.processor.process_images(images[i:i + batch_size]))]

    def embed_queries(self, texts, batch_size=16):
        return [row for i in range(0, len(texts), batch_size)
                for row in self._rows(self.processor.process_queries(texts[i:i + batch_size]))]
