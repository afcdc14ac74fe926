"""The manifest: one JSON file that fully describes an exported model folder, read into types.

Written by the exporter (which builds the JSON as a dict and calls `Manifest.from_dict`), read and
validated by the runtime. It names the model family and its vision attention
(`colembed.families`), lists every file with its size and sha256, each graph's contract per
variant, the preprocessing constants (`PreprocessConfig`), the architecture numbers the host needs,
the export check's figures and the versions used. Nothing the runtime needs is read from anywhere
else in the folder except the tokenizer itself.

Every part is a frozen dataclass checked when it is built: a missing key, a wrong type, a zero
where a count belongs, a graph file the `files` table does not describe, or a name that is not a
plain relative name fails here, with a ManifestError naming the field (`variants.fp32.text.file`),
never later as a KeyError or ZeroDivisionError at the first embed, and never with a default filled
in (one reading, not a default: a manifest naming no family is a first-release ColQwen2 folder,
`_family` says why). `to_dict` gives back the JSON format (`from_dict(m.to_dict()) == m`).

Imports only the standard library and colembed's own torch-free modules.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Mapping

from .contracts import ORT_TYPES, GraphContract, TensorSpec
from .errors import ManifestError, ModelFolderError
from .families import FAMILIES, LEGACY_FAMILY, VisionAttention, VisionExtras, get_family
from .preprocess.config import PreprocessConfig

from .layout import BASE_VARIANT, GRAPH_ROLES, MANIFEST_NAME, TOKENIZER_FILE

FORMAT = "colembed-model"
FORMAT_VERSION = 1
_SHA256_HEX = 64
TOP_LEVEL_KEYS = (
    "format",
    "format_version",
    "model",
    "family",
    "vision_attention",
    "vision_extras",
    "embedding_dim",
    "preprocess",
    "architecture",
    "variants",
    "scorer",
    "files",
    "checks",
    "versions",
    "created",
)


# ----------------------------------------------------------------------------- field checking
def _get(
    d: Any,
    key: str,
    kind: type | tuple[type, ...],
    where: str,
    *,
    optional: bool = False,
    positive: bool = False,
) -> Any:
    """`d[key]`, refused unless it has type `kind` (bool is never an int here, an int is a float)."""
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(d).__name__}")
    name = f"{where}.{key}" if where else key
    if key not in d or d[key] is None:
        if optional:
            return None
        raise ManifestError(f"{name}: missing")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise ManifestError(f"{name}: expected {wanted}, got {type(value).__name__} {value!r:.60}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ManifestError(f"{name}: must be finite, got {value}")
    if positive and not value > 0:
        raise ManifestError(f"{name}: must be > 0, got {value}")
    return value


def _known_keys(d: Any, keys: tuple[str, ...], where: str) -> None:
    """Refuse keys this version does not know: they would be dropped silently by `to_dict`."""
    unknown = sorted(set(d) - set(keys)) if isinstance(d, dict) else []
    if unknown:
        raise ManifestError(
            f"{where or 'manifest'}: unknown keys {unknown} (a newer colembed's "
            "manifest? upgrade colembed)"
        )


def check_file_name(name: Any, where: str) -> str:
    """A manifest file name is a plain relative POSIX name inside the folder: no absolute path, no
    `..`, no drive, no backslash. (Links are caught when the file is opened: `safe_fs.inside`.)"""
    if not isinstance(name, str) or not name:
        raise ManifestError(f"{where}: expected a file name, got {name!r:.60}")
    parts = PurePosixPath(name).parts
    if (
        name.startswith("/")
        or "\\" in name
        or ":" in name
        or "\x00" in name
        or any(p in ("..", ".") for p in parts)
        or name != "/".join(parts)
    ):
        raise ManifestError(f"{where}: {name!r:.60} is not a plain relative name inside the folder")
    return name


def _frozen(mapping: dict) -> Mapping:
    return MappingProxyType(mapping)


# ------------------------------------------------------------------------------------ parts
@dataclass(frozen=True)
class FileEntry:
    """One file of the folder: its exact size and sha256 (lower-case hex)."""

    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> FileEntry:
        _known_keys(d, ("size", "sha256"), where)
        size = _get(d, "size", int, where)
        digest = _get(d, "sha256", str, where)
        if size < 0:
            raise ManifestError(f"{where}.size: must be >= 0, got {size}")
        if len(digest) != _SHA256_HEX or digest.strip("0123456789abcdef"):
            raise ManifestError(f"{where}.sha256: not a lower-case hex sha256: {digest!r:.70}")
        return cls(size=size, sha256=digest)


@dataclass(frozen=True)
class ModelInfo:
    """Which model the folder holds and where it came from."""

    name: str
    architecture: str
    source: str | None = None
    revision: str | None = None
    checkpoint_sha256: str | None = None
    random_weights: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "revision": self.revision,
            "architecture": self.architecture,
            "checkpoint_sha256": self.checkpoint_sha256,
            "random_weights": self.random_weights,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "model") -> ModelInfo:
        _known_keys(d, tuple(f.name for f in fields(cls)), where)
        return cls(
            name=_get(d, "name", str, where),
            architecture=_get(d, "architecture", str, where),
            source=_get(d, "source", str, where, optional=True),
            revision=_get(d, "revision", str, where, optional=True),
            checkpoint_sha256=_get(d, "checkpoint_sha256", str, where, optional=True),
            random_weights=_get(d, "random_weights", bool, where),
        )


@dataclass(frozen=True)
class Architecture:
    """The checkpoint's numbers the host and the benchmarks need (counts are > 0)."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]
    rope_theta: float
    vocab_size: int
    vision_depth: int
    vision_embed_dim: int
    vision_heads: int
    vision_mlp_ratio: float
    embedding_dim: int
    # The language model's per-head width as its config declares it: Qwen3's `head_dim` (128 for
    # Qwen3-VL-4B, not 2560 / 32), Qwen2-VL's and Qwen2.5-VL's hidden / heads. A manifest written
    # before it was recorded gets it from `mrope_section` (`from_dict`).
    text_head_dim: int = 0

    @property
    def vision_head_dim(self) -> int:
        return self.vision_embed_dim // self.vision_heads

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["mrope_section"] = list(self.mrope_section)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "architecture") -> Architecture:
        values: dict[str, Any] = {}
        _known_keys(d, tuple(f.name for f in fields(cls)), where)
        for f in fields(cls):
            if f.name == "mrope_section":
                section = _get(d, f.name, list, where)
                if len(section) != 3 or not all(
                    isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in section
                ):
                    raise ManifestError(
                        f"{where}.mrope_section: expected 3 positive ints, got {section!r:.60}"
                    )
                values[f.name] = tuple(section)
            elif f.name == "text_head_dim" and d.get(f.name) is None:
                # Written before the field existed: the M-RoPE sections span half of every head
                # (transformers splits each head's rotary by them; Qwen3-VL's configs keep it).
                values[f.name] = 2 * sum(values["mrope_section"])
            else:
                kind = float if f.type in ("float", float) else int
                values[f.name] = _get(d, f.name, kind, where, positive=True)
        if values["vision_embed_dim"] % values["vision_heads"]:
            raise ManifestError(
                f"{where}.vision_heads: {values['vision_heads']} does not divide "
                f"vision_embed_dim {values['vision_embed_dim']}"
            )
        return cls(**values)


@dataclass(frozen=True)
class ExportCheck:
    """The figures of one variant's export check, as the exporter recorded them.

    fp32 is checked against the torch model (`max_abs_diff` <= `tolerance`); a derived variant
    against fp32 (`mean_cosine`, `min_cosine`). `figures` keeps every figure (read-only); the
    check's kind decides which figures must be there. Indexing (`check["max_abs_diff"]`) reads
    `figures`.
    """

    figures: Mapping[str, Any]

    TORCH_KEYS = ("max_abs_diff", "tolerance")
    VARIANT_KEYS = ("mean_cosine", "min_cosine")

    def __getitem__(self, key: str) -> Any:
        return self.figures[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.figures.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dict(self.figures)))

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ExportCheck:
        keys = cls.TORCH_KEYS if isinstance(d, dict) and "max_abs_diff" in d else cls.VARIANT_KEYS
        for key in keys:
            _get(d, key, float, where)
        return cls(figures=_frozen(json.loads(json.dumps(d))))


def _contract(d: Any, where: str) -> GraphContract:
    """A graph contract, every tensor spec type-checked before `GraphContract` sees it."""
    _known_keys(d, ("role", "inputs", "outputs"), where)
    role = _get(d, "role", str, where)
    for kind in ("inputs", "outputs"):
        specs = _get(d, kind, list, where)
        for i, spec in enumerate(specs):
            at = f"{where}.{kind}[{i}]"
            _known_keys(spec, ("name", "dtype", "dims"), at)
            _get(spec, "name", str, at)
            dtype = _get(spec, "dtype", str, at)
            if dtype not in ORT_TYPES:
                raise ManifestError(f"{at}.dtype: {dtype!r:.30} is not one of {sorted(ORT_TYPES)}")
            for dim in _get(spec, "dims", list, at):
                if (
                    isinstance(dim, bool)
                    or not isinstance(dim, (int, str))
                    or isinstance(dim, int)
                    and dim < 0
                ):
                    raise ManifestError(f"{at}.dims: {dim!r:.30} is neither a size nor a name")
    contract = GraphContract.from_dict(d)
    if role != contract.role:  # pragma: no cover - from_dict copies it
        raise ManifestError(f"{where}.role: {contract.role!r}")
    return contract


@dataclass(frozen=True)
class GraphEntry:
    """One graph of one variant: its file, its external-data file (if any) and its contract."""

    file: str
    contract: GraphContract
    data_file: str | None = None
    opset: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "data_file": self.data_file,
            "opset": self.opset,
            "contract": self.contract.to_dict(),
        }

    @property
    def files(self) -> tuple[str, ...]:
        """The files this graph reads: the graph itself and its external data."""
        return (self.file,) if self.data_file is None else (self.file, self.data_file)

    @classmethod
    def from_dict(cls, d: Any, where: str = "graph") -> GraphEntry:
        _known_keys(d, ("file", "data_file", "opset", "contract"), where)
        data_file = _get(d, "data_file", str, where, optional=True)
        return cls(
            file=check_file_name(_get(d, "file", str, where), f"{where}.file"),
            data_file=None
            if data_file is None
            else check_file_name(data_file, f"{where}.data_file"),
            opset=_get(d, "opset", int, where, optional=True, positive=True),
            contract=_contract(_get(d, "contract", dict, where), f"{where}.contract"),
        )


def _output_width(entry: GraphEntry, where: str) -> Any:
    """The width of a graph's first output (the features or embeddings; ColQwen3's image graph
    has DeepStack features as a second output of the same width)."""
    outputs = entry.contract.outputs
    if not outputs or any(not o.dims or o.dims[-1] != outputs[0].dims[-1] for o in outputs):
        raise ManifestError(f"{where}.contract.outputs: expected output tensors of one width")
    return outputs[0].dims[-1]


# ---------------------------------------------------------------------------------- manifest
@dataclass(frozen=True)
class Manifest:
    """A model folder's manifest. Built by `from_dict` / `read_manifest`; consistent by construction
    (`__post_init__` checks every cross-reference)."""

    model: ModelInfo
    embedding_dim: int
    preprocess: PreprocessConfig
    architecture: Architecture
    variants: Mapping[str, Mapping[str, GraphEntry]]  # variant -> role -> graph
    files: Mapping[str, FileEntry]  # relative name -> size and sha256
    scorer: GraphEntry | None = None
    checks: Mapping[str, ExportCheck] = field(default_factory=lambda: _frozen({}))
    versions: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    created: str = ""
    family: str = LEGACY_FAMILY.name
    vision_attention: VisionAttention = VisionAttention(LEGACY_FAMILY.attention_kind)
    vision_extras: VisionExtras | None = None  # exactly for a family declaring them (ColQwen3)

    def __post_init__(self) -> None:
        problems = _inconsistencies(self)
        if problems:
            raise ManifestError("; ".join(problems), path=MANIFEST_NAME)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": self.model.to_dict(),
            "family": self.family,
            "vision_attention": self.vision_attention.to_dict(),
            **({"vision_extras": self.vision_extras.to_dict()} if self.vision_extras else {}),
            "embedding_dim": self.embedding_dim,
            "preprocess": self.preprocess.to_dict(),
            "architecture": self.architecture.to_dict(),
            "variants": {
                v: {r: g.to_dict() for r, g in graphs.items()}
                for v, graphs in self.variants.items()
            },
            "scorer": self.scorer.to_dict() if self.scorer else None,
            "files": {name: entry.to_dict() for name, entry in self.files.items()},
            "checks": {name: check.to_dict() for name, check in self.checks.items()},
            "versions": dict(self.versions),
            "created": self.created,
        }

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        """The manifest a JSON object describes; ManifestError naming the first bad field."""
        if not isinstance(d, dict):
            raise ManifestError(f"expected a JSON object, got {type(d).__name__}")
        _known_keys(d, TOP_LEVEL_KEYS, "")
        if "format" in d and d["format"] != FORMAT:
            raise ManifestError(f"format: {d['format']!r:.40} is not {FORMAT!r}")
        variants = _get(d, "variants", dict, "")
        if not variants:
            raise ManifestError("variants: empty (a model folder holds at least one variant)")
        files = _get(d, "files", dict, "")
        versions = _get(d, "versions", dict, "", optional=True) or {}
        for key, value in versions.items():
            _get(versions, key, str, "versions")
        scorer = _get(d, "scorer", dict, "", optional=True)
        family, attention = _family(d)
        return cls(
            model=ModelInfo.from_dict(_get(d, "model", dict, "")),
            family=family,
            vision_attention=attention,
            vision_extras=(
                None
                if d.get("vision_extras") is None
                else VisionExtras.from_dict(d["vision_extras"])
            ),
            embedding_dim=_get(d, "embedding_dim", int, "", positive=True),
            preprocess=PreprocessConfig.from_dict(_get(d, "preprocess", dict, "")),
            architecture=Architecture.from_dict(_get(d, "architecture", dict, "")),
            variants=_frozen(
                {
                    _variant_name(v): _frozen(
                        {
                            r: GraphEntry.from_dict(g, f"variants.{v}.{r}")
                            for r, g in _get(variants, v, dict, "variants").items()
                        }
                    )
                    for v in variants
                }
            ),
            files=_frozen(
                {
                    check_file_name(name, f"files[{name!r:.60}]"): FileEntry.from_dict(
                        entry, f"files.{name}"
                    )
                    for name, entry in files.items()
                }
            ),
            scorer=None if scorer is None else GraphEntry.from_dict(scorer, "scorer"),
            checks=_frozen(
                {
                    name: ExportCheck.from_dict(check, f"checks.{name}")
                    for name, check in (_get(d, "checks", dict, "", optional=True) or {}).items()
                }
            ),
            versions=_frozen(dict(versions)),
            created=_get(d, "created", str, "", optional=True) or "",
        )

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        return path

    def graph(self, variant: str, role: str) -> GraphEntry:
        if variant not in self.variants:
            raise ModelFolderError(
                f"variant {variant!r} is not in this folder; it has {sorted(self.variants)}"
                + (
                    " (write it with `colembed export ... --variant " + variant + "`)"
                    if variant != BASE_VARIANT
                    else ""
                ),
                path=MANIFEST_NAME,
            )
        try:
            return self.variants[variant][role]
        except KeyError:
            raise ModelFolderError(f"variant {variant!r} has no {role!r} graph", path=MANIFEST_NAME)


def _family(d: dict) -> tuple[str, VisionAttention]:
    """The folder's family and vision attention. Both or neither: a manifest without them was
    written by the first release, whose exporter took Qwen2-VL checkpoints only, so it is a
    ColQwen2 folder with full attention (`LEGACY_FAMILY`); that is a fact of its format, not a
    guess. One without the other is refused, as is a pair that contradicts the family."""
    if "family" not in d and "vision_attention" not in d:
        return LEGACY_FAMILY.name, VisionAttention(LEGACY_FAMILY.attention_kind)
    name = _get(d, "family", str, "")
    if name not in FAMILIES:
        raise ManifestError(
            f"family: {name!r:.40} is not one of {sorted(FAMILIES)} (a newer "
            "colembed's model? upgrade colembed)"
        )
    attention = VisionAttention.from_dict(_get(d, "vision_attention", dict, ""))
    if attention.kind != get_family(name).attention_kind:
        raise ManifestError(
            f"vision_attention.kind: {attention.kind!r} contradicts family "
            f"{name!r}, whose image graph attends "
            f"{get_family(name).attention_kind!r}"
        )
    return name, attention


def _variant_name(name: str) -> str:
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ManifestError(f"variants: {name!r:.40} is not a variant name")
    return name


def _inconsistencies(m: Manifest) -> list[str]:
    """Every cross-reference of the manifest that does not hold (empty when consistent)."""
    problems = []
    if m.family not in FAMILIES:
        problems.append(f"family: {m.family!r} is not one of {sorted(FAMILIES)}")
    elif m.vision_attention.kind != FAMILIES[m.family].attention_kind:
        problems.append(
            f"vision_attention.kind: {m.vision_attention.kind!r} contradicts family {m.family!r}"
        )
    if m.family in FAMILIES and (m.vision_extras is not None) != FAMILIES[m.family].vision_extras:
        problems.append(
            f"vision_extras: {'missing' if m.vision_extras is None else 'present'} "
            f"for family {m.family!r}"
        )
    elif m.vision_extras is not None and bool(m.vision_extras.deepstack_layers) != (
        FAMILIES[m.family].deepstack
    ):
        problems.append(
            f"vision_extras.deepstack_layers: {m.vision_extras.deepstack_layers} for family "
            f"{m.family!r}, whose tower {'has' if FAMILIES[m.family].deepstack else 'has no'} "
            "DeepStack"
        )
    if TOKENIZER_FILE not in m.files:
        problems.append(f"files: {TOKENIZER_FILE} is not described")
    if m.architecture.embedding_dim != m.embedding_dim:
        problems.append(
            f"architecture.embedding_dim {m.architecture.embedding_dim} != "
            f"embedding_dim {m.embedding_dim}"
        )
    if m.preprocess.vision_head_dim != m.architecture.vision_head_dim:
        problems.append(
            f"preprocess.vision_head_dim {m.preprocess.vision_head_dim} != "
            f"architecture vision_embed_dim / vision_heads "
            f"{m.architecture.vision_head_dim}"
        )
    widths = {
        "text": (m.embedding_dim, "embedding_dim"),
        "vision": (m.architecture.text_hidden, "architecture.text_hidden"),
    }
    for variant, graphs in m.variants.items():
        if sorted(graphs) != sorted(GRAPH_ROLES):
            problems.append(
                f"variants.{variant}: has graphs {sorted(graphs)}, expected {list(GRAPH_ROLES)}"
            )
        for role, entry in graphs.items():
            where = f"variants.{variant}.{role}"
            problems += _entry_problems(entry, role, where, m.files)
            width, source = widths.get(role, (None, ""))
            if width is not None and _output_width(entry, where) != width:
                problems.append(
                    f"{where}.contract: output width {_output_width(entry, where)!r} "
                    f"!= {width} ({source})"
                )
    if m.scorer is not None:
        problems += _entry_problems(m.scorer, "scorer", "scorer", m.files)
    unknown = sorted(set(m.checks) - set(m.variants))
    if unknown:
        problems.append(f"checks: {unknown} are not variants of this folder")
    return problems


def _entry_problems(
    entry: GraphEntry, role: str, where: str, files: Mapping[str, Any]
) -> list[str]:
    problems = [
        f"{where}: {name} is not described in files" for name in entry.files if name not in files
    ]
    if entry.contract.role != role:
        problems.append(f"{where}.contract.role: {entry.contract.role!r} != {role!r}")
    return problems


def read_manifest(folder: Path) -> Manifest:
    """The folder's manifest, fully validated; ManifestError (naming the field) otherwise."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            "no manifest; this is not a colembed model folder (make one with `colembed export`)",
            path=path,
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ManifestError(f"unreadable manifest ({e})", path=path) from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"not a {FORMAT} manifest", path=path)
    if data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"format_version {data.get('format_version')!r:.20} is not {FORMAT_VERSION}; "
            "re-export the model with this colembed version",
            path=path,
        )
    try:
        return Manifest.from_dict(data)
    except ManifestError as e:
        raise ManifestError(e.reason, path=path) from None


__all__ = [
    "Architecture",
    "ExportCheck",
    "FileEntry",
    "GraphEntry",
    "MANIFEST_NAME",
    "Manifest",
    "ModelInfo",
    "TensorSpec",
    "check_file_name",
    "read_manifest",
]
