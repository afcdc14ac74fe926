"""A LangChain retriever over colembed (`pip install 'colembed[langchain]'`, docs/rag.md).

    from colembed.integrations.langchain import ColembedRetriever
    retriever = ColembedRetriever(index=colembed.Index("my-index"), k=4)      # in this process
    retriever = ColembedRetriever(url="http://127.0.0.1:8000", api_key=...)   # colembed serve
    docs = retriever.invoke("revenue in 2023")

Each Document's `page_content` is the page's text layer ("" for an image or a scan) and its
metadata says where the page image is (`file`, `page`, over HTTP `image_url`), its `score`,
`page_id` and the file's user `metadata` (pages.PageHit.document_metadata).
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, PrivateAttr

from ..index.store import DEFAULT_SEARCH_MODE
from .pages import make_source


class ColembedRetriever(BaseRetriever):
    """The k best pages of a `colembed.Index` (`index=`) or of a colembed serve (`url=`,
    `api_key=`, optionally `client=` an httpx.Client), searched in `mode` with filter `where`
    (docs/search.md#filters)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    index: Any = None
    url: str | None = None
    api_key: str | None = None
    client: Any = None
    k: int = 4
    mode: str = DEFAULT_SEARCH_MODE
    where: Any = None
    _source: Any = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        self._source = make_source(self.index, self.url, self.api_key, self.client)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        hits = self._source(query, k=self.k, mode=self.mode, where=self.where)
        return [
            Document(page_content=h.text or "", metadata=h.document_metadata(), id=h.id)
            for h in hits
        ]
