"""The pinned ColQwen3 reference, run in its own environment: colpali-engine 0.3.18 on transformers 5.x.

colpali-engine 0.3.18 `ColQwen3` + `ColQwen3Processor` need transformers >= 5.3; colembed's export
extra pins transformers 4.57.1 for the ColQwen2 reference (docs/reference.md says why 5.x is not
ColQwen2's reference). So this module is run as a script by the interpreter of the reference
environment (`tests/fixtures/qwen3.py` creates it) and writes what the reference produced to an
.npz file that the export environment compares with:

    python -m colembed_export.families.qwen3.reference CHECKPOINT OUT.npz
(`--save CHECKPOINT OUT_FOLDER` writes the folder as the reference's `save_pretrained` does.)

Per sample query and page (`colembed_export.pipeline.verify`'s, plus a few more page sizes): input ids,
attention mask, pixel values, image grid, the model's 3-D positions, and the embeddings, alone and
in one left-padded batch (the processor's padding side), real rows only.

Two shims, both for the absence of torchvision (never installed beside torch here), neither
touching what is computed:
- transformers 5.x `image_processing_qwen2_vl` (the torchvision image processor) is imported by
  colpali-engine only for `smart_resize`; it is replaced by a module exposing the PIL backend's
  `smart_resize` (the same function).
- `Qwen3VLProcessor` requires a video processor (torchvision); `ImagesOnlyColQwen3Processor`
  declares only the image processor (the PIL `Qwen2VLImageProcessorPil`) and the tokenizer. Images
  and text never reach the video processor.

Imports torch, transformers 5.x and colpali-engine: never imported by colembed or the exporter.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np

QUERIES = ("What was the revenue in 2023?", "", "表格中的数字是多少？", "  spaces around  ")


def reference_pages() -> list:
    """The export check's sample pages plus sizes that hit both pixel bounds and odd aspects,
    and pages whose files carry a transparency key (a palette PNG and GIF, an RGB PNG), decoded
    as a user would open them: transformers 5.x composites those pixels onto white."""
    import io

    from PIL import Image

    from colembed_export.pipeline.verify import sample_pages

    rng = np.random.default_rng(7)
    extra = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in ((37, 300), (520, 410), (1200, 900))
    ]
    keyed = []
    page = Image.fromarray(rng.integers(0, 256, (170, 250, 3), dtype=np.uint8))
    for image, fmt, key in (
        (page.quantize(12), "PNG", 5),
        (page.quantize(12), "GIF", 5),
        (page, "PNG", page.getpixel((0, 0))),
    ):
        encoded = io.BytesIO()
        image.save(encoded, fmt, transparency=key)
        keyed.append(Image.open(io.BytesIO(encoded.getvalue())))
    return sample_pages() + extra + keyed


def _shim_torchvision_free() -> None:
    import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.smart_resize = pil.smart_resize
        sys.modules[name] = stub


def load_reference(folder: Path, dtype=None, attention: str | None = None):
    """(model, processor): colpali-engine's ColQwen3 in eval mode (fp32 unless `dtype`; the
    attention implementation `attention`, else transformers' default) and its processor. The
    parity run uses the defaults; benchmarks/embed/torch_reference.py times it in fp32 eager and bf16
    SDPA."""
    import json

    import torch

    _shim_torchvision_free()
    from colpali_engine.models import ColQwen3, ColQwen3Processor
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImagesOnlyColQwen3Processor(ColQwen3Processor):
        attributes = ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, **kwargs):
            # ProcessorMixin.__init__ checks the declared attributes; skip Qwen3VLProcessor's
            # video-processor wiring, keep ColQwen3Processor's left padding.
            super(ColQwen3Processor.__mro__[2], self).__init__(image_processor, tokenizer, **kwargs)
            self.image_token = "<|image_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token = "<|video_pad|>"
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_start_token = "<|vision_start|>"
            self.vision_end_token = "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
            self.tokenizer.padding_side = "left"

    config = json.loads((folder / "preprocessor_config.json").read_text())
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=config["patch_size"],
        merge_size=config["merge_size"],
        temporal_patch_size=config["temporal_patch_size"],
        image_mean=config["image_mean"],
        image_std=config["image_std"],
        size={"shortest_edge": config["min_pixels"], "longest_edge": config["max_pixels"]},
    )
    tokenizer = Qwen2TokenizerFast.from_pretrained(folder)
    processor = ImagesOnlyColQwen3Processor(image_processor=image_processor, tokenizer=tokenizer)
    extra = {} if attention is None else {"attn_implementation": attention}
    model = ColQwen3.from_pretrained(folder, dtype=dtype or torch.float32, **extra).eval()
    return model, processor


def _rows(batch, embeddings, i: int) -> np.ndarray:
    return embeddings[i][batch["attention_mask"][i] == 1].numpy()


def embed_reference(model, processor, queries, pages, batched_pages: int) -> dict[str, np.ndarray]:
    """What a colpali-engine model and processor give for `queries` and `pages`, keyed as the tests
    read it: per query (`query<i>`) and page (`page<i>`) the ids, for a page also the pixels, grid
    and the model's 3-D positions, and the embeddings (real rows), each item alone and all queries
    / the first `batched_pages` pages in one left-padded batch (`*_batched`). Both families'
    reference scripts run it (ColQwen3's `run`, ColQwen3.5's `reference_colpali.py embed`)."""
    import torch

    found: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for i, query in enumerate(queries):
            batch = processor.process_queries([query])
            found[f"query{i}_ids"] = batch["input_ids"][0].numpy()
            found[f"query{i}"] = _rows(batch, model(**batch), 0)
        batch = processor.process_queries(list(queries))
        embeddings = model(**batch)
        for i in range(len(queries)):
            found[f"query{i}_batched"] = _rows(batch, embeddings, i)
        for i, page in enumerate(pages):
            batch = processor.process_images([page])
            grid = batch["image_grid_thw"]
            n = int(grid[0, 1] * grid[0, 2])
            found[f"page{i}_ids"] = batch["input_ids"][0].numpy()
            found[f"page{i}_pixels"] = batch["pixel_values"][0, :n].numpy()
            found[f"page{i}_grid"] = grid[0].numpy()
            positions, _ = model.get_rope_index(
                batch["input_ids"],
                mm_token_type_ids=batch["mm_token_type_ids"],
                image_grid_thw=grid,
                attention_mask=batch["attention_mask"],
            )
            found[f"page{i}_positions"] = positions[:, 0].numpy()
            found[f"page{i}"] = _rows(batch, model(**batch), 0)
        batch = processor.process_images(list(pages[:batched_pages]))
        embeddings = model(**batch)
        for i in range(batched_pages):
            found[f"page{i}_batched"] = _rows(batch, embeddings, i)
    return found


def run(folder: Path, out: Path) -> None:
    model, processor = load_reference(folder)
    np.savez(out, **embed_reference(model, processor, QUERIES, reference_pages(), 4))


def save(folder: Path, out: Path) -> None:
    """The checkpoint as the reference saves it (`ColQwen3.save_pretrained` and the processor's
    `save_pretrained` on transformers 5.x): the folder a user's own fine-tune arrives as."""
    model, processor = load_reference(folder)
    model.save_pretrained(out)
    processor.save_pretrained(out)


USAGE = (
    "usage: python -m colembed_export.families.qwen3.reference CHECKPOINT OUT.npz\n"
    "       python -m colembed_export.families.qwen3.reference --save CHECKPOINT OUT_FOLDER"
)

if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--save":
        save(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 3:
        run(Path(sys.argv[1]), Path(sys.argv[2]))
    else:
        raise SystemExit(USAGE)
