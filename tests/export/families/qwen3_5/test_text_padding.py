"""Padding never changes a real token of ColQwen3.5's text side
(colembed_export.families.qwen3_5.text): any right-padded batch, any pad ids, any lengths across
a DeltaNet chunk, gives each row's real tokens what that row gives alone. Random weights, tiny
widths; the reference parity is tests/export/families/qwen3_5/test_text.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from colembed_export.testing.tiny_qwen3_5 import random_text_model  # noqa: E402

VOCAB = 97
CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    },
}
MODEL = random_text_model(CONFIG, seed=5, dim=12, scan_levels=0)  # up to 256 tokens


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: on a busy machine, torch's intra-op threads cost more than they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


rows = st.lists(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=80), min_size=1, max_size=3
)


@settings(max_examples=15, deadline=None)
@given(rows=rows, pad_id=st.integers(0, VOCAB - 1), extra=st.integers(0, 40))
def test_padding_never_changes_a_real_token(rows, pad_id, extra):
    length = max(len(r) for r in rows) + extra
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(rows), length, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    with torch.no_grad():
        batched = MODEL(input_ids=ids, attention_mask=mask)
        for i, row in enumerate(rows):
            alone = MODEL(input_ids=torch.tensor([row]))[0]
            assert (batched[i, : len(row)] - alone).abs().max() < 1e-5
            assert not batched[i, len(row) :].any()
