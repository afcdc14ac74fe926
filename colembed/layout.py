"""What a model folder holds: the file names, and which files loading a variant needs.

One place for the names both halves use (the exporter writes these files, the runtime, the FastEmbed
plugin and the registry read them), and one function for "the files this variant runs on", so the
registry's completeness check, the download list and the runtime's verification cannot disagree.
The folder's own manifest is the list of what was exported; `models.json` names no files.

Standard library only; the manifest is read through its accessors (`graph`, `scorer`).
"""

from __future__ import annotations

from typing import Any

MANIFEST_NAME = "colembed_manifest.json"
TOKENIZER_FILE = "tokenizer.json"
MAXSIM_FILE = "maxsim.onnx"
GRAPH_ROLES = ("vision", "text")
# The variant every export holds: the graphs as torch exported them, checked against the torch
# model. The other variants (int8, int4, fp16: export/variants/recipes.py) are derived from it and gated
# against it; it is what runs when no variant is named (DirectML aside: model.default_variant).
BASE_VARIANT = "fp32"


def variant_files(manifest: Any, variant: str) -> list[str]:
    """The files the runtime opens for `variant`: both graphs, their external data, the tokenizer."""
    names = []
    for role in GRAPH_ROLES:
        entry = manifest.graph(variant, role)
        names += [name for name in (entry.file, entry.data_file) if name]
    return names + [TOKENIZER_FILE]


def required_files(manifest: Any, variant: str = BASE_VARIANT) -> list[str]:
    """Every file a folder must hold to serve `variant`: the manifest, the variant's files and the
    scorer graph when the manifest lists one. A folder may hold fewer variants than were exported
    (a user may delete fp32 and keep int8): only the variant asked for is required."""
    scorer = [manifest.scorer.file] if manifest.scorer is not None else []
    return [MANIFEST_NAME, *variant_files(manifest, variant), *scorer]
