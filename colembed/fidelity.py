"""How far a variant's vectors are from fp32's: per token, per kind of token, per item.

The export gate (`colembed_export.variants.gates`) and `colembed check-variant` (a user's own queries
and pages) judge a reduced-precision variant by the cosine of each token's vector to fp32's.
A variant's error follows what a token is, not only how long its sequence is: digits, spaces and
punctuation excite other channels than words do, so a set of plain sentences can pass while a
query of table numbers fails. Every query token is therefore put in a class by the text it stands
for (`token_class`), figures are kept per class, and the worst token is named by its text.

Torch-free: numpy and the model's own tokenizer (`TextEncoder.token_texts`).
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any, Sequence

import numpy as np

# Classes of a query token, by the text it stands for.
DIGITS = "digits"  # any decimal digit, of any script ("3", "2023", "١٢")
WHITESPACE = "whitespace"  # only spaces, tabs, newlines and other Unicode spaces
PUNCTUATION = "punctuation"  # only punctuation and symbols ("(", "$", "%", "—", "€")
PARTIAL = "partial character"  # a byte-level token that is part of one UTF-8 character
SPECIAL = "special"  # the tokenizer's special tokens (the query augmentation tokens)
# letters: "letters: <script>" by the first letter's script (`SCRIPTS`)


# Scripts with a class of their own (the first word of a letter's Unicode name); letters of any
# other script share "letters: other scripts".
SCRIPTS = (
    "LATIN",
    "CYRILLIC",
    "GREEK",
    "ARABIC",
    "HEBREW",
    "DEVANAGARI",
    "THAI",
    "HANGUL",
    "HIRAGANA",
    "KATAKANA",
    "CJK",
)


def _script(char: str) -> str:
    name = unicodedata.name(char, "")
    first = "CJK" if name.startswith(("CJK", "IDEOGRAPHIC")) else name.split(" ")[0]
    return first if first in SCRIPTS else "other scripts"


def token_class(text: str, *, special: bool = False) -> str:
    """The class of a token standing for `text` (see the module's classes)."""
    if special:
        return SPECIAL
    if not text or "\ufffd" in text:
        return PARTIAL
    if any(unicodedata.category(c) == "Nd" for c in text):
        return DIGITS
    if text.isspace():
        return WHITESPACE
    letters = [c for c in text if unicodedata.category(c)[0] in "LM"]
    if letters:
        return f"letters: {_script(letters[0])}"
    return PUNCTUATION


def token_cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Cosine of each row of `got` to the same row of `want` (both (tokens, dim)), in float64;
    a NaN or inf row gives NaN (never a passing figure)."""
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} and {want.shape}")
    a, b = got.astype(np.float64), want.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        cos = np.sum(a * b, axis=1) / np.maximum(norms, 1e-30)
    cos[~np.isfinite(a).all(axis=1)] = np.nan
    return cos


def _worse(cos: float, than: float | None) -> bool:
    """Whether `cos` is worse than `than` (None: nothing yet); NaN is worse than any number."""
    if than is None:
        return True
    if math.isnan(than):
        return False
    return math.isnan(cos) or cos < than


def class_figures(
    items: Sequence[tuple[str, np.ndarray, Sequence[str], Sequence[str]]],
) -> dict[str, Any]:
    """Per token class over query items (name, token cosines, token texts, token classes): the
    mean, the minimum, the token count and the worst token ({"item", "index", "text", "cosine"}),
    plus the worst token overall (`worst_token`, with its class)."""
    classes: dict[str, dict[str, Any]] = {}
    worst: dict[str, Any] | None = None
    for name, cos, texts, kinds in items:
        for i, (value, text, kind) in enumerate(zip(cos, texts, kinds)):
            value = float(value)
            row = classes.setdefault(kind, {"sum": 0.0, "tokens": 0, "min": None, "worst": None})
            row["sum"] += value
            row["tokens"] += 1
            if _worse(value, row["min"]):
                row["min"] = value
                row["worst"] = {"item": name, "index": i, "text": text, "cosine": value}
            if worst is None or _worse(value, worst["cosine"]):
                worst = {"item": name, "index": i, "text": text, "class": kind, "cosine": value}
    return {
        "token_classes": {
            kind: {
                "mean": row["sum"] / row["tokens"],
                "min": row["min"],
                "tokens": row["tokens"],
                "worst": row["worst"],
            }
            for kind, row in sorted(classes.items())
        },
        "worst_token": worst,
    }


def describe_token(token: dict[str, Any] | None) -> str:
    """ "token 52 ' ' (whitespace) of <item>: cosine 0.075", for messages and reports."""
    if not token:
        return "no token"
    kind = f" ({token['class']})" if "class" in token else ""
    return (
        f"token {token['index']} {token['text']!r}{kind} of {token['item']!r}: cosine "
        f"{token['cosine']:.4f}"
    )


def ranking_agreement(
    variant_scores: np.ndarray, fp32_scores: np.ndarray, k: int = 5
) -> dict[str, Any]:
    """How a variant's page ranking per query agrees with fp32's: the share of queries with the
    same top page, and the mean overlap of the top-`k` pages (a fraction of k)."""
    variant_scores, fp32_scores = np.asarray(variant_scores), np.asarray(fp32_scores)
    if variant_scores.shape != fp32_scores.shape or variant_scores.ndim != 2:
        raise ValueError(f"score tables differ: {variant_scores.shape} and {fp32_scores.shape}")
    queries, pages = fp32_scores.shape
    if not queries or not pages:
        return {
            "queries": queries,
            "pages": pages,
            "top1_agreement": None,
            "k": k,
            "topk_overlap": None,
        }
    k = min(k, pages)
    top1 = variant_scores.argmax(axis=1) == fp32_scores.argmax(axis=1)
    mine = np.argsort(-variant_scores, axis=1, kind="stable")[:, :k]
    theirs = np.argsort(-fp32_scores, axis=1, kind="stable")[:, :k]
    overlap = [len(set(a) & set(b)) / k for a, b in zip(mine.tolist(), theirs.tolist())]
    return {
        "queries": queries,
        "pages": pages,
        "top1_agreement": float(top1.mean()),
        "k": k,
        "topk_overlap": float(np.mean(overlap)),
    }


def check_variant(
    folder: Any,
    variant: str,
    queries: Sequence[str],
    pages: Sequence[Any],
    *,
    page_names: Sequence[str] | None = None,
    k: int = 5,
    **load_options: Any,
) -> dict[str, Any]:
    """`variant` of a model folder against its fp32 graphs on the caller's own queries and pages
    (what `colembed check-variant` runs): per item the mean and min token cosine (queries: the
    worst token by text), per query token class, and how the variant's page ranking for each
    query agrees with fp32's (`ranking_agreement`). `pages` are what `embed_images` takes."""
    from .layout import BASE_VARIANT
    from .model import load
    from .scoring import score

    names = list(page_names) if page_names is not None else [f"page {i}" for i in range(len(pages))]
    runs = {}
    for name in (BASE_VARIANT, variant):
        model = load(folder, variant=name, **load_options)
        runs[name] = (model.embed_queries(list(queries)), model.embed_images(list(pages)))
        encoder = model.text_encoder
        del model
    (want_q, want_p), (got_q, got_p) = runs[BASE_VARIANT], runs[variant]
    query_rows, class_items = [], []
    for i, (text, g, w) in enumerate(zip(queries, got_q, want_q)):
        cos = token_cosines(g, w)
        texts = encoder.token_texts(encoder.encode_queries([text])[0])
        kinds = [token_class(t, special=s) for t, s in texts]
        name = f"query {i}"
        class_items.append((name, cos, [t for t, _ in texts], kinds))
        worst = int(np.nanargmin(cos)) if np.isfinite(cos).any() else 0
        query_rows.append(
            {
                "item": name,
                "text": text,
                "tokens": int(cos.size),
                "mean": float(cos.mean()),
                "min": float(np.min(cos)),
                "worst_token": {"index": worst, "text": texts[worst][0], "class": kinds[worst]},
            }
        )
    page_rows = []
    for name, g, w in zip(names, got_p, want_p):
        cos = token_cosines(g, w)
        page_rows.append(
            {
                "item": name,
                "tokens": int(cos.size),
                "mean": float(cos.mean()),
                "min": float(np.min(cos)),
            }
        )
    if got_q and got_p:
        ranking = ranking_agreement(
            np.asarray(score(got_q, got_p)), np.asarray(score(want_q, want_p)), k
        )
    else:
        ranking = ranking_agreement(
            np.zeros((len(got_q), len(got_p))), np.zeros((len(got_q), len(got_p))), k
        )
    report = {"variant": variant, "queries": query_rows, "pages": page_rows, "ranking": ranking}
    report.update(class_figures(class_items))
    return report


__all__ = [
    "DIGITS",
    "PARTIAL",
    "PUNCTUATION",
    "SPECIAL",
    "WHITESPACE",
    "check_variant",
    "class_figures",
    "describe_token",
    "ranking_agreement",
    "token_class",
    "token_cosines",
]
