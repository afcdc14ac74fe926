"""Qwen3.5's Gated DeltaNet layer (colembed_export.families.qwen3_5.delta_net) against the delta
rule token by token (float64), against transformers 5.24's layer (the pinned reference, in its own
environment) and as an exported ONNX graph on onnxruntime. Tiny widths here; Qwen3.5-0.8B's widths
and long sequences are measured in benchmarks/results/experiments/qwen3_5-delta-rule.md.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from colembed_export.testing.tiny_qwen3_5 import random_delta_net  # noqa: E402
from colembed_export.families.qwen3_5.delta_net import (  # noqa: E402
    CHUNK,
    GROUP,
    GatedDeltaNet,
    _block_masks,
    gated_delta_rule,
    max_tokens,
    unit_lower_inverse,
)

# Grouped value heads (2 key heads serve 4 value heads), as Qwen3.5-4B's 16 / 32.
TINY = dict(
    hidden_size=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)
LENGTHS = (1, 7, 63, 64, 65, 200)


def tiny_layer(seed: int = 0, scan_levels: int = 3) -> GatedDeltaNet:
    return random_delta_net(TINY, seed=seed, scan_levels=scan_levels)


def recurrence(query, key, value, decay, beta):
    """The delta rule one token at a time, in float64 (transformers' recurrent form)."""
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[2:]
    query = query.repeat_interleave(v_heads // k_heads, 2).double()
    key = key.repeat_interleave(v_heads // k_heads, 2).double()
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6) / k_dim**0.5
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    state = torch.zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float64)
    out = torch.zeros(batch, length, v_heads, v_dim, dtype=torch.float64)
    for t in range(length):
        state = state * decay[:, t].double().exp()[..., None, None]
        k, q = key[:, t], query[:, t]
        delta = (value[:, t].double() - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[
            :, t, :, None
        ]
        state = state + k[..., None] * delta[..., None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q)
    return out


def test_block_doubling_inverts_a_unit_lower_triangular_matrix():
    strict = torch.randn(5, CHUNK, CHUNK).tril(-1) * 0.3
    inverse = unit_lower_inverse(strict, _block_masks(CHUNK))
    identity = torch.eye(CHUNK).expand(5, -1, -1)
    assert torch.allclose(inverse @ (identity + strict), identity, atol=1e-5)
    assert torch.equal(inverse.triu(1), torch.zeros_like(inverse))


@pytest.mark.parametrize("length", LENGTHS)
def test_the_chunked_rule_is_the_recurrence(length):
    g = torch.Generator().manual_seed(length)
    shape = (2, length)
    query, key = torch.randn(*shape, 2, 16, generator=g), torch.randn(*shape, 2, 16, generator=g)
    value = torch.randn(*shape, 4, 8, generator=g)
    decay = -torch.rand(*shape, 4, generator=g) * torch.tensor([0.01, 0.5, 2.0, 20.0])
    beta = torch.rand(*shape, 4, generator=g)
    found = gated_delta_rule(query, key, value, decay, beta, scan_levels=3)
    expected = recurrence(query, key, value, decay, beta)
    assert found.dtype == torch.float32
    assert (found.double() - expected).abs().max() < 1e-5


def test_the_scan_carries_the_state_across_every_chunk():
    """A state written in the first chunk and never decayed nor overwritten reaches the last token
    only through every scan level: the length needs two levels (a group's incoming state is the
    scan's result for the group before it, so one level reaches the third group, not the fourth);
    one level gives another answer."""
    g = torch.Generator().manual_seed(1)
    length = max_tokens(1) + CHUNK * GROUP + CHUNK
    query, key = (
        torch.randn(1, length, 2, 16, generator=g),
        torch.randn(1, length, 2, 16, generator=g),
    )
    value = torch.randn(1, length, 4, 8, generator=g)
    decay = torch.zeros(1, length, 4)
    beta = torch.zeros(1, length, 4)
    beta[:, :CHUNK] = torch.rand(1, CHUNK, 4, generator=g)
    expected = recurrence(query, key, value, decay, beta)
    enough = gated_delta_rule(query, key, value, decay, beta, scan_levels=2)
    too_few = gated_delta_rule(query, key, value, decay, beta, scan_levels=1)
    assert (enough.double() - expected).abs().max() < 1e-5
    assert (too_few.double() - expected)[:, -CHUNK:].abs().max() > 1e-2


def test_too_few_scan_levels_is_refused_naming_the_bound():
    layer = tiny_layer(scan_levels=1)
    hidden = torch.randn(1, max_tokens(1) + 1, TINY["hidden_size"])
    with pytest.raises(ValueError, match=f"at most {max_tokens(1)}"):
        layer(hidden, torch.ones(hidden.shape[:2], dtype=torch.int64))


def test_the_runtime_bound_is_the_exported_scans():
    """colembed refuses pages past `Family.max_text_tokens`; the exported layer computes exactly
    up to `max_tokens()` at its default depth: the two must be one number."""
    from colembed.families import COLQWEN3_5

    assert COLQWEN3_5.max_text_tokens == max_tokens()


def test_right_padding_does_not_change_real_tokens():
    layer = tiny_layer()
    hidden = torch.randn(2, 130, TINY["hidden_size"])
    mask = torch.ones(2, 130, dtype=torch.int64)
    mask[1, 70:] = 0
    with torch.no_grad():
        batched = layer(hidden, mask)
        alone = layer(hidden[1:, :70], mask[1:, :70])
    assert (batched[1, :70] - alone[0]).abs().max() < 1e-6


def _reference_outputs(layer, cases, tmp_path):
    from colembed_export.testing.reference_env import run_reference

    feed = {"config": json.dumps(TINY)}
    feed.update({f"w.{k}": v.numpy() for k, v in layer.state_dict().items()})
    for i, (hidden, mask) in enumerate(cases):
        feed[f"hidden{i}"], feed[f"mask{i}"] = hidden, mask
    np.savez(tmp_path / "in.npz", **feed)
    run_reference(
        "colembed_export.families.qwen3_5.reference",
        "layer",
        tmp_path / "in.npz",
        tmp_path / "out.npz",
    )
    with np.load(tmp_path / "out.npz") as out:
        return [out[f"out{i}"] for i in range(len(cases))]


def _padded_on_the_left(hidden, mask):
    """The right-padded batch with each row's padding moved before its real tokens."""
    hidden, mask = hidden.copy(), mask.copy()
    for row in range(len(mask)):
        real = int(mask[row].sum())
        hidden[row] = np.concatenate([hidden[row, real:], hidden[row, :real]])
        mask[row] = np.concatenate([mask[row, real:], mask[row, :real]])
    return hidden, mask


@pytest.mark.heavy("qwen3")
@pytest.mark.slow
def test_the_layer_is_transformers_qwen3_5_gated_delta_net(tmp_path):
    """The same weights and right-padded batches through transformers 5.24's layer (its torch
    path, no cache): every real token within 1e-5. The reference given the batch padded on the
    left (colpali-engine's side) gives its real tokens the same outputs."""
    layer = tiny_layer()
    rng = np.random.default_rng(0)
    cases = []
    for length in LENGTHS:
        hidden = rng.standard_normal((2, length, TINY["hidden_size"]), dtype=np.float32)
        mask = np.ones((2, length), np.int64)
        mask[1, max(1, length // 2) :] = 0
        cases.append((hidden, mask))
    left = [_padded_on_the_left(hidden, mask) for hidden, mask in cases]
    reference = _reference_outputs(layer, cases + left, tmp_path)
    for i, (hidden, mask) in enumerate(cases):
        with torch.no_grad():
            found = layer(torch.from_numpy(hidden), torch.from_numpy(mask)).numpy()
        real = mask.astype(bool)
        assert np.abs(found[real] - reference[i][real]).max() < 1e-5, hidden.shape
        left_mask = left[i][1].astype(bool)
        assert np.abs(found[real] - reference[len(cases) + i][left_mask]).max() < 1e-5


@pytest.mark.slow
def test_the_exported_graph_is_the_module(tmp_path):
    """torch.onnx.export (dynamo, opset 18, dynamic batch and length) then onnxruntime CPU: the
    module's outputs within 1e-5 on every length, with standard-domain ops only."""
    import onnx
    import onnxruntime as ort

    from colembed_export.constants import OPSET

    layer = tiny_layer()
    path = tmp_path / "delta.onnx"
    # Two groups of chunks or more: torch.export fixes a dimension that is 1 in the example.
    example = (torch.randn(2, 600, TINY["hidden_size"]), torch.ones(2, 600, dtype=torch.int64))
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    torch.onnx.export(
        layer,
        example,
        str(path),
        input_names=["hidden_states", "attention_mask"],
        output_names=["output"],
        dynamic_shapes={
            "hidden_states": {0: batch, 1: length},
            "attention_mask": {0: batch, 1: length},
        },
        opset_version=OPSET,
        dynamo=True,
        optimize=True,
        verbose=False,
        report=False,
    )
    model = onnx.load(str(path))
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert not {"Loop", "Scan", "If"} & {n.op_type for n in model.graph.node}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in LENGTHS:
        hidden = torch.randn(2, n, TINY["hidden_size"])
        mask = torch.ones(2, n, dtype=torch.int64)
        mask[1, max(1, n // 2) :] = 0
        with torch.no_grad():
            expected = layer(hidden, mask).numpy()
        found = session.run(
            None, {"hidden_states": hidden.numpy(), "attention_mask": mask.numpy()}
        )[0]
        real = mask.numpy().astype(bool)
        assert np.abs(found[real] - expected[real]).max() < 1e-5, n
