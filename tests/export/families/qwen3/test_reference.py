"""ColQwen3 against its pinned reference: colpali-engine 0.3.18 ColQwen3 on transformers 5.24.

The reference runs in its own environment (`colembed_export.testing.reference_env`); its ids, pixels,
grids, positions and embeddings are compared with colembed's numpy preprocessing (bit for bit),
with the export environment's model (transformers 4.57.1's Qwen3VLModel, `checkpoint_qwen3`) and
with the exported folder through colembed's runtime (per token, <= 1e-4), alone and batched, on
both tiny shapes. docs/reference-colqwen3.md records what these pin.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures.qwen3 import checkpoint, exported, qwen3_preset, reference  # noqa: F401

pytestmark = [pytest.mark.heavy("qwen3"), pytest.mark.slow]
TOLERANCE = 1e-4


def _preprocessing(folder):
    from colembed.preprocess.text import TextEncoder
    from colembed_export.families.preprocess_config import read_preprocess_config

    config = read_preprocess_config(folder)
    return config, TextEncoder.from_file(folder / "tokenizer.json", config)


def test_query_ids_are_the_processors(qwen3_preset, tmp_path_factory):
    from colembed_export.families.qwen3.reference import QUERIES

    ref = reference(tmp_path_factory, qwen3_preset)
    config, encoder = _preprocessing(checkpoint(tmp_path_factory, qwen3_preset))
    assert config.query_prefix == ""
    for i, ids in enumerate(encoder.encode_queries(list(QUERIES))):
        np.testing.assert_array_equal(ids, ref[f"query{i}_ids"], err_msg=repr(QUERIES[i]))


def test_page_ids_pixels_grids_and_positions_are_the_processors(qwen3_preset, tmp_path_factory):
    from colembed.preprocess.images import prepare_image
    from colembed.preprocess.positions import mrope_position_ids
    from colembed_export.families.qwen3.reference import reference_pages

    ref = reference(tmp_path_factory, qwen3_preset)
    config, encoder = _preprocessing(checkpoint(tmp_path_factory, qwen3_preset))
    from colembed.families import COLQWEN3

    for i, page in enumerate(reference_pages()):
        prepared = prepare_image(page, config, index=i, transparency=COLQWEN3.transparency)
        assert prepared.grid_thw == tuple(int(v) for v in ref[f"page{i}_grid"])
        assert prepared.patches.dtype == np.float32 and prepared.patches.shape[1] == 1536
        np.testing.assert_array_equal(prepared.patches, ref[f"page{i}_pixels"])  # bit for bit
        ids = encoder.page_prompt_ids(prepared.num_image_tokens)
        np.testing.assert_array_equal(ids, ref[f"page{i}_ids"])
        positions = mrope_position_ids(
            ids[None],
            np.ones((1, len(ids)), np.int64),
            [(prepared.grid_thw,)],
            image_token_id=config.image_token_id,
            vision_start_token_id=config.vision_start_token_id,
            merge_size=config.merge_size,
        )
        np.testing.assert_array_equal(positions[:, 0], ref[f"page{i}_positions"])


def test_the_export_environments_model_is_the_reference(qwen3_preset, tmp_path_factory):
    """transformers 4.57.1's Qwen3VLModel + colpali-engine's head (what the exporter wraps and
    checks against) gives colpali-engine 0.3.18's embeddings on transformers 5.24."""
    import torch

    from colembed_export.families.qwen3.checkpoint import load_colqwen3

    ref = reference(tmp_path_factory, qwen3_preset)
    model = load_colqwen3(checkpoint(tmp_path_factory, qwen3_preset))
    worst = 0.0
    with torch.no_grad():
        for key in sorted(k for k in ref if k.endswith("_ids")):
            item = key[: -len("_ids")]
            ids = torch.from_numpy(ref[key])[None]
            extra = {}
            if item.startswith("page"):
                extra = dict(
                    pixel_values=torch.from_numpy(ref[f"{item}_pixels"]),
                    image_grid_thw=torch.from_numpy(ref[f"{item}_grid"])[None],
                )
            got = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).embeddings[0]
            worst = max(worst, float(np.abs(got.numpy() - ref[item]).max()))
    assert worst <= 1e-6, worst


def test_the_exported_folder_gives_the_references_embeddings(qwen3_preset, tmp_path_factory):
    """Queries and pages of several sizes, alone and batched, per token <= 1e-4 against
    colpali-engine on transformers 5.24 (left-padded batches there, ragged rows here)."""
    import colembed
    from colembed_export.families.qwen3.reference import QUERIES, reference_pages

    ref = reference(tmp_path_factory, qwen3_preset)
    model = colembed.load(exported(tmp_path_factory, qwen3_preset))
    assert model.family.name == "colqwen3" and model.embedding_size == 320
    pages = reference_pages()
    figures = {}
    for i, got in enumerate(model.embed_queries(list(QUERIES))):
        figures[f"query {i} batched"] = np.abs(got - ref[f"query{i}_batched"]).max()
        (alone,) = model.embed_queries([QUERIES[i]])
        figures[f"query {i}"] = np.abs(alone - ref[f"query{i}"]).max()
    for i, got in enumerate(model.embed_images(pages[:4], batch_size=4)):
        figures[f"page {i} batched"] = np.abs(got - ref[f"page{i}_batched"]).max()
    for i, page in enumerate(pages):
        (alone,) = model.embed_images([page])
        assert alone.shape == ref[f"page{i}"].shape
        figures[f"page {i}"] = np.abs(alone - ref[f"page{i}"]).max()
    bad = {k: v for k, v in figures.items() if not v <= TOLERANCE}
    assert not bad, bad
    assert max(figures.values()) > 0  # a real comparison, not two copies of one array


ALONE = """
import sys

import numpy as np

import colembed
from colembed_export.families.qwen3.reference import QUERIES, reference_pages

model = colembed.load(sys.argv[1], threads=1)
out = [v for page in reference_pages()[:2] for v in model.embed_images([page])]
out += model.embed_queries(list(QUERIES))
np.savez(sys.argv[2], *out)
"""


def test_the_three_families_in_one_process_equal_each_alone(
    exported_tiny, exported_tiny_2_5, tmp_path_factory, tmp_path
):
    """ColQwen2, ColQwen2.5 and ColQwen3 loaded side by side share no state: each family alone in
    a fresh process, then all three in this one with their calls interleaved, give the same
    arrays."""
    import subprocess
    import sys

    import colembed
    from colembed_export.families.qwen3.reference import QUERIES, reference_pages

    folders = {
        "colqwen2": exported_tiny.folder,
        "colqwen2.5": exported_tiny_2_5.folder,
        "colqwen3": exported(tmp_path_factory, "tiny-3"),
    }
    alone = {}
    for family, folder in folders.items():
        out = tmp_path / f"{family}.npz"
        subprocess.run([sys.executable, "-c", ALONE, str(folder), str(out)], check=True)
        with np.load(out) as saved:
            alone[family] = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    models = {family: colembed.load(folder, threads=1) for family, folder in folders.items()}
    assert {f: m.family.name for f, m in models.items()} == {f: f for f in folders}
    together: dict[str, list] = {family: [] for family in folders}
    for page in reference_pages()[:2]:  # interleaved: each call between the other families'
        for family, model in models.items():
            together[family] += model.embed_images([page])
    for family, model in models.items():
        together[family] += model.embed_queries(list(QUERIES))
    for family in folders:
        assert len(together[family]) == len(alone[family]) == 2 + len(QUERIES)
        for got, want in zip(together[family], alone[family]):
            np.testing.assert_array_equal(got, want)
    assert together["colqwen3"][0].shape[1] == 320 and together["colqwen2"][0].shape[1] == 128


def test_variants_pass_their_gates_and_run(tmp_path_factory):
    """int8, int4 and fp16 of tiny-3: written only because each passed its gate against fp32
    (the manifest keeps the figures); each loads and embeds pages and queries near fp32."""
    import colembed
    from colembed_export.families.qwen3.reference import QUERIES, reference_pages

    folder = exported(tmp_path_factory, "tiny-3")
    fp32 = colembed.load(folder)
    assert set(fp32.manifest.variants) == {"fp32", "int8", "int4", "fp16"}
    pages, queries = reference_pages()[:2], list(QUERIES)
    want = fp32.embed_images(pages) + fp32.embed_queries(queries)
    for name in ("int8", "int4", "fp16"):
        check = fp32.manifest.checks[name]
        assert check["mean_cosine"] >= check["gate"]["mean_cosine"], (name, check.figures)
        model = colembed.load(folder, variant=name)
        got = model.embed_images(pages) + model.embed_queries(queries)
        for g, w in zip(got, want):
            assert g.shape == w.shape and np.isfinite(g).all()
            cosine = np.sum(g * w, axis=1) / np.linalg.norm(g, axis=1) / np.linalg.norm(w, axis=1)
            assert cosine.mean() > 0.95, (name, cosine.mean())


def test_an_index_takes_colqwen3_pages_and_refuses_another_family(
    exported_tiny, tmp_path, tmp_path_factory
):
    """The index's dims and grids come from the model (320-wide vectors, 32-px tokens); an index
    of ColQwen3 pages refuses a ColQwen2 model."""
    import colembed
    from colembed.index import Index, ModelMismatchError
    from colembed_export.families.qwen3.reference import reference_pages

    qwen3 = colembed.load(exported(tmp_path_factory, "tiny-3"))
    reference_pages()[0].save(tmp_path / "page.png")
    with Index(tmp_path / "db", model=qwen3) as index:
        index.add([tmp_path / "page.png"])
        assert len(index) == 1
        (hit,) = index.search("What was the revenue?", k=1)
        assert hit.file == str(tmp_path / "page.png")
    with pytest.raises(ModelMismatchError):
        Index(tmp_path / "db", model=colembed.load(exported_tiny.folder))


def test_a_folder_saved_by_the_reference_exports_as_its_source(tmp_path, tmp_path_factory):
    """What transformers 5.x's `save_pretrained` writes (the image processor inside
    processor_config.json, no preprocessor_config.json; `extra_special_tokens` as a list) exports,
    and the export embeds exactly as the folder it was saved from."""
    import json

    import colembed
    from colembed_export.pipeline.exporter import export_model
    from colembed_export.families.qwen3.reference import QUERIES, reference_pages
    from colembed_export.testing.reference_env import run_reference

    saved = tmp_path / "saved"
    run_reference(
        "colembed_export.families.qwen3.reference",
        "--save",
        checkpoint(tmp_path_factory, "tiny-3"),
        saved,
    )
    assert not (saved / "preprocessor_config.json").exists()
    assert "image_processor" in json.loads((saved / "processor_config.json").read_text())
    assert isinstance(
        json.loads((saved / "tokenizer_config.json").read_text())["extra_special_tokens"], list
    )
    export_model(saved, tmp_path / "model", random_weights=True)
    again = colembed.load(tmp_path / "model")
    source = colembed.load(exported(tmp_path_factory, "tiny-3"))
    pages, queries = reference_pages()[:3], list(QUERIES)
    for got, want in zip(
        again.embed_images(pages) + again.embed_queries(queries),
        source.embed_images(pages) + source.embed_queries(queries),
    ):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-6)
