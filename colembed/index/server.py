"""A Qdrant server through qdrant-client (or qdrant-client's pure-Python local mode in a folder).

Everything qdrant-client-specific lives here. A new collection has schema 2 (`SERVER_SCHEMA`,
schema.py): the vectors of an Edge folder (MaxSim multivectors and the plain `mean`; dot, float16,
no HNSW graph) plus the pooled `rows` / `cols`, the same payload and point ids, so an index can move
from a laptop to a cluster. Its two-stage plan (plan.py) has no token stage (the centroid table
lives beside an Edge shard), so a collection searches with the mean-gated schema-2 plan, which
reads rows / cols (on local answers it can miss pages: docs/search.md). A collection's schema
version is read from its vector names; a point read from a schema-3 Edge folder gets its rows /
cols made from its page vectors (`Store.stored_vectors`).
Local mode (`path=`) is qdrant-client's own reference implementation: exact but ~8x slower than
Edge and memory hungry (benchmarks/); colembed uses it only to test this adapter.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from qdrant_client import QdrantClient, models
from qdrant_client.http.exceptions import ApiException

from .schema import (
    BULKY_FIELDS,
    DEFAULT_COLLECTION,
    LEXICAL_VECTOR,
    MEAN_VECTOR,
    PAGE_VECTOR,
    SCHEMA_VECTORS,
    SERVER_SCHEMA,
    PagePoint,
    schema_of,
)
from .errors import IndexNotFoundError, StoreError
from .plan import HYBRID_CANDIDATES, RRF_K, Stage, stage_query
from .store import INDEXED_FIELDS, UPSERT_BATCH, Store, as_point
from .where import QdrantTerms, Where, to_qdrant


@contextlib.contextmanager
def _client_errors(action: str, where: str) -> Iterator[None]:
    try:
        yield
    except (ApiException, OSError, ValueError, RuntimeError) as e:
        raise StoreError(f"{where}: Qdrant failed to {action}: {e}") from e


def _vector_params(dim: int, name: str) -> models.VectorParams:
    multi = (
        None
        if name == MEAN_VECTOR
        else models.MultiVectorConfig(comparator=models.MultiVectorComparator.MAX_SIM)
    )
    return models.VectorParams(
        size=dim,
        distance=models.Distance.DOT,
        multivector_config=multi,
        datatype=models.Datatype.FLOAT16,
        hnsw_config=models.HnswConfigDiff(m=0),
        on_disk=name == PAGE_VECTOR,
    )  # as on Edge (edge.py says why)


def _prefetch(
    query: np.ndarray, stage: Stage, where: models.Filter | None = None
) -> models.Prefetch:
    return models.Prefetch(
        query=stage_query(query, stage.using).tolist(),
        using=stage.using,
        limit=stage.limit,
        filter=where,
        prefetch=_prefetch(query, stage.within, where) if stage.within else None,
    )


_CLIENT_TERMS = QdrantTerms(
    equal=lambda key, value: models.FieldCondition(key=key, match=models.MatchValue(value=value)),
    one_of=lambda key, values: models.FieldCondition(key=key, match=models.MatchAny(any=values)),
    within=lambda key, bounds: models.FieldCondition(key=key, range=models.Range(**bounds)),
    prefix=lambda key, text: models.FieldCondition(key=key, match=models.MatchPrefix(prefix=text)),
    combine=models.Filter,
)


def client_filter(where: Where | None) -> models.Filter | None:
    """A checked filter (where.py) as qdrant-client's `Filter` (globs resolved by the store)."""
    return to_qdrant(where, _CLIENT_TERMS)


class ServerStore(Store):
    """One collection on a Qdrant server (`url`, `api_key`) or in a local-mode folder (`path`)."""

    upgrade_hint = "index the files into a new collection for the faster one"

    def __init__(
        self,
        *,
        url: str | None = None,
        api_key: str | None = None,
        path: Path | None = None,
        dim: int | None = None,
        collection: str | None = None,
    ) -> None:
        self.collection = collection or DEFAULT_COLLECTION
        self.local = path is not None
        self.location = f"{url or path} (collection {self.collection})"
        with _client_errors("connect", self.location):
            self.client = (
                QdrantClient(url=url, api_key=api_key)
                if url is not None
                else QdrantClient(path=str(path))
            )
            exists = self.client.collection_exists(self.collection)
        if exists:
            with _client_errors("read the collection", self.location):
                config = self.client.get_collection(self.collection).config.params
            params = config.vectors
            self.has_lexical = LEXICAL_VECTOR in (config.sparse_vectors or {})
            schema = schema_of(params) if isinstance(params, dict) else None
            if schema is None:
                raise StoreError(
                    f"{self.location}: collection is not a colembed index "
                    f"(vectors {sorted(params) if isinstance(params, dict) else params})"
                )
            self.dim, self.schema = int(params[PAGE_VECTOR].size), schema
            self._index_payload()
            return
        if dim is None:
            self.close()  # local mode locks its folder: a refused open must not keep it
            raise IndexNotFoundError(f"{self.location}: no index here")
        with _client_errors("create the collection", self.location):
            self.client.create_collection(
                self.collection,
                vectors_config={n: _vector_params(dim, n) for n in SCHEMA_VECTORS[SERVER_SCHEMA]},
                sparse_vectors_config={
                    LEXICAL_VECTOR: models.SparseVectorParams(modifier=models.Modifier.IDF)
                },
            )
        self.has_lexical = True
        self.dim, self.schema = dim, SERVER_SCHEMA
        self._index_payload()

    def _index_payload(self) -> None:
        """Payload indexes on `INDEXED_FIELDS`, created when missing (a Qdrant server filters
        faster with them; qdrant-client's local mode has none and ignores the call)."""
        if self.local:
            return
        with _client_errors("read the collection's payload indexes", self.location):
            have = set(self.client.get_collection(self.collection).payload_schema or {})
            kinds = {
                "keyword": models.PayloadSchemaType.KEYWORD,
                "integer": models.PayloadSchemaType.INTEGER,
            }
            for name, kind in INDEXED_FIELDS.items():
                if name not in have:
                    self.client.create_payload_index(self.collection, name, kinds[kind], wait=True)

    def upsert(self, points: Sequence[PagePoint]) -> None:
        for lo in range(0, len(points), UPSERT_BATCH):
            batch = [
                models.PointStruct(id=p.id, payload=p.payload, vector=self._named(p))
                for p in points[lo : lo + UPSERT_BATCH]
            ]
            with _client_errors("store pages", self.location):
                self.client.upsert(self.collection, points=batch, wait=True)

    def _named(self, point: PagePoint) -> dict[str, Any]:
        out: dict[str, Any] = {n: v.tolist() for n, v in self.stored_vectors(point).items()}
        terms = self.lexical_terms(point)
        if terms is not None:
            out[LEXICAL_VECTOR] = models.SparseVector(indices=terms[0], values=terms[1])
        return out

    def set_payload(self, ids: Sequence[str], payload: dict[str, Any]) -> None:
        if ids:
            with _client_errors("update page payloads", self.location):
                self.client.set_payload(
                    self.collection, payload=payload, points=list(ids), wait=True
                )

    def delete(self, ids: Sequence[str]) -> None:
        if ids:
            with _client_errors("delete pages", self.location):
                self.client.delete(
                    self.collection,
                    points_selector=models.PointIdsList(points=list(ids)),
                    wait=True,
                )

    def count(self) -> int:
        with _client_errors("count pages", self.location):
            return int(self.client.count(self.collection, exact=True).count)

    def payload_page(
        self, offset: Any, limit: int, doing: str
    ) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
        with _client_errors(doing, self.location):
            records, offset = self.client.scroll(
                self.collection,
                limit=limit,
                offset=offset,
                with_payload=models.PayloadSelectorExclude(exclude=list(BULKY_FIELDS)),
            )
        return [(str(r.id), dict(r.payload or {})) for r in records], offset

    def search_points(
        self, queries: list[np.ndarray], k: int, mode: str, where: Where | None, texts
    ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """`Store.search_points`; `where` filters in every prefetch stage and the exact rerank.
        "hybrid": the two-stage result and the BM25 search fused by RRF (edge.py alike)."""
        flt = client_filter(where)
        if mode == "hybrid":
            requests = [self._hybrid(q, text, k, flt) for q, text in zip(queries, texts)]
        else:
            requests = [self._request(q, k, mode, flt) for q in queries]
        with _client_errors("search", self.location):
            responses = self.client.query_batch_points(self.collection, requests=requests)
        return [
            [(str(p.id), float(p.score), dict(p.payload or {})) for p in r.points]
            for r in responses
        ]

    def _hybrid(
        self, query: np.ndarray, text: str, k: int, where: models.Filter | None
    ) -> models.QueryRequest:
        from .lexical import query_terms

        n = max(k, HYBRID_CANDIDATES)
        dense = self._request(query, n, "two-stage", where)
        stages = [
            models.Prefetch(
                query=dense.query, using=PAGE_VECTOR, prefetch=dense.prefetch, limit=n, filter=where
            )
        ]
        indices, values = query_terms(text)
        if indices:
            stages.append(
                models.Prefetch(
                    query=models.SparseVector(indices=indices, values=values),
                    using=LEXICAL_VECTOR,
                    limit=n,
                    filter=where,
                )
            )
        return models.QueryRequest(
            prefetch=stages,
            query=models.RrfQuery(rrf=models.Rrf(k=RRF_K)),
            limit=k,
            with_payload=True,
            filter=where,
        )

    def _request(
        self, query: np.ndarray, k: int, mode: str, where: models.Filter | None = None
    ) -> models.QueryRequest:
        stages = None if mode == "exact" else [_prefetch(query, s, where) for s in self.plan(k)]
        return models.QueryRequest(
            query=query.tolist(),
            using=PAGE_VECTOR,
            prefetch=stages,
            limit=k,
            with_payload=True,
            filter=where,
        )

    def points(self, ids: Sequence[str]) -> dict[str, PagePoint]:
        with _client_errors("read pages", self.location):
            records = self.client.retrieve(
                self.collection, ids=list(ids), with_payload=True, with_vectors=True
            )
        return {
            str(r.id): as_point(r)
            for r in records
            if self.readable(str(r.id), dict(r.payload or {}))
        }

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            with _client_errors("close", self.location):
                self.client.close()
            self.client = None
