"""Tiny ColQwen2.5 checkpoints for the tests/test_qwen2_5_*.py files, each built once per run.

Import the fixtures into a test module (`from qwen2_5_fixtures import qwen2_5_checkpoint`); each
checkpoint is built once per run (`conftest.build_once`), so all test modules and xdist workers
share one folder per checkpoint.
"""

from __future__ import annotations

import functools

import pytest

PRESETS = ("tiny-2.5", "tiny-2.5-alt")
SEEDS = {"tiny-2.5": 0, "tiny-2.5-alt": 1}


def checkpoint(tmp_path_factory, preset: str, layout: str):
    """Folder of `preset` in `layout`, built on first use (once per run for all xdist workers)."""
    from colembed_export.testing.tiny_qwen2_5 import build_checkpoint_2_5, to_colpali_layout
    from conftest import build_once

    name = f"{preset}-{layout}"
    # colpali: the same weights, converted by file (no second model build)
    source = checkpoint(tmp_path_factory, preset, "transformers") if layout == "colpali" else None

    def build(folder):
        if source is not None:
            to_colpali_layout(source, folder / name)
        else:
            build_checkpoint_2_5(folder / name, preset, seed=SEEDS[preset])

    return build_once(tmp_path_factory, f"qwen2_5-{name}", build) / name


@pytest.fixture(scope="session", params=PRESETS)
def qwen2_5_checkpoint(request, tmp_path_factory):
    """Each tiny preset, in the transformers layout (what `ColQwen2ForRetrieval` loads)."""
    return checkpoint(tmp_path_factory, request.param, "transformers")


@functools.cache
def load_reference(folder):
    """The test oracle (docs/reference-colqwen2_5.md): transformers 4.57.1 `ColQwen2ForRetrieval`
    over the Qwen2.5-VL config, fp32, eval mode. Shared: callers must not modify it."""
    import torch
    from transformers import ColQwen2ForRetrieval

    return ColQwen2ForRetrieval.from_pretrained(folder, dtype=torch.float32).eval()


def reference_processor(folder):
    """transformers 4.57.1 `ColQwen2Processor` with the PIL image processor, shared. The presets
    are built with the same processor files (compared byte for byte below), so one load serves
    all: the real tokenizer is the slow part of a load."""
    from pathlib import Path

    folder = Path(folder)
    for first in _PROCESSORS:
        if all((first / n).read_bytes() == (folder / n).read_bytes() for n in _PROCESSOR_FILES):
            return _PROCESSORS[first]
    from transformers import ColQwen2Processor

    _PROCESSORS[folder] = ColQwen2Processor.from_pretrained(folder, use_fast=False)
    return _PROCESSORS[folder]


_PROCESSORS: dict = {}
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

