"""Ranking metrics over one query's ranking, as BEIR and MTEB report them (pytrec_eval's
definitions): graded relevance, linear gain.

- `ndcg_at_k`: DCG = sum over ranks i <= k of rel_i / log2(i + 1), divided by the DCG of the
  ideal ordering of every judged document (grades sorted high to low, cut at k).
- `recall_at_k`: relevant documents (grade > 0) in the top k / all relevant documents.
- `mrr_at_k`: 1 / rank of the first relevant document in the top k, 0 when none is there.

A ranking is a sequence of document ids, best first, in the order the index returned them (tied
scores keep that order); an id seen twice counts at its first rank only. Documents the ranking
names but the labels do not have grade 0. A query with no relevant document has no defined
value: callers leave it out (`ValueError` here).
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping, Sequence


def _first_k(ranking: Sequence[Hashable], k: int) -> list[Hashable]:
    if k < 1:
        raise ValueError(f"k must be >= 1, not {k}")
    seen: set[Hashable] = set()
    out = []
    for doc in ranking:
        if doc not in seen:
            seen.add(doc)
            out.append(doc)
        if len(out) == k:
            break
    return out


def _relevant(labels: Mapping[Hashable, float]) -> dict[Hashable, float]:
    relevant = {doc: float(grade) for doc, grade in labels.items() if grade > 0}
    if not relevant:
        raise ValueError("the query has no relevant document (no grade above 0)")
    return relevant


def dcg(gains: Sequence[float]) -> float:
    return sum(g / math.log2(rank + 1) for rank, g in enumerate(gains, 1))


def ndcg_at_k(ranking: Sequence[Hashable], labels: Mapping[Hashable, float], k: int) -> float:
    relevant = _relevant(labels)
    found = dcg([relevant.get(doc, 0.0) for doc in _first_k(ranking, k)])
    ideal = dcg(sorted(relevant.values(), reverse=True)[:k])
    return found / ideal


def recall_at_k(ranking: Sequence[Hashable], labels: Mapping[Hashable, float], k: int) -> float:
    relevant = _relevant(labels)
    return sum(doc in relevant for doc in _first_k(ranking, k)) / len(relevant)


def mrr_at_k(ranking: Sequence[Hashable], labels: Mapping[Hashable, float], k: int) -> float:
    relevant = _relevant(labels)
    for rank, doc in enumerate(_first_k(ranking, k), 1):
        if doc in relevant:
            return 1.0 / rank
    return 0.0


def overlap_at_k(ranking: Sequence[Hashable], reference: Sequence[Hashable], k: int) -> float:
    """The share of the reference's top k that this ranking's top k holds (1.0: the same set)."""
    ours, theirs = _first_k(ranking, k), _first_k(reference, k)
    if not theirs:
        return 1.0 if not ours else 0.0
    return len(set(ours) & set(theirs)) / len(theirs)
