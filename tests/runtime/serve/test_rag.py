"""`colembed serve` for retrieval-augmented generation: `/v1/search` takes a `where` filter (dict
or strings) and returns each hit's metadata and page text; the search page has the filter box
and shows both. The index's store runs in a child process, as `colembed serve` opens it, so the
filter and metadata updates cross that boundary too."""

from __future__ import annotations

import pytest

import colembed
from tests.fixtures.documents import add_rag_documents

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from colembed.index import Index  # noqa: E402
from colembed.serve.app import Settings, create_app  # noqa: E402
from colembed.serve.roots import Roots, parse_roots  # noqa: E402
from colembed.serve.store_process import ChildStore, open_store_in_child  # noqa: E402

TOKENS = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory, exported_tiny):
    model = colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)
    base = tmp_path_factory.mktemp("serve-rag")
    docs = base / "docs"
    index = Index(base / "db", model=model, store_opener=open_store_in_child)
    assert isinstance(index.store, ChildStore)
    add_rag_documents(index, docs)
    settings = Settings(roots=Roots(parse_roots([f"docs={docs}"])))
    with TestClient(create_app(index, settings), base_url="http://127.0.0.1:8000") as client:
        yield client, index, docs
    index.close()


def test_search_filters_and_returns_metadata_and_text(served):
    client, index, docs = served
    for where in ({"kind": "invoice", "page": 2}, ["kind=invoice", "page>=2"]):
        r = client.post("/v1/search", json={"query": "total", "k": 5, "where": where})
        assert r.status_code == 200, r.text
        (hit,) = r.json()["results"][0]["hits"]
        assert (hit["file"], hit["page"]) == ("docs/invoice.pdf", 2)
        assert hit["metadata"] == {"kind": "invoice", "year": 2024}
        assert hit["text"] == "Total due 99 EUR" and hit["text_truncated"] is False
        assert "text_z" not in hit["payload"] and "model_source" not in hit["payload"]
    (photo,) = client.post("/v1/search", json={"query": "x", "where": {"kind": "photo"}}).json()[
        "results"
    ][0]["hits"]
    assert photo["text"] is None and photo["metadata"] == {"kind": "photo"}
    assert (
        client.post("/v1/search", json={"query": "x", "where": {"kind": "none"}}).json()["results"][
            0
        ]["hits"]
        == []
    )
    bad = client.post("/v1/search", json={"query": "x", "where": {"page": "two"}})
    assert bad.status_code == 422 and "not a number" in bad.json()["detail"]
    bad = client.post("/v1/search", json={"query": "x", "where": ["kind"]})
    assert bad.status_code == 422 and "key=value" in bad.json()["detail"]


def test_metadata_changes_through_the_child_store_are_searched(served):
    client, index, docs = served
    assert index.set_metadata(docs / "photo.png", {"kind": "image"}) == 1
    (hit,) = client.post("/v1/search", json={"query": "x", "where": "kind=image"}).json()[
        "results"
    ][0]["hits"]
    assert hit["file"] == "docs/photo.png" and hit["metadata"] == {"kind": "image"}
    index.set_metadata(docs / "photo.png", {"kind": "photo"})


def test_the_search_page_has_the_filter_and_shows_metadata_and_text():
    from importlib import resources

    html = resources.files("colembed.serve").joinpath("static/index.html").read_text("utf-8")
    assert 'id="where"' in html and "request.where = whereList()" in html
    assert "viewer-text" in html and "tagsText(hit)" in html
    assert "no text: an image or scanned page" in html
