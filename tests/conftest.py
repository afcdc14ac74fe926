"""Shared fixtures: tiny random-weight ColQwen2 checkpoints of the real architecture, the pinned
reference (transformers 4.57.1 ColQwen2Processor / ColQwen2ForRetrieval, fp32), built once per run.
What tests import besides fixtures lives in `tests/fixtures/` (the parity tolerance, `build_once`,
page generators, documents, the ColQwen2.5 and ColQwen3 checkpoints).

The README's command runs the suite on two pytest-xdist workers, a whole file per worker
(`--dist loadfile`). Checkpoints and exports are built once per run for all workers
(`build_once`: the first worker to need one builds it under a file lock, the other waits for it),
and the files marked `heavy` are handed out first (`schedule`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.fixtures.builds import (
    ALT_HUB_REPO,
    ALT_HUB_REVISION,
    ALT_TOLERANCE,
    build_once,
    export_report,
)


# Offline by construction: nothing in the suite may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Fixtures that run the exporter (tens of seconds each on 2 cores). Every test that needs one is
# marked `slow`: `pytest -m "not slow"` runs the rest in a minute while iterating; the README's
# command runs everything.
EXPORTING_FIXTURES = frozenset(
    {
        "exported_tiny",
        "exported_tiny_default",
        "exported_variants",
        "exported_tiny_2_5",
        "exported_tiny_2_5_alt",
        "exported_2_5",
        "exported_alt_from_hub",
        "cli_export",
        "exported_colnomic_layout",
    }
)

# Files marked `heavy(build)` build, or are the first users of, one of these shared checkpoints or
# exports (`build_once`). They are handed out first, taking the builds in turn in this order, so the
# two xdist workers (loadfile, `--no-loadscope-reorder`) start on different builds and neither waits
# for the other's; every other file follows in collection order.
HEAVY_BUILDS = (
    "tiny-variants",
    "qwen2.5",
    "qwen3",
    "stress",
    "qwen3-stress",
    "qwen3.5",
    "tiny",
    "demo",
    "ray",
)


def schedule(items: list) -> list:
    """Heavy files first, one build after another in turn; files stay whole and in their order."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    queues: dict = {build: [] for build in HEAVY_BUILDS}
    light = []
    for path, file_items in files.items():
        mark = file_items[0].get_closest_marker("heavy")
        if mark is None:
            light.append(file_items)
            continue
        build = mark.args[0]
        if build not in queues:
            raise pytest.UsageError(f"{path}: heavy({build!r}) names no build in HEAVY_BUILDS")
        queues[build].append(file_items)
    ordered = []
    while any(queues.values()):
        for queue in queues.values():
            if queue:
                ordered.append(queue.pop(0))
    return [item for file_items in ordered + light for item in file_items]


def pytest_collection_modifyitems(items):
    for item in items:
        if EXPORTING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items[:] = schedule(items)


@pytest.fixture(autouse=True, scope="session")
def _private_colembed_cache(tmp_path_factory):
    """Hash stamps go to a per-run folder, never the developer's ~/.cache."""
    os.environ["COLEMBED_CACHE_DIR"] = str(tmp_path_factory.mktemp("colembed-cache"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Folder of the default tiny checkpoint ("tiny" preset, seed 0) with the real Qwen tokenizer."""
    from colembed_export.testing.tiny_qwen2 import build_checkpoint

    return (
        build_once(
            tmp_path_factory,
            "ckpt-tiny",
            lambda folder: build_checkpoint(folder / "tiny", "tiny", seed=0),
        )
        / "tiny"
    )


@pytest.fixture(scope="session")
def tiny_alt_checkpoint(tmp_path_factory):
    """A second architecture (other heads, mrope sections, depths, 64-dim output)."""
    from colembed_export.testing.tiny_qwen2 import build_checkpoint

    folder = build_once(
        tmp_path_factory,
        "ckpt-tiny-alt",
        lambda folder: build_checkpoint(folder / "tiny-alt", "tiny-alt", seed=1),
    )
    return folder / "tiny-alt"


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
    from colembed_export.pipeline.exporter import export_model

    return export_model(checkpoint, out, random_weights=True, **kwargs)


def _shared_export(tmp_path_factory, key: str, checkpoint, name: str, **kwargs):
    folder = build_once(tmp_path_factory, key, lambda f: _export(checkpoint, f / name, **kwargs))
    return export_report(folder / name)


@pytest.fixture(scope="session")
def exported_tiny(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint exported (with the check on) to a colembed model folder.

    Written with external data so that tests can tamper with a `.onnx_data` file. Tests that
    modify a folder must copy it first (`copy_model_folder`).
    """
    return _shared_export(
        tmp_path_factory, "exported-tiny", tiny_checkpoint, "tiny", external_data=True
    )


@pytest.fixture(scope="session")
def cli_export(tiny_checkpoint, tmp_path_factory):
    """`colembed export CHECKPOINT --out DIR --random-weights` run as a user runs it (a process of
    its own, the check on, the default weight layout): (folder, exit code, stdout, stderr)."""

    def build(folder):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "colembed.cli",
                "export",
                str(tiny_checkpoint),
                "--out",
                str(folder / "tiny-default"),
                "--random-weights",
            ],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        (folder / "run.txt").write_text(f"{run.returncode}\n{run.stdout}\0{run.stderr}")

    folder = build_once(tmp_path_factory, "cli-export", build)
    code, _, streams = (folder / "run.txt").read_text().partition("\n")
    stdout, _, stderr = streams.partition("\0")
    return folder / "tiny-default", int(code), stdout, stderr


@pytest.fixture(scope="session")
def exported_tiny_default(cli_export):
    """The tiny checkpoint exported exactly as `colembed export` does by default (weights inline in
    the graphs: no `.onnx_data`), the folder a user with a small model gets: the CLI's export."""
    folder, code, _, stderr = cli_export
    if code != 0:
        pytest.fail(f"colembed export failed ({code}): {stderr}")
    return export_report(folder)


@pytest.fixture(scope="session")
def exported_variants(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with every variant (int8, int4, fp16), external data on (so the `_data`
    naming of variants is covered too), the check on."""
    return _shared_export(
        tmp_path_factory,
        "exported-variants",
        tiny_checkpoint,
        "tiny",
        external_data=True,
        variants=["int8", "int4", "fp16"],
    )


# The one export of tiny-alt: named as a hub repo (huggingface_hub.snapshot_download, the boundary
# call, answers with the local folder), written over a copy of the tiny export (another model) with
# overwrite, the check on at half the default tolerance. Serves the second-architecture parity
# tests, the hub-source, overwrite and tolerance-plumbing tests.


@pytest.fixture(scope="session")
def exported_alt_from_hub(exported_tiny, tiny_alt_checkpoint, tmp_path_factory):
    """(report, snapshot_download's arguments, the parent folder's listing after the export)."""
    import json

    def build(folder):
        import huggingface_hub

        calls = {}

        def snapshot_download(repo_id, revision=None, allow_patterns=None, **_):
            calls.update(repo_id=repo_id, revision=revision, patterns=allow_patterns)
            return str(tiny_alt_checkpoint)

        out = shutil.copytree(exported_tiny.folder, folder / "existing")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
            from colembed_export.pipeline.exporter import export_model

            export_model(
                ALT_HUB_REPO,
                out,
                revision=ALT_HUB_REVISION,
                overwrite=True,
                tolerance=ALT_TOLERANCE,
            )
        listing = sorted(p.name for p in folder.iterdir())
        (folder.parent / f"{folder.name}.json").write_text(json.dumps([calls, listing]))

    folder = build_once(tmp_path_factory, "exported-alt", build)
    calls, listing = json.loads((folder.parent / f"{folder.name}.json").read_text())
    return export_report(folder / "existing"), calls, listing


@pytest.fixture(scope="session")
def exported_tiny_2_5(tmp_path_factory):
    """ColQwen2.5 "tiny-2.5" (windows of 2x2 merged tokens) exported from colpali-engine's
    published layout (`qwen2_5_vl` config, `custom_text_proj`), with the check on, and with every
    variant (int8, int4, fp16, each gated by the exporter): one export serves the family's fp32
    tests and its variant tests (tests/export/families/qwen2_5/test_variants.py)."""
    from tests.fixtures.qwen2_5 import checkpoint

    return _shared_export(
        tmp_path_factory,
        "exported-tiny-2.5",
        checkpoint(tmp_path_factory, "tiny-2.5", "colpali"),
        "tiny-2.5",
        variants=["int8", "int4", "fp16"],
    )


@pytest.fixture(scope="session")
def exported_tiny_2_5_alt(tmp_path_factory):
    """ColQwen2.5 "tiny-2.5-alt" (windows of 4x4 merged tokens, the 3B's 112 px; 64-dim vectors)
    exported from transformers' layout (`colqwen2` over `qwen2_5_vl`), with the check on."""
    from tests.fixtures.qwen2_5 import checkpoint

    return _shared_export(
        tmp_path_factory,
        "exported-tiny-2.5-alt",
        checkpoint(tmp_path_factory, "tiny-2.5-alt", "transformers"),
        "tiny-2.5-alt",
    )


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

    def make(name: str = "copy"):
        return shutil.copytree(exported_tiny.folder, tmp_path / name)

    return make


@pytest.fixture(scope="session")
def config(tiny_checkpoint):
    """colembed's PreprocessConfig read from the tiny checkpoint folder."""
    from colembed_export.families.preprocess_config import read_preprocess_config

    return read_preprocess_config(tiny_checkpoint)


@pytest.fixture(scope="session")
def encoder(tiny_checkpoint, config):
    """colembed's TextEncoder over the tiny checkpoint's (real Qwen) tokenizer."""
    from colembed.preprocess.text import TextEncoder

    return TextEncoder.from_file(tiny_checkpoint / "tokenizer.json", config)


@pytest.fixture
def onnxruntime_calls(monkeypatch):
    """What colembed asks of onnxruntime, recorded at onnxruntime's own API and passed through to
    the real sessions: `sessions`, one (graph file name, SessionOptions, providers) per
    InferenceSession made; `runs`, one {input name: shape} per run. Tests check what reaches
    onnxruntime (the options a user set, which graphs a call runs) without reading colembed's
    private attributes."""
    import onnxruntime as ort

    calls = {"sessions": [], "runs": []}
    real_init, real_run = ort.InferenceSession.__init__, ort.InferenceSession.run

    def init(self, path_or_bytes, sess_options=None, providers=None, *args, **kwargs):
        name = os.path.basename(path_or_bytes) if isinstance(path_or_bytes, (str, Path)) else None
        calls["sessions"].append((name, sess_options, providers))
        real_init(self, path_or_bytes, sess_options, providers, *args, **kwargs)

    def run(self, output_names, input_feed, run_options=None):
        calls["runs"].append({k: np.shape(v) for k, v in input_feed.items()})
        return real_run(self, output_names, input_feed, run_options)

    monkeypatch.setattr(ort.InferenceSession, "__init__", init)
    monkeypatch.setattr(ort.InferenceSession, "run", run)
    return calls
