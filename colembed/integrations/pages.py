"""The pages a retriever hands to a framework, from a `colembed.Index` or from `colembed serve`.

A `PageHit` is one found page: its text layer (`""` for a PDF page without one, None for an
image or a scan: the page then has only pixels), where its image is (`file` and 1-based `page`;
over HTTP also `image_url`, the server's rendering of the page), the file's user metadata, the
score (MaxSim, or the fusion score in hybrid mode) and the page's id in the index.

`HttpSearch` speaks `/v1/search` (docs/serve.md) with httpx and checks what comes back: a reply
that is not the documented shape is an error naming the field, never a half-read hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin

from ..errors import ColembedError

API_KEY_HEADER = "X-API-Key"


class RetrieverError(ColembedError, RuntimeError):
    """A search the retriever asked for failed (the server's status and its reason), or its
    reply is not what colembed serve sends."""


@dataclass(frozen=True)
class PageHit:
    id: str
    file: str
    page: int
    score: float
    text: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    image_url: str | None = None
    text_truncated: bool = False

    def document_metadata(self) -> dict[str, Any]:
        """The framework document's metadata: where the page is, its score, the user's metadata
        (under "metadata": its keys are the user's, never mixed with these)."""
        return {
            "source": self.file,
            "file": self.file,
            "page": self.page,
            "score": self.score,
            "page_id": self.id,
            "image_url": self.image_url,
            "has_text": self.text is not None,
            "text_truncated": self.text_truncated,
            "metadata": dict(self.metadata),
        }


def index_hits(index: Any, query: str, *, k: int, mode: str, where: Any) -> list[PageHit]:
    """The k best pages of a `colembed.Index` for one query."""
    return [
        PageHit(
            h.id,
            h.file,
            h.page,
            float(h.score),
            h.text,
            h.metadata,
            text_truncated=h.text_truncated,
        )
        for h in index.search(query, k=k, mode=mode, where=where)
    ]


class HttpSearch:
    """`/v1/search` of a colembed serve at `url` (its root, e.g. "http://127.0.0.1:8000").
    `client`: an httpx.Client to use (its base URL, transport, proxies), else one is made."""

    def __init__(
        self, url: str, *, api_key: str | None = None, client: Any = None, timeout: float = 60.0
    ) -> None:
        import httpx

        self.url = url.rstrip("/") + "/"
        self._headers = {API_KEY_HEADER: api_key} if api_key else {}
        self._client = client if client is not None else httpx.Client(timeout=timeout)
        self._owns_client = client is None
        self._errors = (httpx.HTTPError,)

    def search(self, query: str, *, k: int, mode: str, where: Any) -> list[PageHit]:
        body: dict[str, Any] = {"query": query, "k": k, "mode": mode}
        if where is not None:
            body["where"] = where
        endpoint = urljoin(self.url, "v1/search")
        try:
            reply = self._client.post(endpoint, json=body, headers=self._headers)
        except self._errors as e:
            raise RetrieverError(f"{endpoint}: {e}") from None
        if reply.status_code != 200:
            raise RetrieverError(f"{endpoint}: HTTP {reply.status_code}: {_reason(reply)}")
        try:
            results = reply.json()["results"]
            hits = results[0]["hits"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RetrieverError(f"{endpoint}: the reply has no results[0].hits") from None
        return [self._hit(h, n, endpoint) for n, h in enumerate(hits)]

    def _hit(self, h: Any, n: int, endpoint: str) -> PageHit:
        where = f"{endpoint}: hit {n}"
        if not isinstance(h, dict):
            raise RetrieverError(f"{where} is not an object")
        checks = {"id": str, "file": str, "page": int, "score": (int, float)}
        for key, kind in checks.items():
            if not isinstance(h.get(key), kind) or isinstance(h.get(key), bool):
                raise RetrieverError(f"{where}: field {key!r} is {h.get(key)!r}")
        text, meta, image = h.get("text"), h.get("metadata") or {}, h.get("image_url")
        if text is not None and not isinstance(text, str):
            raise RetrieverError(f"{where}: field 'text' is not a string")
        if not isinstance(meta, dict):
            raise RetrieverError(f"{where}: field 'metadata' is not an object")
        if image is not None and not isinstance(image, str):
            raise RetrieverError(f"{where}: field 'image_url' is not a string")
        return PageHit(
            h["id"],
            h["file"],
            h["page"],
            float(h["score"]),
            text,
            meta,
            urljoin(self.url, image.lstrip("/")) if image else None,
            bool(h.get("text_truncated", False)),
        )

    def close(self) -> None:
        if self._owns_client:
            self._client.close()


def _reason(reply: Any) -> str:
    try:
        detail = reply.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail if detail is not None else reply.text[:300])


def make_source(index: Any, url: str | None, api_key: str | None, client: Any):
    """A function query, k, mode, where -> PageHits over exactly one of an Index or a URL."""
    if (index is None) == (url is None):
        raise ValueError("give exactly one of index (a colembed.Index) or url (a colembed serve)")
    if index is not None:
        return lambda query, **kw: index_hits(index, query, **kw)
    return HttpSearch(url, api_key=api_key, client=client).search
