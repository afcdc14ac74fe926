"""`colembed serve` stays responsive while it works: the real app (TestClient) over the tiny
model and a real Qdrant Edge index whose store runs in a child process, as `colembed serve`
opens it.

- The event loop answers `/healthz` while a long search runs (qdrant-edge-py holds the GIL for a
  whole search: in one process the loop would wait for it).
- A page image is served while an index job renders a PDF (pdfium serves one thread: page
  images are rendered in worker processes, not behind the job).
- A job's progress advances per page (not per `Index.add` call), with its failures.
- The store process closes the folder when the server's process is gone.

Behaviour, not timing: each test orders events (this finished before that), never compares a
duration with a bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.fixtures.documents import write_pdf
from tests.fixtures.served import index_one_page

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from colembed.index import Index  # noqa: E402
from colembed.serve.app import Settings, create_app  # noqa: E402
from colembed.serve.limits import Limits  # noqa: E402
from colembed.serve.roots import Roots, parse_roots  # noqa: E402
from colembed.serve.store_process import ChildStore, open_store_in_child  # noqa: E402
from tests.runtime.serve.test_serve import BASE, small_model, wait_job  # noqa: E402,F401 (the module's model fixture)

# Synthetic pages of a realistic shape for the searches below (no model call).
QUERIES = 4
PAGES = 16
TOKENS_PER_PAGE = 84


def synthetic_points(index, pages: int):
    """Unit-norm random pages with the index's identity in the payload (no model call): a search
    workload of a realistic shape, cheap to store."""
    from colembed.index.schema import make_point
    from colembed.model import PageLayout

    rng = np.random.default_rng(0)
    layout = PageLayout(
        grid_rows=8, grid_cols=8, image_start=10, num_tokens=TOKENS_PER_PAGE, token_px=28
    )
    points = []
    for i in range(pages):
        v = rng.standard_normal((TOKENS_PER_PAGE, index.model.embedding_size)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        points.append(
            make_point(
                v,
                layout,
                {
                    **index.identity,
                    "path": f"/synthetic/doc{i}.png",
                    "page": 1,
                    "pages": 1,
                    "sha256": f"{i:064x}",
                    "width": 224,
                    "height": 224,
                },
            )
        )
    return points


def test_healthz_answers_while_a_long_search_runs(tmp_path, small_model):
    """The store's child process is stopped (SIGSTOP) as the search enters it, so the search
    cannot end until it is let go: /healthz must answer meanwhile, again and again, and the search
    then completes with its results. In one process the search would hold the GIL and the event
    loop with it; here the parent waits on a socket."""
    index = Index(tmp_path / "db", model=small_model, store_opener=open_store_in_child)
    store = index.store
    assert isinstance(store, ChildStore)
    store.upsert(synthetic_points(index, PAGES))
    real, events, entered = store.search, [], threading.Event()

    def held(*args, **kwargs):  # the store call: the child cannot answer until SIGCONT
        os.kill(store.pid, signal.SIGSTOP)
        events.append("search entered")
        entered.set()
        try:
            return real(*args, **kwargs)
        finally:
            events.append("search returned")

    store.search = held
    texts = [f"what did the annual report say about region {i}?" for i in range(QUERIES)]
    answers = {}
    try:
        with TestClient(
            create_app(index, Settings(limits=Limits(max_queries=QUERIES))), base_url=BASE
        ) as client:

            def search():
                answers["search"] = client.post(
                    "/v1/search", json={"queries": texts, "k": 2, "mode": "exact"}
                )

            searcher = threading.Thread(target=search)
            searcher.start()
            assert entered.wait(300)
            for _ in range(5):  # the store is stopped mid-search: only the event loop answers
                assert client.get("/healthz").status_code == 200
                events.append("healthz answered")
            os.kill(store.pid, signal.SIGCONT)
            searcher.join(600)
    finally:
        os.kill(store.pid, signal.SIGCONT)
        index.close()
    assert events == ["search entered"] + ["healthz answered"] * 5 + ["search returned"]
    assert answers["search"].status_code == 200, answers["search"].text
    assert len(answers["search"].json()["results"]) == QUERIES


def test_a_page_image_is_served_while_a_job_renders_a_pdf(tmp_path, small_model, monkeypatch):
    """The job's render of big.pdf page 2 is held inside pdfium (in this process) until the page
    image has come: the image cannot wait on the job's renderer. Ordered by events, not by how
    fast 40 tiny pages embed (they can all be stored before a racing request is answered)."""
    from colembed.index import sources

    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "small.pdf", ["small"])
    index = Index(tmp_path / "db", model=small_model, store_opener=open_store_in_child)
    index.add([docs / "small.pdf"], progress=False)
    [hit] = index.search("small", k=1)
    write_pdf(docs / "big.pdf", [f"big page {i}" for i in range(40)])
    rendering, release = threading.Event(), threading.Event()
    real_page_image = sources.Document.page_image

    def held_page_image(self, page):  # the job's thread, mid-document
        if self.path.name == "big.pdf" and page == 2:
            rendering.set()
            release.wait(300)
        return real_page_image(self, page)

    monkeypatch.setattr(sources.Document, "page_image", held_page_image)
    settings = Settings(roots=Roots(parse_roots([str(docs)])))
    answers = {}
    with TestClient(create_app(index, settings), base_url=BASE) as client:
        assert client.get(f"/v1/pages/{hit.id}/image").status_code == 200  # a warm renderer
        job_id = client.post("/v1/index", json={"paths": ["big.pdf"]}).json()["id"]
        try:
            assert rendering.wait(120), client.get(f"/v1/jobs/{job_id}").json()
            fetch = threading.Thread(
                target=lambda: answers.update(image=client.get(f"/v1/pages/{hit.id}/image"))
            )
            fetch.start()
            fetch.join(120)  # a page image behind the job's renderer would never come
            answers["during"] = client.get(f"/v1/jobs/{job_id}").json()
        finally:
            release.set()
        done = wait_job(client, job_id, headers={})
    index.close()
    assert "image" in answers, "no page image while the job's render was held"
    image, during = answers["image"], answers["during"]
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert during["state"] == "running" and during["pages_stored"] < 40, during
    assert done["state"] == "done" and done["pages_added"] == 40


def test_job_progress_advances_per_page_with_failures(tmp_path, small_model):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a-broken.pdf").write_bytes(b"%PDF-1.4 not really")
    write_pdf(docs / "b-long.pdf", [f"long page {i}" for i in range(16)])
    index = Index(tmp_path / "db", model=small_model, store_opener=open_store_in_child)
    settings = Settings(roots=Roots(parse_roots([str(docs)])))
    seen = []
    with TestClient(create_app(index, settings), base_url=BASE) as client:
        job_id = client.post("/v1/index", json={"paths": ["."]}).json()["id"]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            job = client.get(f"/v1/jobs/{job_id}").json()
            seen.append(job)
            if job["state"] not in ("queued", "running"):
                break
            time.sleep(0.01)
    index.close()
    final = seen[-1]
    assert final["state"] == "done" and final["files_total"] == final["files_done"] == 2
    assert final["pages_stored"] == final["pages_planned"] == final["pages_added"] == 16
    # within the one file: pages stored before it was done, and the broken file's failure shown
    # while the long one was still being indexed
    partial = [j for j in seen if j["state"] == "running" and 0 < j["pages_stored"] < 16]
    assert partial, [(j["state"], j["pages_stored"]) for j in seen]
    assert all(j["pages_per_s"] > 0 for j in partial)
    assert any(j["failed"] and j["pages_stored"] < 16 for j in seen)
    assert [f["file"] for f in final["failed"]] == ["docs/a-broken.pdf"]


CHILD_SCRIPT = """
import sys, time
from colembed.index import Index
from colembed.serve.store_process import open_store_in_child
index = Index(sys.argv[1], store_opener=open_store_in_child, create=False)
print(index.store.pid, flush=True)
time.sleep(600)
"""


def test_the_store_process_closes_the_folder_when_the_server_is_gone(tmp_path, small_model):
    """A server killed with SIGKILL runs no shutdown: its store process sees its lifeline end,
    closes the index and exits, so the folder's lock is free for the next server."""
    index_one_page(tmp_path, small_model)
    server = subprocess.Popen(
        [sys.executable, "-c", CHILD_SCRIPT, str(tmp_path / "db")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = int(server.stdout.readline())
        os.kill(server.pid, signal.SIGKILL)
        server.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and os.path.exists(f"/proc/{child}"):
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            server.kill()
    again = Index(tmp_path / "db", model=small_model)  # the lock is free
    assert len(again) == 1
    again.close()
