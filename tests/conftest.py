"""Shared fixtures: tiny random-weight ColQwen2 checkpoints of the real architecture, the pinned
reference (transformers 4.57.1 ColQwen2Processor / ColQwen2ForRetrieval, fp32), built once per run;
and the suite's one parity tolerance, one reference-rows helper and one page generator (tests
import them: `from conftest import PARITY_TOLERANCE, reference_rows, noise_page`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from fixtures_images import rgb as noise_page  # noqa: F401  (the one page generator: seeded noise)

# Max abs difference per token between colembed's vectors and the reference model's (fp32; the
# exporter's own check uses the same bound by default).
PARITY_TOLERANCE = 1e-4

# Offline by construction: nothing in the suite may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Fixtures that run the exporter (tens of seconds each on 2 cores). Every test that needs one is
# marked `slow`: `pytest -m "not slow"` runs the rest in a minute while iterating; the README's
# command runs everything.
EXPORTING_FIXTURES = frozenset({"exported_tiny", "exported_tiny_default", "exported_variants",
                                "exported_tiny_2_5", "exported_tiny_2_5_alt", "exported_2_5"})


def pytest_collection_modifyitems(items):
    for item in items:
        if EXPORTING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def reference_rows(model, batch) -> np.ndarray:
    """The reference model's vectors for the first item of a processor batch, padding removed."""
    import torch

    with torch.no_grad():
        out = model(**batch).embeddings[0]
    return out[batch["attention_mask"][0] == 1].numpy()


@pytest.fixture(autouse=True, scope="session")
def _private_colembed_cache(tmp_path_factory):
    """Hash stamps go to a per-run folder, never the developer's ~/.cache."""
    os.environ["COLEMBED_CACHE_DIR"] = str(tmp_path_factory.mktemp("colembed-cache"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Folder of the default tiny checkpoint ("tiny" preset, seed 0) with the real Qwen tokenizer."""
    from colembed_export.tiny import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_alt_checkpoint(tmp_path_factory):
    """A second architecture (other heads, mrope sections, depths, 64-dim output)."""
    from colembed_export.tiny import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-alt", "tiny-alt", seed=1)


@pytest.fixture(scope="session")
def reference_processor(tiny_checkpoint):
    from transformers import ColQwen2Processor

    return ColQwen2Processor.from_pretrained(tiny_checkpoint, use_fast=False)


@pytest.fixture(scope="session")
def reference_model(tiny_checkpoint):
    import torch
    from transformers import ColQwen2ForRetrieval

    torch.manual_seed(0)
    return ColQwen2ForRetrieval.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def _export(checkpoint, out, **kwargs):
    from colembed_export.exporter import export_model

    return export_model(checkpoint, out, random_weights=True, **kwargs)


@pytest.fixture(scope="session")
def exported_tiny(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint exported (with the check on) to a colembed model folder.

    Written with external data so that tests can tamper with a `.onnx_data` file. Tests that
    modify a folder must copy it first (`copy_model_folder`).
    """
    return _export(tiny_checkpoint, tmp_path_factory.mktemp("exported") / "tiny",
                   external_data=True)


@pytest.fixture(scope="session")
def exported_tiny_default(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint exported exactly as `colembed export` does by default (weights inline in
    the graphs: no `.onnx_data`), the folder a user with a small model gets."""
    return _export(tiny_checkpoint, tmp_path_factory.mktemp("exported") / "tiny-default")


@pytest.fixture(scope="session")
def exported_tiny_2_5(tmp_path_factory):
    """ColQwen2.5 "tiny-2.5" (windows of 2x2 merged tokens) exported from colpali-engine's
    published layout (`qwen2_5_vl` config, `custom_text_proj`), with the check on."""
    from qwen2_5_fixtures import checkpoint

    return _export(checkpoint(tmp_path_factory, "tiny-2.5", "colpali"),
                   tmp_path_factory.mktemp("exported") / "tiny-2.5")


@pytest.fixture(scope="session")
def exported_tiny_2_5_alt(tmp_path_factory):
    """ColQwen2.5 "tiny-2.5-alt" (windows of 4x4 merged tokens, the 3B's 112 px; 64-dim vectors)
    exported from transformers' layout (`colqwen2` over `qwen2_5_vl`), with the check on."""
    from qwen2_5_fixtures import checkpoint

    return _export(checkpoint(tmp_path_factory, "tiny-2.5-alt", "transformers"),
                   tmp_path_factory.mktemp("exported") / "tiny-2.5-alt")


@pytest.fixture(scope="session", params=["tiny-2.5", "tiny-2.5-alt"])
def exported_2_5(request):
    """(preset, export report) for each ColQwen2.5 preset, from the two session exports above."""
    name = {"tiny-2.5": "exported_tiny_2_5", "tiny-2.5-alt": "exported_tiny_2_5_alt"}[request.param]
    return request.param, request.getfixturevalue(name)


@pytest.fixture(scope="session")
def tiny_model(exported_tiny):
    import colembed

    return colembed.load(exported_tiny.folder)


@pytest.fixture
def copy_model_folder(exported_tiny, tmp_path):
    """A private copy of the exported tiny folder, safe to tamper with."""
    import shutil

    def make(name: str = "copy"):
        return shutil.copytree(exported_tiny.folder, tmp_path / name)

    return make


@pytest.fixture(scope="session")
def config(tiny_checkpoint):
    """colembed's PreprocessConfig read from the tiny checkpoint folder."""
    from colembed.preprocess.config import PreprocessConfig

    return PreprocessConfig.from_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="session")
def encoder(tiny_checkpoint, config):
    """colembed's TextEncoder over the tiny checkpoint's (real Qwen) tokenizer."""
    from colembed.preprocess.text import TextEncoder

    return TextEncoder.from_file(tiny_checkpoint / "tokenizer.json", config)
