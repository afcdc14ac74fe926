"""The torch runtimes colembed is timed against: each family's pinned torch reference.

- "torch" (the reference): eager attention, fp32; every speed ratio in `results/embed/embed*` is over it.
- "torch-bf16": what a user gets from one line of torch, `dtype=torch.bfloat16` with
  `attn_implementation="sdpa"` (the fast path on CPUs with AVX512-BF16 / AMX; on an AVX2-only CPU
  torch emulates bf16 matmuls, and the row says how much that costs there).

Which torch code that is, per family (the code docs/reference*.md pin):
- ColQwen2 and ColQwen2.5: transformers 4.57.1 `ColQwen2ForRetrieval` + `ColQwen2Processor`, in
  this (the export) environment; ColQwen2.5 over the Qwen2.5-VL config with the exporter's
  `get_dtype` shim (`ExportFamily.prepare_reference`).
- ColQwen3: colpali-engine 0.3.18 `ColQwen3` + `ColQwen3Processor` on transformers 5.24, what a
  ColQwen3 user runs on torch. It cannot share this environment (transformers 4.57.1 is ColQwen2's
  reference), so its rows run in the pinned reference's own environment, the one the parity tests
  use (`colembed_export.testing.reference_env.reference_python`: made on first use, or
  `COLEMBED_QWEN3_REFERENCE_PYTHON`); `interpreter(family)` names it and the benchmark starts the
  worker there. The model and processor are `colembed_export.families.qwen3.reference.load_reference`'s
  (the parity tests' reference, torchvision-free). The exporter's own torch model for ColQwen3
  (transformers 4.57.1's `Qwen3VLModel` plus colpali-engine's head) computes the same numbers
  (docs/reference-colqwen3.md) but is no code a user runs, so it is not what colembed is timed
  against.
Outputs come back as float32 numpy rows, padding removed, like colembed's.
"""

from __future__ import annotations

import sys
from pathlib import Path

# runtime name -> (torch dtype name, attention implementation)
TORCH_RUNTIMES = {"torch": ("float32", "eager"), "torch-bf16": ("bfloat16", "sdpa")}
# families whose pinned torch reference runs in its own environment (module docstring)
OWN_ENVIRONMENT = ("colqwen3",)
REPO = Path(__file__).resolve().parents[2]


def interpreter(family: str) -> str:
    """The Python that runs `family`'s torch reference: this one, or the pinned reference's own
    environment (made on first use by the tests' fixture, under its file lock)."""
    if family not in OWN_ENVIRONMENT:
        return sys.executable
    from colembed_export.testing.reference_env import reference_python

    return str(reference_python())


class TorchRuntime:
    """One of `TORCH_RUNTIMES` over a checkpoint folder, with colembed's embed_* signatures."""

    def __init__(
        self, checkpoint: str, threads: int, family: str = "colqwen2", runtime: str = "torch"
    ) -> None:
        import torch

        dtype_name, attention = TORCH_RUNTIMES[runtime]
        torch.set_num_threads(threads)
        self.torch = torch
        self.dtype = getattr(torch, dtype_name)
        if family == "colqwen3":
            from colembed_export.families.qwen3.reference import load_reference

            model, self.processor = load_reference(
                Path(checkpoint), dtype=self.dtype, attention=attention
            )
            self.model = model
            self._embeddings = lambda batch: self.model(
                **batch
            )  # colpali-engine returns the tensor
            return
        from transformers import ColQwen2ForRetrieval, ColQwen2Processor

        from colembed_export.families import export_family

        self.processor = ColQwen2Processor.from_pretrained(checkpoint, use_fast=False)
        self.model = export_family(family).prepare_reference(
            ColQwen2ForRetrieval.from_pretrained(
                checkpoint, dtype=self.dtype, attn_implementation=attention
            ).eval()
        )
        self._embeddings = lambda batch: self.model(**batch).embeddings

    def _rows(self, batch) -> list:
        batch = {k: (v.to(self.dtype) if v.is_floating_point() else v) for k, v in batch.items()}
        with self.torch.no_grad():
            out = self._embeddings(batch).float()
        return [out[i][batch["attention_mask"][i] == 1].numpy() for i in range(out.shape[0])]

    def embed_images(self, images, batch_size=4):
        return [
            row
            for i in range(0, len(images), batch_size)
            for row in self._rows(self.processor.process_images(images[i : i + batch_size]))
        ]

    def embed_queries(self, texts, batch_size=16):
        return [
            row
            for i in range(0, len(texts), batch_size)
            for row in self._rows(self.processor.process_queries(texts[i : i + batch_size]))
        ]
