"""A LlamaIndex retriever over colembed (`pip install 'colembed[llamaindex]'`, docs/rag.md).

    from colembed.integrations.llamaindex import ColembedRetriever
    retriever = ColembedRetriever(index=colembed.Index("my-index"), k=4)      # in this process
    retriever = ColembedRetriever(url="http://127.0.0.1:8000", api_key=...)   # colembed serve
    nodes = retriever.retrieve("revenue in 2023")          # NodeWithScore, best first

Each node is a TextNode whose text is the page's text layer ("" for an image or a scan) and
whose metadata says where the page image is (`file`, `page`, over HTTP `image_url`), its
`score`, `page_id` and the file's user `metadata`; the node's score is the hit's score.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from ..index.store import DEFAULT_SEARCH_MODE
from .pages import make_source

# what the LLM and an embedding model are not shown of a node's metadata (ids, URLs, numbers)
HIDDEN_FROM_MODELS = ["page_id", "image_url", "score", "has_text", "text_truncated"]


class ColembedRetriever(BaseRetriever):
    """The k best pages of a `colembed.Index` (`index=`) or of a colembed serve (`url=`,
    `api_key=`, optionally `client=` an httpx.Client), searched in `mode` with filter `where`
    (docs/search.md#filters)."""

    def __init__(
        self,
        index: Any = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        client: Any = None,
        k: int = 4,
        mode: str = DEFAULT_SEARCH_MODE,
        where: Any = None,
        **kwargs: Any,
    ) -> None:
        self._source = make_source(index, url, api_key, client)
        self.k, self.mode, self.where = k, mode, where
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self._source(query_bundle.query_str, k=self.k, mode=self.mode, where=self.where)
        return [
            NodeWithScore(
                node=TextNode(
                    id_=h.id,
                    text=h.text or "",
                    metadata=h.document_metadata(),
                    excluded_llm_metadata_keys=HIDDEN_FROM_MODELS,
                    excluded_embed_metadata_keys=HIDDEN_FROM_MODELS,
                ),
                score=h.score,
            )
            for h in hits
        ]
