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

pytestmark = pytest.mark.heavy("tiny")


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
    reference = ColQwen2Processor.from_pretrained(
        tiny_checkpoint, use_fast=False, max_pixels=budget * 28 * 28
    )
    batch = reference.process_images([page])
    image_tokens = int(
        (batch["input_ids"][0] == reference.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()
    )
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


def test_cli_export_and_info(cli_export, tmp_path):
    """`colembed export` in a process of its own (conftest's `cli_export`, the folder the
    default-layout tests use), then `colembed info` on it and on a folder that is no model."""
    out, code, stdout, stderr = cli_export
    assert code == 0, stderr
    assert "model folder" in stdout and (out / "colembed_manifest.json").is_file()

    def info(folder):
        return subprocess.run(
            [sys.executable, "-m", "colembed.cli", "info", str(folder)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    shown = info(out)
    assert shown.returncode == 0 and '"embedding_dim": 128' in shown.stdout
    assert '"family": "colqwen2"' in shown.stdout and '"kind": "full"' in shown.stdout
    again = info(tmp_path)
    assert again.returncode == 1 and "colembed export" in again.stderr


def test_cli_export_without_torch_says_how_to_install(tmp_path):
    """The runtime CLI imports the exporter lazily; with torch absent it names the extra."""
    script = BLOCK_TORCH + textwrap.dedent("""
        from colembed.cli import main
        sys.exit(main(["export", "some/checkpoint", "--out", sys.argv[1]]))
    """)
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
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
    run = subprocess.run(
        [sys.executable, "-c", script, str(exported_tiny.folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "(1, 1)" in run.stdout


def _graph_runs(calls) -> dict[str, int]:
    """Runs per graph as onnxruntime saw them: the image graph is fed `pixel_patches`."""
    vision = sum("pixel_patches" in feeds for feeds in calls["runs"])
    return {"vision": vision, "text": len(calls["runs"]) - vision}


def test_queries_never_run_the_image_graph(exported_tiny, onnxruntime_calls):
    model = colembed.load(exported_tiny.folder)
    onnxruntime_calls["runs"].clear()
    model.embed_queries(["a", "b", "c"], batch_size=2)
    assert _graph_runs(onnxruntime_calls) == {"vision": 0, "text": 2}
    # one image-graph call per page (see model._vision_features); all pages share one text call
    model.embed_images([_page(60, 80, 1), _page(60, 80, 2), _page(90, 60, 3)], batch_size=3)
    assert _graph_runs(onnxruntime_calls) == {"vision": 3, "text": 3}


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


# ---------------------------------------------------------- per-item contract, query bound
def test_lone_surrogate_names_the_item_and_keeps_the_queries_before_it(tiny_model):
    queries = [f"query number {i}" for i in range(5)]
    with pytest.raises(InputError, match=r"item 3: query is not valid Unicode") as caught:
        tiny_model.embed_queries(queries[:3] + ["bad \ud800 text"] + queries[3:], batch_size=16)
    assert caught.value.index == 3 and len(caught.value.completed) == 3
    for got, want in zip(caught.value.completed, tiny_model.embed_queries(queries[:3])):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_control_characters_are_text_as_in_the_reference(tiny_model, encoder, reference_processor):
    texts = ["tab\there\nnewline", "nul\x00bell\x07esc\x1b[31m", "\x7f\x85\u2028"]
    want = reference_processor.process_queries(texts)
    for i, ids in enumerate(encoder.encode_queries(texts)):
        row = want["input_ids"][i][want["attention_mask"][i] == 1].numpy()
        np.testing.assert_array_equal(ids, row)
    assert [v.shape[0] for v in tiny_model.embed_queries(texts)] == [
        len(i) for i in encoder.encode_queries(texts)
    ]


@pytest.mark.parametrize("single", ["page.png", b"\x89PNG", "PATH", "IMAGE", "FILE"])
def test_one_image_instead_of_a_list_is_refused(tiny_model, tmp_path, single):
    from pathlib import Path

    page = _page(40, 40)
    page.save(tmp_path / "page.png")
    single = {"PATH": Path(tmp_path / "page.png"), "IMAGE": page, "FILE": io.BytesIO(b"data")}.get(
        single, single
    )
    with pytest.raises(InputError, match="single .*wrap it in a list"):
        tiny_model.embed_images(single)
    with pytest.raises(InputError, match="single"):
        next(tiny_model.iter_image_embeddings(single))
    with pytest.raises(InputError, match="expected an iterable"):
        tiny_model.embed_queries(42)


@pytest.mark.parametrize(
    "error",
    [
        TypeError,
        KeyError,
        SyntaxError,
        IndexError,
        ZeroDivisionError,
        EOFError,
        __import__("struct").error,
    ],
)
def test_any_decoder_failure_is_the_items_image_error(tiny_model, error):
    """A decoder raising something other than OSError (corrupt multi-frame TIFFs raise TypeError,
    KeyError, SyntaxError) is that page's ImageError; the pages before it are kept."""

    class Failing(io.BytesIO):
        def read(self, *args):
            raise error("decoder failure")

    good = [_page(60, 80, 1), _page(60, 80, 2)]
    with pytest.raises(ImageError, match=r"item 2: cannot decode image") as caught:
        tiny_model.embed_images(good + [Failing(b"x")], batch_size=3)
    assert len(caught.value.completed) == 2


def test_long_query_is_cut_to_the_bound_with_a_warning(tiny_model, encoder, tiny_checkpoint):
    from tokenizers import Tokenizer

    from colembed.errors import QueryTruncatedWarning

    limit = encoder.max_query_tokens
    assert limit == len(
        encoder.page_prompt_ids(encoder.config.max_pixels // encoder.config.pixels_per_image_token)
    )
    long = "word " * (3 * limit)
    with pytest.warns(QueryTruncatedWarning, match=rf"item 1: query of \d+ tokens cut to {limit}"):
        ids = encoder.encode_queries(["short", long])
    assert len(ids[1]) == limit
    # the uncut ids, from the checkpoint's tokenizer file read afresh (not the encoder's own)
    untouched = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    untouched.no_truncation()  # a tokenizer.json may carry its own cut
    full = np.asarray(untouched.encode(encoder.config.query_prefix + long).ids)
    pad = encoder.config.pad_token_id
    count = encoder.config.query_augmentation_count
    np.testing.assert_array_equal(ids[1][:-count], full[: limit - count])
    assert (ids[1][-count:] == pad).all()
    with pytest.warns(QueryTruncatedWarning):
        (vector,) = tiny_model.embed_queries([long])
    assert vector.shape[0] == limit
    exact = encoder.encode_queries(["word " * 10])[0]
    assert len(exact) < limit  # short queries are untouched (reference parity tests cover ids)


def test_queries_are_grouped_by_length_with_unchanged_results(exported_tiny, onnxruntime_calls):
    """One long query in a batch runs apart from the short ones; output order and values are
    those of embedding each query alone."""
    from colembed.model import _length_groups

    big = 10**9
    assert _length_groups([12, 13, 400, 12, 14], big) == [[0, 3, 1, 4], [2]]
    assert _length_groups([], big) == [] and _length_groups([5], 1) == [[0]]
    assert _length_groups([100] * 5, max_cells=2 * 100**2) == [[0, 1], [2, 3], [4]]
    model = colembed.load(exported_tiny.folder)
    queries = ["short one", "another short query", "long " * 300, "tiny", "a medium query here"]
    alone = [model.embed_queries([q])[0] for q in queries]
    onnxruntime_calls["runs"].clear()
    batched = model.embed_queries(queries, batch_size=5)
    runs = [feeds["input_ids"] for feeds in onnxruntime_calls["runs"]]
    assert len(runs) == 2 and max(r[1] for r in runs if r[0] == 4) < 20  # short ones unpadded
    for got, want in zip(batched, alone):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)
