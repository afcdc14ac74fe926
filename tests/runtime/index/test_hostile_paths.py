"""A path checked once is not trusted later: confinement is checked when a file is opened, on the
descriptor that is read (`safe_fs.open_file`), and that descriptor is what is hashed and decoded.

The repro is the one a user would meet: `colembed serve` accepts an index job for a file inside
its root, the file is swapped for a link to a file outside before the job runs, and the outside
file must be neither indexed nor served.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import colembed
from colembed.index import Index
from colembed.index import index as index_module
from colembed.index.errors import SourceError
from colembed.index.index import render_stored_page
from colembed.index.sources import Document
from colembed import safe_fs
from tests.fixtures.documents import page, write_pdf

TOKENS = 64


@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


@pytest.fixture
def tree(tmp_path):
    """root/sub/a.png, root/b.png and outside/secret.png (a page that must never be read)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    page("inside a").save(root / "sub" / "a.png")
    page("inside b").save(root / "b.png")
    page("secret").save(outside / "secret.png")
    return root.resolve(), outside.resolve()


# ------------------------------------------------------------------------- the open primitive
def test_open_file_reads_a_regular_file_inside_its_folder(tree):
    root, _ = tree
    with safe_fs.open_file(root / "sub" / "a.png", within=[root]) as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f.name == str(root / "sub" / "a.png")


def test_open_file_refuses_a_file_swapped_for_a_link(tree):
    root, outside = tree
    target = root / "sub" / "a.png"
    target.unlink()
    target.symlink_to(outside / "secret.png")
    with pytest.raises(safe_fs.UnsafePathError, match="a link in its path"):
        safe_fs.open_file(target, within=[root])
    inner = root / "b-link.png"
    inner.symlink_to(root / "b.png")  # a link, even to a file inside, is not followed
    with pytest.raises(safe_fs.UnsafePathError, match="a link in its path"):
        safe_fs.open_file(inner, within=[root])


def test_open_file_refuses_a_folder_swapped_for_a_link(tree):
    root, outside = tree
    (outside / "sub").mkdir()
    page("secret too").save(outside / "sub" / "a.png")
    os.rename(root / "sub", root / "sub-was")
    (root / "sub").symlink_to(outside / "sub", target_is_directory=True)
    with pytest.raises(safe_fs.UnsafePathError, match=r"a link in its path \(sub\)"):
        safe_fs.open_file(root / "sub" / "a.png", within=[root])


def test_open_file_refuses_paths_outside_and_what_is_not_a_regular_file(tree):
    root, outside = tree
    with pytest.raises(safe_fs.UnsafePathError, match="outside the folders"):
        safe_fs.open_file(outside / "secret.png", within=[root])
    with pytest.raises(safe_fs.UnsafePathError, match="outside the folders"):
        safe_fs.open_file(root / ".." / "outside" / "secret.png", within=[root])
    with pytest.raises(safe_fs.UnsafePathError, match="not a regular file"):
        safe_fs.open_file(root / "sub", within=[root])
    fifo = root / "pipe.png"
    os.mkfifo(fifo)  # would block a reader forever
    for within in ([root], None):
        with pytest.raises(safe_fs.UnsafePathError, match="not a regular file"):
            safe_fs.open_file(fifo, within=within)


def test_a_document_is_hashed_and_decoded_from_one_descriptor(tree):
    root, outside = tree
    path = root / "b.png"
    with Document(path, max_pixels=10**6, within=[root]) as doc:
        sha = doc.sha256
        os.replace(outside / "secret.png", path)  # swapped after it was opened
        assert np.array_equal(np.asarray(doc.render(1)), np.asarray(page("inside b")))
    from colembed.index.sources import file_sha256

    assert sha != file_sha256(path)  # what was read is the file that was opened


# --------------------------------------------------------------------------------- the index
def test_index_add_within_refuses_a_file_swapped_for_a_link_after_discovery(
    tree, small_model, monkeypatch, tmp_path
):
    root, outside = tree
    real_discover = index_module.discover

    def discover_then_swap(*args, **kwargs):
        found = real_discover(*args, **kwargs)
        os.rename(root / "sub", root / "sub-was")  # between the walk and the open
        (root / "sub").symlink_to(outside, target_is_directory=True)
        os.rename(outside / "secret.png", outside / "a.png")
        return found

    monkeypatch.setattr(index_module, "discover", discover_then_swap)
    with Index(tmp_path / "db", model=small_model) as index:
        result = index.add([root], progress=False, within=[root])
        stored = {p["path"] for _, p in index.store.payloads()}
    assert [r.path for r in result.failed] == [str(root / "sub" / "a.png")]
    assert "a link in its path (sub)" in result.failed[0].reason
    assert stored == {str(root / "b.png")}


def test_index_add_within_refuses_a_named_link_out(tree, small_model, tmp_path):
    root, outside = tree
    (root / "b.png").unlink()
    (root / "b.png").symlink_to(outside / "secret.png")
    with Index(tmp_path / "db", model=small_model) as index:
        result = index.add([root / "b.png", root / "sub" / "a.png"], progress=False, within=[root])
        stored = {p["path"] for _, p in index.store.payloads()}
    assert [r.path for r in result.failed] == [str(outside / "secret.png")]
    assert stored == {str(root / "sub" / "a.png")}


def test_a_stored_page_is_not_drawn_from_a_link_out_of_its_root(tree, tmp_path):
    root, outside = tree
    path = root / "b.png"
    with Document(path, max_pixels=10**6) as doc:
        payload = {"sha256": doc.sha256, "width": 420, "height": 560}
    os.replace(path, outside / "copy.png")  # the same bytes, now outside, linked in
    path.symlink_to(outside / "copy.png")
    with pytest.raises(SourceError, match="a link in its path"):
        render_stored_page(str(path), 1, payload, max_pixels=10**6, dpi=None, within=[root])


# ---------------------------------------------------------------------------- colembed serve
def test_serve_a_job_swapped_for_a_link_after_it_was_accepted_reads_nothing_outside(
    tmp_path, small_model
):
    """Queue job A (30 pages), queue B for docs/swap/a.png (202), then
    `ln -sf /outside/secret.png docs/swap/a.png`: B must not index or serve secret.png."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from colembed.serve.app import Settings, create_app
    from colembed.serve.roots import Roots, parse_roots

    docs, outside = tmp_path / "docs", tmp_path / "outside"
    (docs / "swap").mkdir(parents=True)
    outside.mkdir()
    write_pdf(docs / "long.pdf", [f"page {n}" for n in range(1, 31)])
    page("inside").save(docs / "swap" / "a.png")
    page("secret").save(outside / "secret.png")
    index = Index(tmp_path / "db", model=small_model)
    settings = Settings(roots=Roots(parse_roots([f"docs={docs}"])))
    with TestClient(create_app(index, settings), base_url="http://127.0.0.1:8000") as client:
        a = client.post("/v1/index", json={"paths": ["long.pdf"]})
        b = client.post("/v1/index", json={"paths": ["swap/a.png"]})
        assert (a.status_code, b.status_code) == (202, 202), (a.text, b.text)
        (docs / "swap" / "a.png").unlink()  # ln -sf /outside/secret.png docs/swap/a.png
        (docs / "swap" / "a.png").symlink_to(outside / "secret.png")
        jobs = [_wait(client, r.json()["id"]) for r in (a, b)]
        assert jobs[0]["state"] == "done" and jobs[0]["pages_added"] == 30
        assert jobs[1]["pages_added"] == 0
        assert [f["file"] for f in jobs[1]["failed"]] == ["secret.png"]  # named, not shown
        hits = client.post("/v1/search", json={"query": "secret", "k": 100}).json()
        files = {h["file"] for h in hits["results"][0]["hits"]}
        assert files == {"docs/long.pdf"}
        for hit in hits["results"][0]["hits"][:2]:
            assert client.get(f"/v1/pages/{hit['id']}/image").status_code == 200
    index.close()


def _wait(client, job_id, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


# --------------------------------------------------------------------- names shown on a terminal
def test_search_escapes_control_characters_in_names_and_json_stays_exact(
    tmp_path, small_model, capsys
):
    from colembed.cli import main

    docs = tmp_path / "docs"
    docs.mkdir()
    name = "evil\n   1     9.999     1  forged.pdf\x1b[2J\u202e.png"
    page("evil").save(docs / name, format="PNG")
    with Index(tmp_path / "db", model=small_model) as index:
        assert index.add([docs], progress=False).ok
    assert main(["search", "evil", "--db", str(tmp_path / "db")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert len(out.splitlines()) == 3  # the query, the header, one hit: no forged line
    assert "evil\\n   1     9.999     1  forged.pdf\\x1b[2J\\u202e.png" in out
    assert main(["search", "evil", "--db", str(tmp_path / "db"), "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)[0]["hits"]
    assert hits[0]["file"] == str(docs / name)
