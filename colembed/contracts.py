"""The graph contracts: every exported graph's inputs and outputs, declared once.

The contracts bind both halves. The exporter builds its `torch.onnx.export` call (names, dynamic
axes) from these objects and writes them into the manifest. At load the runtime checks the
manifest's copy against the family's own contract built from the folder's numbers
(`colqwen2_contracts`, `GraphContract.differences`), then each session's `get_inputs()` /
`get_outputs()` against it (`mismatches`), and builds every feed from the contract's input names
(`feeds`): an input name is spelled here and nowhere else. A dim is an int (fixed, filled from the
checkpoint at export time) or a str (symbolic: the same name means the same size across a graph's
tensors).

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The transformers class a model folder's graphs reproduce (written in the manifest's `model`).
ARCHITECTURE = "ColQwen2ForRetrieval"

# ONNX type strings as onnxruntime reports them, keyed by the names the manifest uses.
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "float32" | "float16" | "int64"
    dims: tuple[int | str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorSpec":
        return cls(name=d["name"], dtype=d["dtype"], dims=tuple(d["dims"]))

    def matches(self, ort_arg: Any) -> str | None:
        """None if an onnxruntime NodeArg (or an OpenVINO port described alike, whose tensor may
        carry several names: `names`) agrees with this spec, else what differs."""
        if self.name not in getattr(ort_arg, "names", {ort_arg.name}):
            return f"name {ort_arg.name!r} != {self.name!r}"
        if ort_arg.type != ORT_TYPES[self.dtype]:
            return f"{self.name}: type {ort_arg.type} != {ORT_TYPES[self.dtype]}"
        shape = list(ort_arg.shape)
        if len(shape) != len(self.dims):
            return f"{self.name}: rank {len(shape)} != {len(self.dims)}"
        for got, want in zip(shape, self.dims):
            if isinstance(want, int) and got != want:
                return f"{self.name}: shape {shape} != {list(self.dims)}"
        return None


@dataclass(frozen=True)
class GraphContract:
    """What one graph takes and gives. `role` is how the runtime refers to it."""

    role: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GraphContract":
        return cls(
            role=d["role"],
            inputs=tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_dict(t) for t in d["outputs"]),
        )

    def feeds(self, *arrays: Any) -> dict[str, Any]:
        """The session feed: `arrays` in the contract's input order, keyed by its input names."""
        if len(arrays) != len(self.inputs):
            raise TypeError(
                f"the {self.role} graph takes {len(self.inputs)} inputs "
                f"{[t.name for t in self.inputs]}, got {len(arrays)} arrays"
            )
        return {spec.name: array for spec, array in zip(self.inputs, arrays)}

    def differences(self, expected: "GraphContract") -> list[str]:
        """Every way this contract (a manifest's) differs from `expected` (the family's)."""
        problems = (
            [] if self.role == expected.role else [f"role {self.role!r} != {expected.role!r}"]
        )
        for kind, got, want in (
            ("input", self.inputs, expected.inputs),
            ("output", self.outputs, expected.outputs),
        ):
            if [t.name for t in got] != [t.name for t in want]:
                problems.append(f"{kind}s {[t.name for t in got]} != {[t.name for t in want]}")
                continue
            problems += [
                f"{kind} {g.name}: {g.dtype}{list(g.dims)} != {w.dtype}{list(w.dims)}"
                for g, w in zip(got, want)
                if g != w
            ]
        return problems

    def mismatches(self, session: Any) -> list[str]:
        """Every way a live onnxruntime session differs from this contract (empty if none)."""
        problems = []
        for kind, specs, args in (
            ("input", self.inputs, session.get_inputs()),
            ("output", self.outputs, session.get_outputs()),
        ):
            if len(args) != len(specs):
                problems.append(
                    f"{len(args)} {kind}s {[a.name for a in args]} != {len(specs)} "
                    f"{[s.name for s in specs]}"
                )
                continue
            problems += [f"{kind} {p}" for s, a in zip(specs, args) if (p := s.matches(a))]
        return problems


def vision_contract(patch_dim: int, vision_head_dim: int, out_hidden: int) -> GraphContract:
    """Image graph: B same-grid images of N patches each -> N/merge^2 merged features each.

    `rotary_cos`/`rotary_sin` are the vision tower's 2-D rotary tables for that grid (host-made,
    shared by the B images); attention is full within an image and never across images.
    """
    return GraphContract(
        role="vision",
        inputs=(
            TensorSpec("pixel_patches", "float32", ("images", "patches", patch_dim)),
            TensorSpec("rotary_cos", "float32", ("patches", vision_head_dim)),
            TensorSpec("rotary_sin", "float32", ("patches", vision_head_dim)),
        ),
        outputs=(TensorSpec("image_features", "float32", ("images", "merged_tokens", out_hidden)),),
    )


def text_contract(text_hidden: int, embedding_dim: int) -> GraphContract:
    """Text graph, shared by queries and pages.

    `image_feature_index[b, l]` is 0 for a token that keeps its own embedding and k+1 for a token
    that takes row k of `image_features`; the host builds it, so a query that happens to contain
    the `<|image_pad|>` string is embedded as the reference embeds it (as text). A text-only batch
    passes `image_features` with zero rows. Batches are right-padded (`attention_mask` is 1s then
    0s per row): the graph's attention is causal with no padding mask, so a real token never sees
    padding only because padding comes after it (export/families/qwen2/graphs.py `causal_attention`).
    """
    return GraphContract(
        role="text",
        inputs=(
            TensorSpec("input_ids", "int64", ("batch", "sequence")),
            TensorSpec("attention_mask", "int64", ("batch", "sequence")),
            TensorSpec("position_ids", "int64", (3, "batch", "sequence")),
            TensorSpec("image_feature_index", "int64", ("batch", "sequence")),
            TensorSpec("image_features", "float32", ("image_rows", text_hidden)),
        ),
        outputs=(TensorSpec("embeddings", "float32", ("batch", "sequence", embedding_dim)),),
    )


def colqwen2_contracts(
    *, patch_dim: int, vision_head_dim: int, text_hidden: int, embedding_dim: int
) -> dict[str, GraphContract]:
    """The ColQwen2 family's two graphs, by role, from the numbers a checkpoint (or a manifest)
    gives: the exporter writes these, the runtime checks a folder's manifest against them."""
    return {
        "vision": vision_contract(patch_dim, vision_head_dim, text_hidden),
        "text": text_contract(text_hidden, embedding_dim),
    }
