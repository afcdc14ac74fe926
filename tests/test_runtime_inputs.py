"""Runtime behaviour around inputs: budgets, bad items mid-batch, types, the CLI."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

import colembed
from colembed.errors import ImageError, InputError


# Prepended to subprocess scripts: importing torch or transformers fails there, as in a venv
# that never had them.
BLOCK_TORCH = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers"):
                raise ImportError(f"No module named {name!r} (blocked)")
    sys.meta_path.insert(0, Block())
""")


def _page(h=900, w=700, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_max_image_tokens_budget_matches_reference(exported_tiny, tiny_checkpoint, reference_model):
    from transformers import ColQwen2Processor

    budget = 64
    model = colembed.load(exported_tiny.folder, max_image_tokens=budget)
    assert model.max_image_tokens == budget
    page = _page()
    (got,) = model.embed_images([page])
    reference = ColQwen2Processor.from_pretrained(tiny_checkpoint, use_fast=False,
                                                  max_pixels=budget * 28 * 28)
    batch = reference.process_images([page])
    image_tokens = int((batch["input_ids"][0] == reference.tokenizer.convert_tokens_to_ids(
        "<|image_pad|>")).sum())
    assert image_tokens <= budget
    with torch.no_grad():
        want = reference_model(**batch).embeddings[0][batch["attention_mask"][0] == 1].numpy()
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= 1e-4


def test_bad_image_mid_batch_names_it_and_keeps_earlier_pages(tiny_model):
    good = [_page(60, 80, s) for s in range(3)]
    items = good[:2] + [b"definitely not an image"] + good[2:]
    with pytest.raises(ImageError) as caught:
        tiny_model.embed_images(items, batch_size=2)
    assert caught.value.index == 2 and "item 2" in str(caught.value)
    assert len(caught.value.completed) == 2  # nothing already done is lost
    expected = tiny_model.embed_images(good[:2])
    for a, b in zip(caught.value.completed, expected):
        np.testing.assert_array_equal(a, b)
    # the model is still usable afterwards
    assert tiny_model.embed_images(good[2:])[0].shape[1] == tiny_model.embedding_size


def test_iterating_yields_pages_before_a_bad_one(tiny_model):
    items = [_page(60, 80, 1), _page(60, 80, 2), 42]
    iterator = tiny_model.iter_image_embeddings(items, batch_size=8)
    assert next(iterator).shape[1] == tiny_model.embedding_size
    assert next(iterator).shape[1] == tiny_model.embedding_size
    with pytest.raises(InputError, match="item 2"):
        next(iterator)


def test_image_forms_give_identical_vectors(tiny_model, tmp_path):
    page = _page(120, 90, 5)
    path = tmp_path / "page.png"
    page.save(path)
    data = path.read_bytes()
    forms = [page, path, str(path), data, io.BytesIO(data)]
    vectors = tiny_model.embed_images(forms, batch_size=5)
    for v in vectors[1:]:
        np.testing.assert_array_equal(v, vectors[0])


def test_query_type_errors_name_the_item(tiny_model):
    with pytest.raises(InputError, match="item 1"):
        tiny_model.embed_queries(["fine", None, "also fine"])
    with pytest.raises(InputError, match="single str"):
        tiny_model.embed_queries("not a list")
    with pytest.raises(ValueError, match="batch_size"):
        tiny_model.embed_queries(["a"], batch_size=0)


def test_empty_inputs_give_empty_lists(tiny_model):
    assert tiny_model.embed_queries([]) == []
    assert tiny_model.embed_images([]) == []


@pytest.mark.slow  # runs the exporter
def test_cli_export_and_info(tiny_checkpoint, tmp_path):
    out = tmp_path / "cli-model"
    run = subprocess.run(
        [sys.executable, "-m", "colembed.cli", "export", str(tiny_checkpoint), "--out", str(out),
         "--no-check"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "model folder" in run.stdout and (out / "colembed_manifest.json").is_file()
    info = subprocess.run([sys.executable, "-m", "colembed.cli", "info", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0 and '"embedding_dim": 128' in info.stdout
    again = subprocess.run(
        [sys.executable, "-m", "colembed.cli", "info", str(tmp_path)], capture_output=True,
        text=True, timeout=120)
    assert again.returncode == 2 and "colembed export" in again.stderr


def test_cli_export_without_torch_says_how_to_install(tmp_path):
    """The runtime CLI imports the exporter lazily; with torch absent it names the extra."""
    script = BLOCK_TORCH + textwrap.dedent("""
        from colembed.cli import main
        sys.exit(main(["export", "some/checkpoint", "--out", sys.argv[1]]))
    """)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "colembed[export]" in run.stderr


def test_runtime_works_with_torch_blocked(exported_tiny):
    """Embedding and scoring work in a process where importing torch/transformers fails."""
    script = BLOCK_TORCH + textwrap.dedent("""
        from PIL import Image
        import colembed
        model = colembed.load(sys.argv[1])
        pages = model.embed_images([Image.new("RGB", (100, 140), "white")])
        queries = model.embed_queries(["hello"])
        print(pages[0].shape, queries[0].shape, colembed.score(queries, pages).shape)
    """)
    run = subprocess.run([sys.executable, "-c", script, str(exported_tiny.folder)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "(1, 1)" in run.stdout


def test_queries_never_run_the_image_graph(exported_tiny):
    model = colembed.load(exported_tiny.folder)
    calls = {"vision": 0, "text": 0}
    for role, session in model._sessions.items():
        original = session.run

        def counted(feeds, _role=role, _original=original):
            calls[_role] += 1
            return _original(feeds)
        session.run = counted
    model.embed_queries(["a", "b", "c"], batch_size=2)
    assert calls == {"vision": 0, "text": 2}
    # one image-graph call per page (see model._vision_features); all pages share one text call
    model.embed_images([_page(60, 80, 1), _page(60, 80, 2), _page(90, 60, 3)], batch_size=3)
    assert calls == {"vision": 3, "text": 3}


@pytest.mark.parametrize("threads", [1, 3])
def test_threaded_preparation_keeps_order_and_error_semantics(exported_tiny, threads):
    """Pages of a batch are prepared in `threads` threads; results and errors are as if serial."""
    model = colembed.load(exported_tiny.folder, threads=threads)
    pages = [_page(60 + 14 * i, 80, i) for i in range(4)]
    serial = [model.embed_images([p])[0] for p in pages]
    with pytest.raises(ImageError) as caught:
        model.embed_images(pages[:3] + [b"\x89PNG broken"] + pages[3:], batch_size=5)
    assert caught.value.index == 3
    assert len(caught.value.completed) == 3
    for got, want in zip(caught.value.completed, serial):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for got, want in zip(model.embed_images(pages, batch_size=4), serial):
        np.testing.assert_allclose(got, want, atol=1e-5)
