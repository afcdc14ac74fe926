"""The search plan of "two-stage" search: which cheap stages pick the pages exact MaxSim reranks.

One home for the plan and its limits; edge.py and server.py translate a plan into their client's
nested prefetches. Every returned score is the exact MaxSim of the query against the stored `page`
vectors; a plan decides only which pages get scored, so a page is missed only when no stage ranks
it among its candidates.

Plans, by what the index holds:
- Token table (Qdrant Edge folders, tokens.py; a schema-3 folder, which stores no rows / cols,
  always runs this plan, with whatever table it has): `TOKEN_CANDIDATES` pages by MaxSim of the query
  against every page's centroids (a numpy scan of every page: no gate), plus the `mean` vector's
  best `TOKEN_MEAN_CANDIDATES`. Chosen on the local-answer set (benchmarks/shared/local_answer.py: the
  answer in 1-3% of a page's tokens), where the schema-2 plan below found the needle for 20% of
  the queries at 10,000 pages (benchmarks/results/experiments/search-local-10k.md).
- Schema 2 without a token table (a Qdrant server; a schema-2 Edge folder whose table is missing
  or stale until `colembed upgrade`): the `mean` vector's best `MEAN_CANDIDATES` go to the rerank
  and its best `MEAN_POOL` form a pool in which MaxSim on the row- and column-pooled multivectors
  picks `POOLED_CANDIDATES` more each. Chosen at 10,000 page-wide-topic pages (p50 101 ms, recall
  0.89); on local answers it misses, because the pool is gated by the mean.
- Schema 1 (no `mean`): rows and cols pick `PREFETCH_CANDIDATES` each over every page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schema import COLS_VECTOR, MEAN_VECTOR, ROWS_VECTOR

TOKENS_STAGE = "tokens"  # not a Qdrant vector: the store's centroid table (tokens.py)
# The exact rerank costs ~0.3 ms a page, so the union stays <= ~300 pages.
TOKEN_CANDIDATES = 100  # pages the centroid scan sends to the rerank
TOKEN_MEAN_CANDIDATES = 100  # pages the mean vector adds (the page-wide-topic case)
MEAN_CANDIDATES = 150  # schema 2: pages the mean vector sends straight to the rerank
MEAN_POOL = 1000  # schema 2: pages the mean vector keeps for the rows / cols MaxSim stages
POOLED_CANDIDATES = 25  # schema 2: per rows / cols stage within MEAN_POOL
PREFETCH_CANDIDATES = 100  # schema 1: per rows / cols stage over every page
# "hybrid" (opt-in): the dense two-stage search's best HYBRID_CANDIDATES and the lexical (BM25)
# search's best HYBRID_CANDIDATES, fused by reciprocal rank fusion (score sum of 1 / (RRF_K +
# rank)): a page first in either list beats a page ranked low in both. RRF_K = 60 is the
# constant of the RRF paper (Cormack et al. 2009) and Qdrant's default; a page only one list
# holds still ranks by its rank there.
HYBRID_CANDIDATES = 50
RRF_K = 60


@dataclass(frozen=True)
class Stage:
    """A prefetch stage: the `limit` best pages by `using` (a vector: MaxSim against the query's
    tokens, or for `mean` the dot with their sum, `stage_query`; `TOKENS_STAGE`: the centroid
    table), among `within`'s pages if given."""

    using: str
    limit: int
    within: Stage | None = None


def two_stage_plan(schema: int, k: int, tokens: bool = False) -> list[Stage]:
    """The prefetch stages of "two-stage" search on an index of this schema version (`tokens`:
    the store searches with its centroid table); their union is reranked by exact MaxSim. Which
    vectors a plan reads: `Stage.using` (the store refuses a plan reading one it lacks)."""
    if schema == 1:
        return [Stage(name, max(k, PREFETCH_CANDIDATES)) for name in (ROWS_VECTOR, COLS_VECTOR)]
    if tokens:
        return [
            Stage(TOKENS_STAGE, max(k, TOKEN_CANDIDATES)),
            Stage(MEAN_VECTOR, max(k, TOKEN_MEAN_CANDIDATES)),
        ]
    pool = Stage(MEAN_VECTOR, max(k, MEAN_POOL))
    return [
        Stage(MEAN_VECTOR, max(k, MEAN_CANDIDATES)),
        *(Stage(name, max(k, POOLED_CANDIDATES), pool) for name in (ROWS_VECTOR, COLS_VECTOR)),
    ]


def stage_query(query: np.ndarray, using: str) -> np.ndarray:
    """What a stage scores pages with: the query's tokens, or their sum for the `mean` vector."""
    return query.sum(axis=0) if using == MEAN_VECTOR else query
