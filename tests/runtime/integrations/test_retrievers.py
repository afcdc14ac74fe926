"""The LangChain and LlamaIndex retrievers, called as the frameworks call them
(`retriever.invoke(query)`, `retriever.retrieve(query)`), over a real tiny index in this process
and over a real `colembed serve` app (FastAPI's TestClient, which is an httpx.Client).

The random weights rank pages arbitrarily, so each retriever's pages are compared with what
`Index.search` returns for the same query in exact mode (deterministic), never with a page
expected to rank first."""

from __future__ import annotations

from pathlib import Path

import pytest

import colembed
from tests.fixtures.documents import add_rag_documents

pytest.importorskip("fastapi")
pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from llama_index.core.schema import NodeWithScore, TextNode  # noqa: E402

from colembed.index import Index  # noqa: E402
from colembed.integrations import langchain as lc  # noqa: E402
from colembed.integrations import llamaindex as li  # noqa: E402
from colembed.integrations.pages import RetrieverError  # noqa: E402
from colembed.serve.app import Settings, create_app  # noqa: E402
from colembed.serve.roots import Roots, parse_roots  # noqa: E402

TOKENS = 64
KEY = "retriever-test-key"
BASE = "http://127.0.0.1:8000"  # a Host colembed serve answers to on loopback


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, exported_tiny):
    model = colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)
    base = tmp_path_factory.mktemp("rag-retrievers")
    docs = base / "docs"
    index = Index(base / "db", model=model)
    add_rag_documents(index, docs)
    yield index, docs
    index.close()


@pytest.fixture(scope="module")
def served(indexed):
    index, docs = indexed
    settings = Settings(api_key=KEY, roots=Roots(parse_roots([f"docs={docs}"])))
    with TestClient(create_app(index, settings), base_url=BASE) as client:
        yield client


def expected(index, query, **kwargs):
    return [
        (Path(h.file).name, h.page, h.score, h.text, h.metadata)
        for h in index.search(query, mode="exact", **kwargs)
    ]


def test_langchain_over_an_index(indexed):
    index, _ = indexed
    retriever = lc.ColembedRetriever(index=index, k=3, mode="exact")
    docs = retriever.invoke("total due")
    assert all(isinstance(d, Document) for d in docs) and len(docs) == 3
    assert [
        (
            Path(d.metadata["file"]).name,
            d.metadata["page"],
            d.metadata["score"],
            d.page_content if d.metadata["has_text"] else None,
            d.metadata["metadata"],
        )
        for d in docs
    ] == expected(index, "total due", k=3)
    assert all(
        d.metadata["source"] == d.metadata["file"] and d.metadata["image_url"] is None for d in docs
    )
    filtered = lc.ColembedRetriever(
        index=index, k=5, mode="exact", where={"kind": "invoice", "page": 2}
    ).invoke("anything")
    assert [(d.page_content, d.metadata["page"], d.metadata["metadata"]) for d in filtered] == [
        ("Total due 99 EUR", 2, {"kind": "invoice", "year": 2024})
    ]
    (photo,) = lc.ColembedRetriever(index=index, where={"kind": "photo"}).invoke("x")
    assert photo.page_content == "" and photo.metadata["has_text"] is False


def test_llamaindex_over_an_index(indexed):
    index, _ = indexed
    retriever = li.ColembedRetriever(index, k=3, mode="exact")
    nodes = retriever.retrieve("total due")
    assert all(isinstance(n, NodeWithScore) and isinstance(n.node, TextNode) for n in nodes)
    assert [
        (
            Path(n.node.metadata["file"]).name,
            n.node.metadata["page"],
            n.score,
            n.node.text if n.node.metadata["has_text"] else None,
            n.node.metadata["metadata"],
        )
        for n in nodes
    ] == expected(index, "total due", k=3)
    hits = index.search("total due", k=3, mode="exact")
    assert [n.node.node_id for n in nodes] == [h.id for h in hits]
    assert "page_id" not in nodes[0].node.get_metadata_str(mode="llm")  # ids hidden from the LLM
    (only,) = li.ColembedRetriever(index, where=["kind=invoice", "page=1"]).retrieve("x")
    assert only.node.text == "Invoice INV-2024-0042"


@pytest.mark.parametrize("framework", ["langchain", "llamaindex"])
def test_both_over_colembed_serve(indexed, served, framework):
    index, _ = indexed
    kwargs = dict(url=BASE, api_key=KEY, client=served, k=3, mode="exact")
    if framework == "langchain":
        got = [
            (d.page_content, d.metadata) for d in lc.ColembedRetriever(**kwargs).invoke("total due")
        ]
    else:
        got = [
            (n.node.text, n.node.metadata)
            for n in li.ColembedRetriever(**kwargs).retrieve("total due")
        ]
    hits = index.search("total due", k=3, mode="exact")
    assert [(m["file"], m["page"], m["score"], m["page_id"], m["metadata"]) for _, m in got] == [
        (f"docs/{Path(h.file).name}", h.page, h.score, h.id, h.metadata) for h in hits
    ]
    assert [text for text, _ in got] == [h.text or "" for h in hits]
    for _, meta in got:  # the page image, rendered by the server, at the URL given
        assert meta["image_url"] == f"{BASE}/v1/pages/{meta['page_id']}/image"
        image = served.get(meta["image_url"], headers={"X-API-Key": KEY})
        assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    where = {"kind": "invoice", "page": 2}
    if framework == "langchain":
        texts = [d.page_content for d in lc.ColembedRetriever(**kwargs, where=where).invoke("x")]
    else:
        texts = [n.node.text for n in li.ColembedRetriever(**kwargs, where=where).retrieve("x")]
    assert texts == ["Total due 99 EUR"]


def test_server_errors_and_malformed_replies_are_named(served):
    wrong = lc.ColembedRetriever(url=BASE, api_key="wrong", client=served)
    with pytest.raises(RetrieverError, match="HTTP 401: missing or wrong API key"):
        wrong.invoke("x")
    bad_filter = li.ColembedRetriever(url=BASE, api_key=KEY, client=served, where={"page": "two"})
    with pytest.raises(RetrieverError, match="HTTP 422: .*not a number"):
        bad_filter.retrieve("x")

    impostor = FastAPI()  # a server that answers /v1/search with something else

    @impostor.post("/v1/search")
    def search(body: dict):
        return {"results": [{"hits": [{"id": "p", "file": "a.pdf", "page": "one", "score": 1.0}]}]}

    with TestClient(impostor) as client:
        with pytest.raises(RetrieverError, match="hit 0: field 'page' is 'one'"):
            lc.ColembedRetriever(url="http://testserver", client=client).invoke("x")
    with pytest.raises(ValueError, match="exactly one of index"):
        lc.ColembedRetriever()
    with pytest.raises(ValueError, match="exactly one of index"):
        li.ColembedRetriever()
    with pytest.raises(ValueError, match="exactly one of index"):
        li.ColembedRetriever(object(), url="http://testserver")
