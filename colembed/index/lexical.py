"""Lexical term weights of a page's text, for hybrid search (`mode="hybrid"`).

BM25 as Qdrant computes it: a page's text becomes a sparse vector of term frequencies shaped by
BM25's k and b (`Bm25.embed_document`, qdrant-edge-py's own tokenizer: lowercased words, English
stop words and stemming), stored as the `schema.LEXICAL_VECTOR` sparse vector of a collection
created with Qdrant's IDF modifier, which weighs each term by its inverse document frequency over
the collection at query time; a query is its terms with weight 1 (`embed_query`). The same
weights go to Qdrant Edge and to a Qdrant server, so the two stores rank alike. Why Qdrant's
sparse vectors and no embedded lexical index beside the store: they filter with the same
`where=` in the same request, are fused with the dense result inside Qdrant (reciprocal rank
fusion), and need no second store to keep in step with the pages.
"""

from __future__ import annotations

import functools

import qdrant_edge as qe


@functools.lru_cache(maxsize=1)
def _model() -> qe.Bm25:
    return qe.Bm25()


def document_terms(text: str) -> tuple[list[int], list[float]]:
    """(term ids, BM25 weights) of a page's text; empty for a page without words."""
    vector = _model().embed_document(text)
    return list(vector.indices), list(vector.values)


def query_terms(text: str) -> tuple[list[int], list[float]]:
    """(term ids, weights) of a query (each distinct term once, weight 1)."""
    vector = _model().embed_query(text)
    return list(vector.indices), list(vector.values)
