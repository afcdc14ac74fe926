"""The pinned ColQwen3.5 reference, run as a script in its own environment: colpali-engine 0.3.18
`ColQwen3_5` and `ColQwen3_5Processor` on transformers 5.24 (docs/reference-colqwen3_5.md).

    python -m colembed_export.families.qwen3_5.reference_colpali build SPEC.json OUT_FOLDER
    python -m colembed_export.families.qwen3_5.reference_colpali vision CHECKPOINT IN.npz OUT.npz
    python -m colembed_export.families.qwen3_5.reference_colpali embed CHECKPOINT IN.npz OUT.npz

- `build`: a random-weight ColQwen3_5 at the spec's sizes (`Qwen3_5Config`, colpali-engine's
  projection of the config's `dim`), every 1-D parameter perturbed (N(0, 0.3)), saved with
  `ColQwen3_5.save_pretrained` and the processor's `save_pretrained` (Qwen3.5's tokenizer built
  by transformers' own tiktoken converter from the spec's ranks file and special tokens; a
  Qwen3-VL image processor with the spec's pixel bounds): the folder a user's fine-tune arrives as.
- `vision`: the tower's merged features (`model.visual(...).pooler_output`) for each
  `pixels<i>` (patches, 1536) / `grid<i>` (1, 3) of IN.
- `embed`: per query (`queries`, a JSON list in IN) and per page (`page<i>`, the encoded image
  file's bytes, decoded here as a user opens it): the processor's ids, pixels, grid, the model's
  3-D positions and the embeddings (real rows), alone and in one left-padded batch: ColQwen3's
  reference loop (`qwen3.reference.embed_reference`), the same keys for both families.

Run through `testing.tiny_qwen3_5.run_colpali_reference` (`reference_env.run_reference`), which
puts this checkout's `colembed_export` on the path whichever checkout the reference environment
was made from.

One shim for the absence of torchvision (never installed beside torch here), which touches
nothing that is computed: colpali-engine imports `image_processing_qwen2_vl` (torchvision) only for
`smart_resize`, replaced by the PIL backend's identical function (ColQwen3's shim); and
`Qwen3VLProcessor` requires a video processor (torchvision), so `ImagesOnly` declares the PIL
`Qwen2VLImageProcessorPil` and the tokenizer only. Images and text never reach a video processor.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from colembed_export.families.qwen3.reference import _shim_torchvision_free, embed_reference

PROCESSOR_CLASS = "ColQwen3_5Processor"


def _processor_class():
    _shim_torchvision_free()
    from colpali_engine.models import ColQwen3_5Processor

    class ImagesOnly(ColQwen3_5Processor):
        attributes = ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, **kwargs):
            # ProcessorMixin.__init__ checks the declared attributes; Qwen3VLProcessor's own
            # token wiring (image / vision tokens from the tokenizer) is repeated as it does it.
            super(ColQwen3_5Processor.__mro__[2], self).__init__(
                image_processor, tokenizer, **kwargs
            )
            for kind, default in (
                ("image", "<|image_pad|>"),
                ("video", "<|video_pad|>"),
                ("vision_start", "<|vision_start|>"),
                ("vision_end", "<|vision_end|>"),
            ):
                token = getattr(tokenizer, f"{kind}_token", None) or default
                setattr(self, f"{kind}_token", token)
                setattr(self, f"{kind}_token_id", tokenizer.convert_tokens_to_ids(token))
            self.tokenizer.padding_side = "left"

    # What it saves names the processor a user loads the folder with, as published folders do.
    ImagesOnly.__name__ = ImagesOnly.__qualname__ = PROCESSOR_CLASS
    return ImagesOnly


def _image_processor(settings: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=settings["patch_size"],
        merge_size=settings["merge_size"],
        temporal_patch_size=settings["temporal_patch_size"],
        image_mean=settings["image_mean"],
        image_std=settings["image_std"],
        size=dict(settings["size"]),
    )


def load(folder: Path):
    """(model, processor) as a user loads the saved folder: the image processor's settings from
    processor_config.json (5.x writes no preprocessor_config.json), the tokenizer by AutoTokenizer."""
    import torch

    _shim_torchvision_free()
    from colpali_engine.models import ColQwen3_5
    from transformers import AutoTokenizer

    settings = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = _processor_class()(image_processor=_image_processor(settings), tokenizer=tokenizer)
    model = ColQwen3_5.from_pretrained(folder, dtype=torch.float32).eval()
    return model, processor


def build(spec_file: Path, out: Path) -> None:
    import torch

    _shim_torchvision_free()
    from colpali_engine.models import ColQwen3_5
    from tokenizers import AddedToken
    from transformers import Qwen3_5Config
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    spec = json.loads(spec_file.read_text())
    torch.manual_seed(spec["seed"])
    config = Qwen3_5Config(**spec["config"])
    model = ColQwen3_5(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(spec["seed"] + 1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(out)

    vocab, merges = TikTokenConverter().extract_vocab_merges_from_model(spec["ranks_file"])
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    specials = sorted((int(i), c) for i, c in spec["special_tokens"])
    tokenizer._tokenizer.add_special_tokens(
        [AddedToken(c, special=True, normalized=False) for _, c in specials]
    )
    # The named tokens (image, video, vision start / end) once the ids are fixed, as a
    # published tokenizer_config.json names them when the tokenizer is loaded.
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        tokenizer = Qwen3_5Tokenizer.from_pretrained(
            scratch, extra_special_tokens=spec["named_tokens"]
        )
    for i, c in specials:
        if tokenizer.convert_tokens_to_ids(c) != i:
            raise RuntimeError(f"{c!r} is {tokenizer.convert_tokens_to_ids(c)} here, not {i}")
    processor = _processor_class()(
        image_processor=_image_processor(spec["image_processor"]), tokenizer=tokenizer
    )
    processor.save_pretrained(out)


def vision(folder: Path, inp: Path, out: Path) -> None:
    import torch

    model, _ = load(folder)
    data = np.load(inp)
    found = {}
    with torch.no_grad():
        for i in range(sum(k.startswith("pixels") for k in data.files)):
            result = model.visual(
                torch.from_numpy(data[f"pixels{i}"]), grid_thw=torch.from_numpy(data[f"grid{i}"])
            )
            found[f"merged{i}"] = result.pooler_output.numpy()
    np.savez(out, **found)


def embed(folder: Path, inp: Path, out: Path) -> None:
    from PIL import Image

    model, processor = load(folder)
    data = np.load(inp)
    queries = json.loads(str(data["queries"]))
    pages = [
        Image.open(io.BytesIO(data[f"page{i}"].tobytes()))
        for i in range(sum(k.startswith("page") for k in data.files))
    ]
    found = embed_reference(model, processor, queries, pages, int(data["batched_pages"]))
    np.savez(out, **found)


COMMANDS = {"build": (build, 2), "vision": (vision, 3), "embed": (embed, 3)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        raise SystemExit(__doc__)
    command, arity = COMMANDS[sys.argv[1]]
    if len(sys.argv) != 2 + arity:
        raise SystemExit(__doc__)
    command(*map(Path, sys.argv[2:]))
