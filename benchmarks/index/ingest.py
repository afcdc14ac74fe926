"""bench_index.py's ingest job: `Index.add` over PDFs against `model.embed_pages` alone, and each
stage's own cost (hash, render, pool + upsert, embed), in one subprocess per model.

What it models: scanned letter pages (`common.make_pdfs`) through the real pipeline, with the
tiny model (embedding unrealistically cheap) or the benchmark model at Qwen2-VL-2B widths and
2 + 2 layers (`embed_models.prepare_model`, shared with bench_embed.py's cache). What it does not:
the full depth (16x the layers: the embedding's share, and so the bound, is higher still), PDFs
with embedded images or fonts that cost more to render.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks.shared.common import BENCH_WORKDIR, make_pdfs, rss_mib

from colembed.layout import BASE_VARIANT

INGEST_MODELS = {  # name -> (label, files, pages per file)
    "tiny": (
        'tiny random-weight model (export/testing/tiny_qwen2.py "tiny"): unrealistically cheap embedding',
        6,
        4,
    ),
    "bench": (
        'Qwen2-VL-2B widths at 2 vision + 2 language layers (export/testing/tiny_qwen2.py "qwen2-vl-2b", '
        "as bench_embed.py --quick builds it): real per-layer cost, 1/16 of the depth",
        2,
        4,
    ),
}
INGEST_ROUNDS = 2


def ingest_model(name: str, given: Path | None, scratch: Path) -> Path:
    """The model folder for the ingest check: given, the tiny one (built here), or the 2+2-layer
    benchmark model (built once into bench_embed.py's --workdir cache, shared with it)."""
    if given is not None:
        return given
    if name == "bench":
        import types

        from benchmarks.shared.embed_models import prepare_model

        args = types.SimpleNamespace(
            family="colqwen2", vision_depth=2, text_layers=2, variants=[BASE_VARIANT]
        )
        BENCH_WORKDIR.mkdir(parents=True, exist_ok=True)
        return prepare_model(args, BENCH_WORKDIR, lambda m: print(m, file=sys.stderr))[1]
    from colembed_export.pipeline.exporter import export_model
    from colembed_export.testing.tiny_qwen2 import build_checkpoint

    checkpoint = build_checkpoint(scratch / "ckpt", "tiny", seed=0)
    return export_model(checkpoint, scratch / "model", name="colqwen2-tiny-random").folder


def _clock() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _since(start: tuple[float, float]) -> dict:
    """CPU seconds of every thread of this process, and wall seconds, since `start`."""
    return {"cpu_s": time.process_time() - start[0], "wall_s": time.perf_counter() - start[1]}


def source_costs(model, docs: Path) -> tuple[dict, list]:
    """Hashing and rendering alone (as the render thread does them), and the rendered pages."""
    from colembed.index.sources import Document, file_sha256

    paths = sorted(docs.glob("*.pdf"))
    start = _clock()
    for path in paths:
        file_sha256(path)
    costs = {"hash": _since(start)}
    start = _clock()
    images = []
    for path in paths:
        with Document(path, max_pixels=model.config.max_pixels) as doc:
            images += [image for _, image in doc.iter_pages(range(1, doc.pages + 1))]
    costs["render"] = _since(start)
    return costs, images


def store_cost(embedded: list, folder: Path, dim: int) -> dict:
    """Pooling and upserting these pages into a fresh store alone, as the writer thread does:
    one upsert per batch of 4, then a flush."""
    from colembed.index.schema import make_point
    from colembed.index.backends import open_store

    store = open_store(folder, dim=dim)
    payload = {
        "path": "/docs/a.pdf",
        "pages": len(embedded),
        "sha256": "0" * 64,
        "width": 1,
        "height": 1,
        "model": "m",
        "variant": BASE_VARIANT,
        "manifest_sha256": "0",
        "schema": 1,
    }
    start = _clock()
    for lo in range(0, len(embedded), 4):
        store.upsert(
            [
                make_point(*embedded[i], dict(payload, page=i + 1))
                for i in range(lo, min(lo + 4, len(embedded)))
            ]
        )
    store.flush()
    cost = _since(start)
    store.close()
    return cost


def bench_ingest(name: str, given: Path | None, scratch: Path) -> dict:
    """`Index.add` over PDFs against `model.embed_pages` over the same pages already rendered,
    in alternating rounds (best of each), with each stage's CPU cost and the bound they set."""
    import colembed

    label, files, pages = INGEST_MODELS[name]
    model = colembed.load(ingest_model(name, given, scratch / name))
    docs = scratch / f"pdfs-{name}"
    make_pdfs(docs, files, pages)
    costs, images = source_costs(model, docs)
    rounds: dict[str, list] = {"embed": [], "index": []}
    for r in range(INGEST_ROUNDS):
        start = _clock()
        embedded = model.embed_pages(images, batch_size=4)
        rounds["embed"].append(_since(start))
        with colembed.Index(scratch / name / f"db-{r}", model=model) as index:  # opened untimed
            start = _clock()
            result = index.add(docs, progress=False)
            rounds["index"].append(_since(start))
        assert result.pages_added == len(images) and result.ok, result
    costs["store"] = store_cost(embedded, scratch / name / "store-alone", model.embedding_size)
    n = len(images)
    embed = min(rounds["embed"], key=lambda x: x["wall_s"])
    index = min(rounds["index"], key=lambda x: x["wall_s"])
    per_page = {
        stage: {"cpu_ms": c["cpu_s"] / n * 1000, "wall_ms": c["wall_s"] / n * 1000}
        for stage, c in {**costs, "embed": embed, "index": index}.items()
    }
    other = sum(costs[s]["cpu_s"] for s in ("hash", "render", "store"))
    return {
        "model": label,
        "model_folder": str(given or name),
        "pages": n,
        "max_pixels": model.config.max_pixels,
        "ms_per_page": per_page,
        "rounds": rounds,
        "bound": embed["cpu_s"] / (embed["cpu_s"] + other),
        "embed_only_pages_per_s": n / embed["wall_s"],
        "index_pages_per_s": n / index["wall_s"],
        "ratio": embed["wall_s"] / index["wall_s"],
        "cpu_ratio": embed["cpu_s"] / index["cpu_s"],
        "peak_rss_mib": rss_mib()["peak"],
    }
