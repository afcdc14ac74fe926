"""`colembed serve`: the real app (FastAPI TestClient) over the tiny exported model and a real
Qdrant Edge index filled through the API's own index job. Every endpoint, and every refusal:
API key, limits (body, image bytes and pixels, batch, query length, k), bad images, unknown page
ids, paths outside the roots (absolute, `..`, symlinks out), a busy pool (503 + Retry-After), an
internal error the process survives, CORS off unless configured, shutdown during a job."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import time

import numpy as np
import pytest
from PIL import Image

import colembed
from colembed.index.schema import SCHEMA_VERSION
from tests.fixtures.documents import bad_folder, good_folder, page, write_pdf
from tests.fixtures.served import index_one_page, start_serve

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from colembed.index import Index  # noqa: E402
from colembed.index.maps import overlay  # noqa: E402
from colembed.serve.app import Settings, create_app  # noqa: E402
from colembed.serve.encoding import decode  # noqa: E402
from colembed.serve.limits import Limits  # noqa: E402
from colembed.serve.roots import Roots, parse_roots  # noqa: E402
from colembed.serve.store_process import ChildStore, open_store_in_child  # noqa: E402

TOKENS = 64
KEY = "s3cret-key"
AUTH = {"X-API-Key": KEY}
BASE = "http://127.0.0.1:8000"  # a Host the default server (bound to 127.0.0.1) answers to
DOCS = {"report.pdf": 3, "memo.pdf": 1, "photo.png": 1, "scan.tiff": 2}


@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


def wait_job(client, job_id, headers=AUTH, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish: {job}")


@pytest.fixture(scope="module")
def served(tmp_path_factory, small_model):
    """(client, index, folders): the app with an API key, one root `docs` indexed by a job."""
    base = tmp_path_factory.mktemp("serve")
    docs = base / "docs"
    assert good_folder(docs) == DOCS
    outside = base / "outside"
    outside.mkdir()
    page("secret").save(outside / "secret.png")
    (docs / "link-out.png").symlink_to(outside / "secret.png")  # a symlinked file out of the root
    (docs / "dir-out").symlink_to(outside, target_is_directory=True)  # a symlinked folder out
    # the store in a child process, as `colembed serve` opens it (serve/store_process.py)
    index = Index(base / "db", model=small_model, store_opener=open_store_in_child)
    assert isinstance(index.store, ChildStore)
    settings = Settings(api_key=KEY, roots=Roots(parse_roots([f"docs={docs}"])))
    with TestClient(create_app(index, settings), base_url=BASE) as client:
        job = client.post(
            "/v1/index", json={"paths": [{"root": "docs", "path": "."}]}, headers=AUTH
        )
        assert job.status_code == 202, job.text
        finished = wait_job(client, job.json()["id"])
        yield client, index, {"base": base, "docs": docs, "outside": outside, "job": finished}
    index.close()


# ---------------------------------------------------------------------------------- status
def test_healthz_info_and_openapi(served, small_model):
    client, index, _ = served
    assert client.get("/healthz").json() == {"status": "ok"}
    info = client.get("/v1/info", headers=AUTH).json()
    assert (info["model"], info["variant"], info["dim"]) == (
        small_model.name,
        "fp32",
        small_model.embedding_size,
    )
    assert info["pages"] == sum(DOCS.values()) == len(index)
    assert (
        info["schema"] == SCHEMA_VERSION and info["roots"] == ["docs"] and info["indexing"] is True
    )
    schema = client.get("/openapi.json").json()
    assert {
        "/v1/embed/queries",
        "/v1/embed/images",
        "/v1/search",
        "/v1/index",
        "/v1/jobs/{job_id}",
        "/v1/pages/{page_id}/image",
        "/v1/pages/{page_id}/map",
        "/v1/info",
        "/healthz",
    } <= set(schema["paths"])
    assert (
        "multipart/form-data"
        in schema["paths"]["/v1/embed/images"]["post"]["requestBody"]["content"]
    )
    assert client.get("/docs", headers=AUTH).status_code == 404  # Swagger UI loads a CDN: off


def test_the_index_job_reported_progress_and_confined_symlinks(served):
    _, _, folders = served
    job = folders["job"]
    assert job["state"] == "done" and job["files_total"] == job["files_done"] == len(DOCS)
    assert job["pages_added"] == sum(DOCS.values()) and job["pages_per_s"] > 0
    assert sorted(a["file"] for a in job["added"]) == sorted(f"docs/{n}" for n in DOCS)
    reasons = {s["file"]: s["reason"] for s in job["skipped"]}
    assert reasons["docs/link-out.png"] == "symlink leads outside the root"
    assert reasons["docs/dir-out"] == "symlinked folder (not followed)"
    assert not job["failed"] and job["error"] is None


def test_the_search_page_is_served_offline(served):
    client, _, _ = served
    html = client.get("/")
    assert html.status_code == 200 and 'id="q"' in html.text
    assert "http://" not in html.text and "https://" not in html.text  # no CDN, no external load
    assert "default-src 'self'" in html.headers["content-security-policy"]


# ------------------------------------------------------------------------------- embedding
def test_embed_queries_float_and_base64(served, small_model):
    client, _, _ = served
    texts = ["what is the revenue?", "a second, longer question about the memo"]
    expected = small_model.embed_queries(texts)
    for encoding in ("float", "base64"):
        body = client.post(
            "/v1/embed/queries", json={"texts": texts, "encoding": encoding}, headers=AUTH
        ).json()
        assert (body["model"], body["variant"], body["dim"], body["encoding"]) == (
            small_model.name,
            "fp32",
            small_model.embedding_size,
            encoding,
        )
        got = [decode(e) for e in body["embeddings"]]
        assert [g.shape for g in got] == [e.shape for e in expected]
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, atol=1e-6)
    raw = client.post(
        "/v1/embed/queries", json={"texts": texts[:1], "encoding": "base64"}, headers=AUTH
    ).json()["embeddings"][0]
    assert np.array_equal(
        np.frombuffer(base64.b64decode(raw["data"]), "<f4").reshape(raw["shape"]), expected[0]
    )  # the documented decoding, bit for bit


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def test_embed_images_multipart_and_base64(served, small_model):
    client, _, _ = served
    images = [png_bytes(page("one")), png_bytes(page("two", size=(300, 200)))]
    expected = small_model.embed_images(images)
    multipart = client.post(
        "/v1/embed/images",
        headers=AUTH,
        data={"encoding": "base64"},
        files=[("files", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)],
    ).json()
    as_json = client.post(
        "/v1/embed/images",
        headers=AUTH,
        json={"images": [base64.b64encode(b).decode() for b in images]},
    ).json()
    for body in (multipart, as_json):
        assert body["dim"] == small_model.embedding_size and body["model"] == small_model.name
        for item, e in zip(body["embeddings"], expected):
            np.testing.assert_allclose(decode(item), e, atol=1e-6)


# ---------------------------------------------------------------------------------- search
def test_search_matches_the_in_process_index(served):
    client, index, _ = served
    k = len(index)  # every page: random weights tie pages exactly, so a cut at k could differ
    body = client.post(
        "/v1/search", json={"query": "what does the report say?", "k": k}, headers=AUTH
    ).json()
    expected = {e.id: e for e in index.search("what does the report say?", k=k)}
    hits = body["results"][0]["hits"]
    assert {h["id"] for h in hits} == set(expected)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    for h in hits:
        assert h["page"] == expected[h["id"]].page
        assert h["score"] == pytest.approx(expected[h["id"]].score, rel=1e-6)
    for h in hits:
        assert h["file"].startswith("docs/") and not os.path.isabs(h["file"])
        assert h["payload"]["path"] == h["file"] and "model_source" not in h["payload"]
        assert h["image_url"] == f"/v1/pages/{h['id']}/image" and "map" not in h
    timing = client.post("/v1/search", json={"query": "x"}, headers=AUTH).headers["server-timing"]
    assert timing.startswith("search;dur=") and ", queue;dur=" in timing
    several = client.post(
        "/v1/search", json={"queries": ["one", "two"], "k": 2, "mode": "exact"}, headers=AUTH
    ).json()
    assert [r["query"] for r in several["results"]] == ["one", "two"]
    assert all(len(r["hits"]) == 2 for r in several["results"])


def test_search_explain_returns_the_map_as_data(served):
    client, index, _ = served
    k = len(index)  # every page: random weights tie pages exactly, so a cut at k could differ
    body = client.post(
        "/v1/search", json={"query": "memo", "k": k, "explain": True}, headers=AUTH
    ).json()
    expected = {e.id: e for e in index.search("memo", k=k, explain=True)}
    assert {h["id"] for h in body["results"][0]["hits"]} == set(expected)
    for h in body["results"][0]["hits"]:
        m, e = h["map"], expected[h["id"]]
        assert m["grid"] == h["payload"]["grid"] == list(e.map.contribution.shape)
        np.testing.assert_allclose(m["contribution"], e.map.contribution, atol=1e-6)
        total = np.sum(m["contribution"]) + m["prompt_contribution"]
        assert total == pytest.approx(m["score"], rel=1e-4)
        assert m["score"] == pytest.approx(h["score"], rel=1e-2)  # stored fp16 vs exact
        assert m["hottest"] == list(e.map.hottest_token())


# ----------------------------------------------------------------------------------- pages
def png(response) -> Image.Image:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    return Image.open(io.BytesIO(response.content)).convert("RGB")


def test_page_image_and_map_are_the_indexed_page(served):
    client, index, _ = served
    [hit] = index.search("scan", k=1, explain=True)
    image = png(client.get(f"/v1/pages/{hit.id}/image", headers=AUTH))
    expected = index.page_image(hit)
    assert image.size == (hit.payload["width"], hit.payload["height"])
    assert np.array_equal(np.asarray(image), np.asarray(expected))
    mapped = png(client.get(f"/v1/pages/{hit.id}/map", params={"q": "scan"}, headers=AUTH))
    assert np.array_equal(np.asarray(mapped), np.asarray(overlay(expected, hit.map)))
    assert not np.array_equal(np.asarray(mapped), np.asarray(image))  # the tint is there
    thumb = png(client.get(f"/v1/pages/{hit.id}/image", params={"width": 100}, headers=AUTH))
    assert thumb.width == 100


def test_unknown_page_ids_are_404(served):
    client, _, _ = served
    for page_id in ("00000000-0000-0000-0000-000000000000", "not-a-uuid", "..%2F..%2Fetc%2Fpasswd"):
        for kind in ("image", "map?q=x"):
            r = client.get(f"/v1/pages/{page_id}/{kind}", headers=AUTH)
            assert r.status_code == 404, (page_id, kind, r.text)
    assert client.get("/v1/jobs/nope", headers=AUTH).status_code == 404


def test_a_changed_file_is_no_longer_served(tmp_path, small_model):
    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "a.pdf", ["first"])
    index = Index(tmp_path / "db", model=small_model)
    index.add([docs])
    [hit] = index.search("first", k=1)
    with TestClient(create_app(index), base_url=BASE) as client:
        assert client.get(f"/v1/pages/{hit.id}/image").status_code == 200
        write_pdf(docs / "a.pdf", ["changed"])  # same path, new content: sha256 differs
        r = client.get(f"/v1/pages/{hit.id}/image")
        assert r.status_code == 410 and "changed since it was indexed" in r.json()["detail"]
        (docs / "a.pdf").unlink()
        assert client.get(f"/v1/pages/{hit.id}/map", params={"q": "x"}).status_code == 410
        # Without roots the stored path is shown as it is (the user's own machine)
        body = client.post("/v1/search", json={"query": "first", "k": 1}).json()
        assert body["results"][0]["hits"][0]["file"] == str((docs / "a.pdf").resolve())
    index.close()


# ------------------------------------------------------------------------------- index jobs
@pytest.mark.parametrize(
    "path, status, words",
    [
        ("/etc", 403, "absolute"),
        ("/etc/passwd", 403, "absolute"),
        ("C:\\Windows", 403, "absolute"),
        ("~/x", 403, "absolute"),
        ("../outside", 403, "'..'"),
        ("sub/../../outside", 403, "'..'"),
        ("dir-out", 403, "outside root"),
        ("link-out.png", 403, "outside root"),
        ("dir-out/secret.png", 403, "outside root"),
        ("nothing-here.pdf", 404, "no such file"),
    ],
)
def test_index_paths_outside_the_roots_are_refused(served, path, status, words):
    client, _, _ = served
    r = client.post("/v1/index", json={"paths": [{"root": "docs", "path": path}]}, headers=AUTH)
    assert r.status_code == status and words in r.json()["detail"], r.text


def test_index_refusals_without_roots_and_with_an_unknown_root(served, tmp_path, small_model):
    client, _, _ = served
    r = client.post("/v1/index", json={"paths": [{"root": "elsewhere", "path": "x"}]}, headers=AUTH)
    assert r.status_code == 403 and "not one of ['docs']" in r.json()["detail"]
    assert client.post("/v1/index", json={"paths": []}, headers=AUTH).status_code == 422
    index = Index(tmp_path / "db", model=small_model)
    with TestClient(create_app(index), base_url=BASE) as bare:
        r = bare.post("/v1/index", json={"paths": ["report.pdf"]})
        assert r.status_code == 403 and "--allow-root" in r.json()["detail"]
    index.close()


def test_an_index_job_again_skips_every_stored_page(served):
    client, index, _ = served
    before = len(index)
    job = client.post("/v1/index", json={"paths": ["report.pdf"]}, headers=AUTH).json()
    done = wait_job(client, job["id"])
    assert done["state"] == "done" and done["pages_added"] == 0 and len(index) == before
    assert {s["reason"] for s in done["skipped"]} == {"already indexed"}
    listed = client.get("/v1/jobs", headers=AUTH).json()["jobs"]
    assert job["id"] in {j["id"] for j in listed}


def test_a_job_reports_bad_files_while_searches_run(tmp_path, small_model):
    """Bad files fail with their reasons and the rest is indexed; searches and page lookups
    served while the job writes; the index folder inside the root is not walked."""
    root = tmp_path / "root"
    expected_bad = bad_folder(root / "bad")
    good_folder(root / "good")
    index = Index(root / "db", model=small_model, store_opener=open_store_in_child)
    settings = Settings(roots=Roots(parse_roots([f"r={root}"])))
    with TestClient(create_app(index, settings), base_url=BASE) as client:
        job_id = client.post("/v1/index", json={"paths": ["."]}).json()["id"]
        searched = 0
        while client.get(f"/v1/jobs/{job_id}").json()["state"] in ("queued", "running"):
            r = client.post("/v1/search", json={"query": "report", "k": 3})
            assert r.status_code == 200, r.text
            for hit in r.json()["results"][0]["hits"]:
                assert (
                    client.get(f"/v1/pages/{hit['id']}/image", params={"width": 50}).status_code
                    == 200
                )
            searched += 1
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert searched >= 1 and job["state"] == "done"
    assert job["pages_added"] == sum(DOCS.values()) == len(index)
    failed = {f["file"]: f["reason"] for f in job["failed"]}
    skipped = {s["file"]: s["reason"] for s in job["skipped"]}
    for name, word in expected_bad.items():
        reason = failed.get(f"r/bad/{name}") or skipped.get(f"r/bad/{name}")
        assert reason and word in reason, (name, reason)
    assert not any(f.startswith("r/db/") for f in {**failed, **skipped})  # its own folder
    index.close()


# ----------------------------------------------------------------------------- access rules
def test_the_api_key(served):
    client, _, _ = served
    for headers in (
        {},
        {"X-API-Key": "wrong"},
        {"X-API-Key": KEY[:-1]},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
    ):
        for method, path, body in (
            ("get", "/v1/info", None),
            ("post", "/v1/search", {"query": "x"}),
            ("post", "/v1/embed/queries", {"texts": ["x"]}),
            ("post", "/v1/index", {"paths": ["."]}),
            ("get", "/v1/jobs", None),
            ("get", "/v1/pages/00000000-0000-0000-0000-000000000000/image", None),
        ):
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/healthz").status_code == 200 and client.get("/").status_code == 200


def test_no_cors_unless_configured(served, tmp_path, small_model):
    client, _, _ = served
    origin = {"Origin": "http://evil.example"}
    r = client.get("/v1/info", headers={**AUTH, **origin})
    assert "access-control-allow-origin" not in r.headers
    pre = client.options("/v1/search", headers={**origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
    index = Index(tmp_path / "db", model=small_model)
    app = create_app(index, Settings(cors_origins=["http://good.example"]))
    with TestClient(app, base_url=BASE) as other:
        ok = other.get("/v1/info", headers={"Origin": "http://good.example"})
        assert ok.headers["access-control-allow-origin"] == "http://good.example"
        assert "access-control-allow-origin" not in other.get("/v1/info", headers=origin).headers
    index.close()


# ---------------------------------------------------------------------------------- limits
@pytest.fixture(scope="module")
def limited(tmp_path_factory, small_model):
    """An app with small limits (and no key) over an empty index."""
    base = tmp_path_factory.mktemp("limited")
    index = Index(base / "db", model=small_model)
    limits = Limits(
        max_body_bytes=300_000,
        max_image_bytes=200_000,
        max_image_pixels=1_000_000,
        max_batch=3,
        max_images=2,
        max_query_chars=50,
        max_k=10,
        max_queries=2,
    )
    with TestClient(
        create_app(index, Settings(limits=limits)), base_url=BASE, raise_server_exceptions=False
    ) as client:
        yield client, index
    index.close()


def detail(r, status):
    assert r.status_code == status, r.text
    return r.json()["detail"]


def test_body_limits_are_413_naming_the_limit(limited):
    client, _ = limited
    big = {"texts": ["x" * 400_000]}
    assert "--max-body-bytes" in detail(client.post("/v1/embed/queries", json=big), 413)

    def chunks():  # no Content-Length: the limit is counted as the body streams in
        for _ in range(40):
            yield b"x" * 10_000

    r = client.post(
        "/v1/embed/queries", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert "--max-body-bytes" in detail(r, 413)


def test_image_limits(limited):
    client, _ = limited
    bomb = png_bytes(Image.new("L", (2000, 2000), 255))  # 4 MP in ~10 kB: decoded never
    assert len(bomb) < 200_000
    r = client.post("/v1/embed/images", files=[("files", ("b.png", bomb, "image/png"))])
    assert "--max-image-pixels" in detail(r, 413) and "2000x2000" in detail(r, 413)
    noisy = png_bytes(
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 300, 3), dtype=np.uint8))
    )  # ~270 kB of incompressible pixels
    assert 200_000 < len(noisy) < 300_000
    r = client.post("/v1/embed/images", files=[("files", ("n.png", noisy, "image/png"))])
    assert "--max-image-bytes" in detail(r, 413)
    small = png_bytes(page("x", size=(64, 64)))
    r = client.post(
        "/v1/embed/images", files=[("files", (f"{i}.png", small, "image/png")) for i in range(3)]
    )
    assert "--max-images" in detail(r, 422)
    r = client.post("/v1/embed/images", json={"images": [base64.b64encode(small).decode()] * 3})
    assert "--max-images" in detail(r, 422)
    r = client.post("/v1/embed/images", files=[("files", ("t.txt", b"not an image", "text/plain"))])
    assert "item 0" in detail(r, 422) and "not an image" in detail(r, 422)
    truncated = small[: len(small) // 2]  # a valid header, a cut body: fails at decode
    r = client.post("/v1/embed/images", files=[("files", ("t.png", truncated, "image/png"))])
    assert "item 0" in detail(r, 422)
    r = client.post("/v1/embed/images", json={"images": ["***not base64***"]})
    assert "base64" in detail(r, 422)
    r = client.post("/v1/embed/images", content=b"raw", headers={"Content-Type": "image/png"})
    assert r.status_code == 415
    r = client.post("/v1/embed/images", files=[])
    assert r.status_code in (415, 422)


def test_batch_query_length_and_k_limits(limited):
    client, _ = limited
    assert "--max-batch" in detail(client.post("/v1/embed/queries", json={"texts": ["a"] * 4}), 422)
    assert "--max-query-chars" in detail(
        client.post("/v1/embed/queries", json={"texts": ["a" * 51]}), 422
    )
    assert "--max-query-chars" in detail(client.post("/v1/search", json={"query": "a" * 51}), 422)
    assert "--max-queries" in detail(client.post("/v1/search", json={"queries": ["a"] * 3}), 422)
    assert "--max-k" in detail(client.post("/v1/search", json={"query": "a", "k": 11}), 422)
    assert "k" in detail(client.post("/v1/search", json={"query": "a", "k": 0}), 422)
    assert "mode" in detail(client.post("/v1/search", json={"query": "a", "mode": "fast"}), 422)
    assert "exactly one" in detail(client.post("/v1/search", json={}), 422)
    assert "texts" in detail(client.post("/v1/embed/queries", json={"texts": "not a list"}), 422)
    r = client.post(
        "/v1/embed/queries", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422
    assert "--max-query-chars" in detail(
        client.get("/v1/pages/00000000-0000-0000-0000-000000000000/map", params={"q": "a" * 51}),
        422,
    )
    # an empty index searches to no hits, not an error
    assert client.post("/v1/search", json={"query": "a"}).json()["results"][0]["hits"] == []


def test_a_full_pool_answers_503_with_retry_after(limited):
    client, _ = limited
    pool = client.app.state.service.pool
    release = threading.Event()
    holders = [
        threading.Thread(target=asyncio.run, args=(pool.run(release.wait),))
        for _ in range(pool.limit)
    ]
    for t in holders:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while pool.pending < pool.limit and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.pending == pool.limit
        r = client.post("/v1/search", json={"query": "a"})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert "--workers + --queue" in r.json()["detail"]
        assert client.get("/healthz").status_code == 200  # the event loop is free
    finally:
        release.set()
        for t in holders:
            t.join()
    assert client.post("/v1/search", json={"query": "a"}).status_code == 200


def test_an_internal_error_is_a_500_and_the_server_goes_on(limited, monkeypatch):
    client, index = limited

    def broken(*args, **kwargs):  # fault injection: a failure colembed does not expect
        raise RuntimeError("simulated fault")

    monkeypatch.setattr(index, "search", broken)
    r = client.post("/v1/search", json={"query": "a"})
    assert r.status_code == 500 and "RuntimeError" in r.json()["detail"]
    monkeypatch.undo()
    assert client.post("/v1/search", json={"query": "a"}).status_code == 200


# -------------------------------------------------------------------------------- shutdown
def test_shutdown_during_a_job_leaves_a_consistent_index(tmp_path, small_model):
    """Shutdown stops a job within its file (once the pages being embedded are written), not at
    the end of the call: every stored page is whole and a second run adds exactly the rest."""
    docs = tmp_path / "docs"
    docs.mkdir()
    files = 24
    for i in range(files):
        page(f"page {i}").save(docs / f"p{i:02d}.png")
    index = Index(tmp_path / "db", model=small_model, store_opener=open_store_in_child)
    settings = Settings(roots=Roots(parse_roots([str(docs)])))
    with TestClient(create_app(index, settings, close_index=True), base_url=BASE) as client:
        job_id = client.post("/v1/index", json={"paths": ["."]}).json()["id"]
        queued = client.post("/v1/index", json={"paths": ["p00.png"]}).json()["id"]
        service = client.app.state.service
        deadline = time.monotonic() + 120
        while service.jobs.jobs[job_id].pages_stored < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    job, second = service.jobs.jobs[job_id], service.jobs.jobs[queued]
    assert job.state == "cancelled" and "again" in job.error, job.to_dict()
    assert 1 <= job.pages_stored < files and job.files_done < files
    assert second.state == "cancelled"
    # the app's shutdown closed the index (the child released the lock: this process opens it)
    again = Index(tmp_path / "db", model=small_model)
    stored = len(again)
    assert stored == job.pages_stored  # whole pages only, each counted as it was written
    assert again.add([docs], progress=False).pages_added == files - stored
    again.close()


# ------------------------------------------------------------------------------- the command
def test_serve_refuses_a_public_host_without_a_key(tmp_path, capsys, monkeypatch):
    from colembed.cli import main
    from colembed.serve.run import check_exposure, is_loopback

    monkeypatch.delenv("COLEMBED_API_KEY", raising=False)
    assert main(["serve", "--db", str(tmp_path / "db"), "--host", "0.0.0.0"]) == 2  # usage
    assert "--insecure" in capsys.readouterr().err
    assert main(["serve", "--db", str(tmp_path / "db"), "--allow-root", str(tmp_path / "no")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert not (tmp_path / "db").exists()  # refused before the index was opened
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host)
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert not is_loopback(host)
        check_exposure(host, "key", insecure=False)
        check_exposure(host, None, insecure=True)
    with pytest.raises(colembed.errors.ColembedError, match="API key"):
        check_exposure("::", None, insecure=False)


def test_colembed_serve_runs_and_shuts_down_gracefully(tmp_path, exported_tiny, small_model):
    """The command as users run it: a process of its own, the key from the environment; SIGTERM
    stops it after closing the index (its lock is free for the next process)."""
    import signal

    import httpx

    docs = index_one_page(tmp_path, small_model)
    log = tmp_path / "server.log"
    proc, url = start_serve(
        tmp_path / "db",
        log,
        "--max-k",
        "7",
        "--allow-root",
        str(docs),
        env=dict(os.environ, COLEMBED_API_KEY=KEY),
    )
    try:
        info = httpx.get(url + "/v1/info", headers=AUTH).json()
        assert info["pages"] == 1 and info["limits"]["max_k"] == 7 and info["roots"] == ["docs"]
        assert httpx.get(url + "/v1/info").status_code == 401
        hit = httpx.post(url + "/v1/search", json={"query": "one"}, headers=AUTH).json()["results"][
            0
        ]["hits"][0]
        assert hit["file"] == "docs/one.png"
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "index closed" in log.read_text(), log.read_text()
    Index(tmp_path / "db", model=small_model).close()  # the folder's lock was released


def test_roots_parse_and_display(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    roots = Roots(parse_roots([str(tmp_path / "a"), f"bee={tmp_path / 'b'}"]))
    assert roots.names() == ["a", "bee"]
    assert roots.display(tmp_path / "b" / "x" / "y.pdf") == "bee/x/y.pdf"
    assert roots.display("/somewhere/else/z.pdf") == "z.pdf"  # never the server's layout
    with pytest.raises(colembed.errors.ColembedError, match="two roots"):
        parse_roots([str(tmp_path / "a"), str(tmp_path / "a")])
    with pytest.raises(colembed.errors.ColembedError, match="not a folder"):
        parse_roots([str(tmp_path / "missing")])
    with pytest.raises(colembed.errors.ColembedError, match="name its root"):
        roots.resolve(None, "x")
