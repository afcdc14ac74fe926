"""Token-level fidelity figures (`colembed.fidelity`): token classes, per-class figures, ranking
agreement. The gate's use of them is in test_variants.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colembed.fidelity import (
    DIGITS,
    PARTIAL,
    PUNCTUATION,
    SPECIAL,
    WHITESPACE,
    class_figures,
    describe_token,
    ranking_agreement,
    token_class,
    token_cosines,
)


@pytest.mark.parametrize(
    "text, kind",
    [
        ("3", DIGITS),
        (" 2023", DIGITS),
        ("١٢", DIGITS),
        ("Q3", DIGITS),
        (" ", WHITESPACE),
        ("\t", WHITESPACE),
        ("\u3000", WHITESPACE),
        (" (", PUNCTUATION),
        ("$", PUNCTUATION),
        ("%)", PUNCTUATION),
        ("—", PUNCTUATION),
        ("😀", PUNCTUATION),
        ("\ufffd", PARTIAL),
        ("", PARTIAL),
        (" revenue", "letters: LATIN"),
        ("数字", "letters: CJK"),
        ("Привет", "letters: CYRILLIC"),
        ("µ", "letters: other scripts"),
    ],
)
def test_token_classes(text, kind):
    assert token_class(text) == kind
    assert token_class(text, special=True) == SPECIAL


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_every_text_has_one_class(text):
    kind = token_class(text)
    assert kind in (DIGITS, WHITESPACE, PUNCTUATION, PARTIAL) or kind.startswith("letters: ")


def test_class_figures_by_hand():
    items = [
        (
            "q0",
            np.array([0.99, 0.5, 0.98]),
            ["a", "3", " "],
            ["letters: LATIN", DIGITS, WHITESPACE],
        ),
        ("q1", np.array([0.97, 0.9]), ["7", "b"], [DIGITS, "letters: LATIN"]),
    ]
    figures = class_figures(items)
    digits = figures["token_classes"][DIGITS]
    assert digits["tokens"] == 2 and digits["mean"] == pytest.approx((0.5 + 0.97) / 2)
    assert digits["min"] == 0.5 and digits["worst"] == {
        "item": "q0",
        "index": 1,
        "text": "3",
        "cosine": 0.5,
    }
    assert figures["token_classes"]["letters: LATIN"]["min"] == 0.9
    assert figures["worst_token"]["class"] == DIGITS and figures["worst_token"]["text"] == "3"
    assert "token 1 '3' (digits) of 'q0': cosine 0.5000" == describe_token(figures["worst_token"])


def test_a_broken_token_is_the_worst_never_a_passing_one():
    got = np.array([[1.0, 0.0], [np.nan, 0.0], [0.0, 1.0]], np.float32)
    want = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], np.float32)
    cos = token_cosines(got, want)
    assert cos[0] == 1.0 and math.isnan(cos[1])
    figures = class_figures(
        [("q", cos, ["a", "1", "b"], ["letters: LATIN", DIGITS, "letters: LATIN"])]
    )
    assert figures["worst_token"]["text"] == "1"
    with pytest.raises(ValueError, match="shapes differ"):
        token_cosines(got, want[:2])


def test_ranking_agreement_by_hand():
    fp32 = np.array([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3]])
    variant = np.array([[0.4, 0.1, 0.5], [0.2, 0.8, 0.3]])  # query 0's first page changes
    found = ranking_agreement(variant, fp32, k=2)
    assert found["top1_agreement"] == 0.5 and found["topk_overlap"] == 1.0 and found["k"] == 2
    assert ranking_agreement(np.zeros((2, 0)), np.zeros((2, 0)))["top1_agreement"] is None
