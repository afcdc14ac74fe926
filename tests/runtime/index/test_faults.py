"""Fault injection for the index: an error at each boundary of the pipeline, a
SIGKILL at each write step, a disk that fills up mid-run. Each run ends with either a complete
index or a clear error and a non-zero exit, and after a re-run with the index an uninterrupted run
makes.

Faults are injected at the boundaries colembed does not own (the OS, the store's `upsert` /
`flush` / `delete`, `os.replace`), in a child process where the fault is a kill. The disk-full
test mounts a tmpfs of a few MB (the test runs as root here); it is skipped, saying why, where
mounting is not allowed.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import colembed
from colembed.cli import main
from colembed.index import DiskFullError, Index, StoreError, edge
from tests.fixtures.commands import quiet_index_flags
from tests.fixtures.documents import write_pdf

TOKENS = 64


@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


@pytest.fixture(scope="module")
def clean(small_model, tmp_path_factory):
    """The uninterrupted run over `_documents`: what every interrupted run must end as."""
    docs = _documents(tmp_path_factory.mktemp("clean-docs") / "docs")
    with Index(tmp_path_factory.mktemp("clean") / "db", model=small_model) as index:
        assert index.add([docs], progress=False).ok
        return _contents(index, docs)


def _documents(folder):
    folder.mkdir(parents=True)
    for name, pages in (("a", 3), ("b", 2), ("c", 4), ("d", 1)):
        write_pdf(folder / f"{name}.pdf", [f"{name} {i}" for i in range(pages)])
    return folder


def _contents(index, docs):
    """(file name, page, page count) of every stored page (paths differ between the runs'
    folders, and so do the PDFs' bytes: pypdf stamps each file it writes)."""
    return sorted(
        (os.path.relpath(p["path"], docs), p["page"], p["pages"]) for _, p in index.store.payloads()
    )


# ------------------------------------------------------------ an error at each boundary, then a re-run
@pytest.mark.parametrize("boundary", ["upsert", "flush", "delete", "meta-write"])
def test_an_error_at_a_boundary_is_clear_and_a_rerun_completes(
    boundary, tmp_path, small_model, clean, monkeypatch
):
    docs = _documents(tmp_path / "docs")
    db = tmp_path / "db"
    if boundary == "meta-write":  # the disk fills as the new index records what it is
        real = os.replace

        def replace(src, dst, *args, **kwargs):
            if str(dst).endswith("colembed_index.json"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(DiskFullError, match=str(db)):
            Index(db, model=small_model)
        monkeypatch.setattr(os, "replace", real)
    else:
        with Index(db, model=small_model) as index:
            if boundary == "delete":  # a changed file: its older pages are deleted at its end
                index.add([docs / "a.pdf"], progress=False)
                write_pdf(docs / "a.pdf", ["a 0", "a 1", "a 2 changed"])
            real = getattr(index.store, boundary)
            calls = []

            def failing(*args, **kwargs):
                calls.append(1)
                if len(calls) == 2 or boundary != "upsert":
                    raise StoreError(f"{index.store.location}: Qdrant Edge failed to {boundary}")
                return real(*args, **kwargs)

            setattr(index.store, boundary, failing)
            with pytest.raises(StoreError, match=f"failed to {boundary}"):
                index.add([docs], batch_size=1, progress=False)
            delattr(index.store, boundary)
    with Index(db, model=small_model) as index:
        assert index.add([docs], progress=False).ok
        got = _contents(index, docs)
    if boundary == "delete":
        assert [r for r in got if r[0] != "a.pdf"] == [r for r in clean if r[0] != "a.pdf"]
        assert len([r for r in got if r[0] == "a.pdf"]) == 3  # the old version is gone
    else:
        assert got == clean


# ------------------------------------------------------------------ a SIGKILL at each write step
CHILD = textwrap.dedent("""
    import os, sys
    import colembed
    from colembed.index import Index

    model = colembed.load(sys.argv[1], max_image_tokens=64)
    step, nth = sys.argv[4], int(sys.argv[5])
    index = Index(sys.argv[2], model=model)
    real = getattr(index.store, step)
    calls = []

    def killed(*args, **kwargs):  # the real store call, then the process dies mid-run
        calls.append(1)
        if len(calls) == nth:
            if step == "flush":
                os.kill(os.getpid(), 9)  # before the flush: the WAL holds everything
            real(*args, **kwargs)
            os.kill(os.getpid(), 9)
        return real(*args, **kwargs)

    setattr(index.store, step, killed)
    index.add([sys.argv[3]], batch_size=1, progress=False)
    print("finished", flush=True)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
@pytest.mark.parametrize("step,nth", [("upsert", 2), ("flush", 1)])
def test_a_sigkill_at_a_write_step_then_a_rerun_equals_an_uninterrupted_run(
    step, nth, tmp_path, exported_tiny, small_model, clean
):
    docs = _documents(tmp_path / "docs")
    db = tmp_path / "db"
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(exported_tiny.folder),
            str(db),
            str(docs),
            step,
            str(nth),
        ],
        capture_output=True,
        text=True,
    )
    assert child.returncode == -signal.SIGKILL and "finished" not in child.stdout
    with Index(db, model=small_model) as index:
        assert index.add([docs], progress=False).ok
        assert _contents(index, docs) == clean


# ------------------------------------------------------------------------------ flush cadence
def test_a_long_run_flushes_as_it_goes(tmp_path, small_model, monkeypatch):
    """A flush is due every FLUSH_MIN_PAGES at least (lowered here to see it on 10 pages), so
    the write-ahead log is truncated during the run, not only at its end."""
    monkeypatch.setattr(edge, "FLUSH_MIN_PAGES", 2)
    monkeypatch.setattr(edge, "FLUSH_FRACTION", 0.0)
    docs = _documents(tmp_path / "docs")
    with Index(tmp_path / "db", model=small_model) as index:
        index.add([docs], batch_size=1, progress=False)
        assert index.store.flushes >= 10 // 2  # and one more at the end of the run


def test_the_cadence_bounds_the_log_by_what_is_stored():
    """Due after FLUSH_FRACTION of the stored pages, within [FLUSH_MIN_PAGES, FLUSH_MAX_PAGES]."""
    assert edge.FLUSH_MIN_PAGES <= edge.FLUSH_MAX_PAGES and 0 < edge.FLUSH_FRACTION <= 0.1


def _real_shape_points(count):
    """`count` points of pages of 8 x 8 image tokens at dim 128 (as `Index.add` stores them)."""
    import numpy as np

    from colembed.index.schema import make_point
    from colembed.model import PageLayout

    layout = PageLayout(grid_rows=8, grid_cols=8, image_start=2, num_tokens=70, token_px=28)
    rng = np.random.default_rng(0)
    out = []
    for n in range(count):
        v = rng.standard_normal((layout.num_tokens, 128)).astype(np.float32)
        out.append(
            make_point(
                v / np.linalg.norm(v, axis=1, keepdims=True),
                layout,
                {
                    "path": f"/docs/{n}.pdf",
                    "page": 1,
                    "pages": 1,
                    "sha256": f"{n:064x}",
                    "width": 224,
                    "height": 224,
                    "model": "m",
                    "variant": "fp32",
                    "manifest_sha256": "0" * 64,
                    "schema": 2,
                },
            )
        )
    return out


def test_the_cadence_bounds_the_log_by_bytes_as_well(tmp_path, monkeypatch):
    """Long after FLUSH_MIN_PAGES, 8% of a large index is up to FLUSH_MAX_PAGES pages of log for
    a killed run to replay: a flush is also due once the batches since the last one carried
    FLUSH_MAX_LOG_BYTES of vectors (lowered here to 2.5 pages' worth, the page bounds out of
    reach), so the log a kill leaves is bounded in bytes whatever the pages' size."""
    from colembed.index import open_store

    monkeypatch.setattr(edge, "FLUSH_SECONDS", float("inf"))
    points = _real_shape_points(6)
    store = open_store(tmp_path / "db", dim=128)
    try:
        page_bytes = sum(4 * v.size for v in store.stored_vectors(points[0]).values())
        monkeypatch.setattr(edge, "FLUSH_MAX_LOG_BYTES", int(2.5 * page_bytes))
        for p in points:
            store.upsert([p])
        assert store.flushes == 2  # after the 3rd page's bytes and after the 6th's
        assert store._unflushed == 0 and store.flush_seconds > 0
    finally:
        store.close()
    again = open_store(tmp_path / "db")
    try:
        assert again.count() == 6
    finally:
        again.close()


# --------------------------------------------------------------------------------- disk full
@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted for the test, a few MB more than the free space an index keeps in hand
    (`edge.DISK_MARGIN_BYTES`: what reopening the shard needs), grown later with `grow`. 6 MB:
    ~60 of the test's 100 pages fit (schema 3; +10 MB held ~110 once rows / cols went)."""
    mount = tmp_path / "small"
    mount.mkdir()
    size = (edge.DISK_MARGIN_BYTES >> 20) + 6
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}): "
            "the disk-full test needs root (or CAP_SYS_ADMIN)"
        )

    def grow(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True)

    try:
        yield mount, grow
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.skipif(sys.platform != "linux", reason="tmpfs")
def test_a_full_disk_stops_clearly_keeps_the_pages_and_the_next_run_resumes(
    tmp_path, small_disk, small_model, exported_tiny, capsys
):
    mount, grow = small_disk
    docs = tmp_path / "docs"
    docs.mkdir()
    for n in range(20):
        write_pdf(docs / f"doc{n:02d}.pdf", [f"doc {n} page {i}" for i in range(5)])
    db = mount / "db"
    common = quiet_index_flags(db, exported_tiny.folder, TOKENS)
    assert main(["index", str(docs), *common]) == 1
    err = capsys.readouterr().err
    assert f"{db}: the disk is full" in err and "MB free" in err and "run the same command" in err
    with Index(db) as index:  # openable, with the pages stored before the disk filled
        stored = len(index)
        assert 0 < stored < 100
    grow(f"{(edge.DISK_MARGIN_BYTES >> 20) + 256}m")
    assert main(["index", str(docs), *common]) == 0
    capsys.readouterr()
    with Index(db) as resumed, Index(tmp_path / "clean", model=small_model) as clean:
        clean.add([docs], progress=False)
        assert _contents(resumed, docs) == _contents(clean, docs) and len(resumed) == 100


# ------------------------------------------------------------------------ a fault at pooling
def test_a_failure_at_the_pooling_step_fails_that_page_and_a_rerun_completes(
    tmp_path, small_model, clean, monkeypatch
):
    """Pooling a page (its row, column and mean vectors, in the writer thread) runs out of
    memory: that page fails, as a page the model refuses does (its file reported failed naming
    it), every other page is stored, and a re-run ends with the uninterrupted run's index."""
    from colembed.index import schema

    docs = _documents(tmp_path / "docs")
    db = tmp_path / "db"
    real, calls = schema.pooled_vectors, []

    def out_of_memory(vectors, layout):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("Unable to allocate 1.2 GiB for an array")
        return real(vectors, layout)

    monkeypatch.setattr(schema, "pooled_vectors", out_of_memory)
    with Index(db, model=small_model) as index:
        result = index.add([docs], batch_size=1, progress=False)
        assert [os.path.basename(r.path) for r in result.failed] == ["a.pdf"]
        assert "page 2" in result.failed[0].reason and "MemoryError" in result.failed[0].reason
        assert len(index) == len(clean) - 1
    monkeypatch.setattr(schema, "pooled_vectors", real)
    with Index(db, model=small_model) as index:
        assert index.add([docs], progress=False).ok
        assert _contents(index, docs) == clean


# ------------------------------------------------------------- a second Ctrl-C during the first
SLOW_WRITER = textwrap.dedent("""
    import os, signal, sys, time
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when the test runs where SIGINT is
    # ignored (a background job: the child inherits SIG_IGN and would never see the signals).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from colembed.cli import main
    from colembed.index import edge, ingest

    real_upsert, real_init, calls, writers = edge.EdgeStore.upsert, ingest._Writer.__init__, [], []

    def slow(self, points):  # the second write meets a disk that hangs until the test lets go
        calls.append(1)
        print(f"upsert {len(points)}", flush=True)
        if len(calls) == 2:
            print("slow", flush=True)
            queued = False
            while not os.path.exists(sys.argv[4]):
                if not queued and writers[0].jobs.qsize():  # a job waits behind the hang
                    print("queued", flush=True)
                    queued = True
                time.sleep(0.05)
        return real_upsert(self, points)

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        writers.append(self)

    edge.EdgeStore.upsert = slow
    ingest._Writer.__init__ = init
    sys.exit(main(["index", sys.argv[3], "--db", sys.argv[2], "--model", sys.argv[1],
                   "--max-image-tokens", "64", "--batch-size", "1", "--quiet"]))
""")


def _lines_until(lines, predicate, seen: list[str], timeout: float = 120) -> None:
    """Read the child's lines (from a reader thread's queue) into `seen` until one satisfies
    `predicate`; fail naming what was seen if none does within `timeout` seconds, instead of
    blocking on a pipe that never speaks."""
    import queue
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"the child never printed the expected line; it printed {seen}")
        if line is None:
            pytest.fail(f"the child ended before the expected line; it printed {seen}")
        seen.append(line)
        if predicate(line):
            return


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child")
def test_a_second_ctrl_c_while_the_first_is_handled_keeps_every_page_handed_to_the_writer(
    tmp_path, exported_tiny, small_model, clean
):
    """`colembed index` in a child, Ctrl-C (SIGINT) while the writer hangs on a slow disk with
    a job queued behind the hang, then Ctrl-C again while the first is being handled (the run
    is waiting for the writer): it still waits, every page the writer was handed is stored, it
    exits 130 saying how to resume, the index opens, and a re-run ends with the uninterrupted
    run's index.

    The child's hung write says when a job waits in the writer's queue behind it ("queued"):
    the first Ctrl-C comes only then, so the test does not depend on how far the renderer and
    the embedding got (an earlier form waited for two pages embedded after the
    hang, which the pipeline does not always reach: it then waited for a watchdog that let the
    disk answer, and the run, no longer hung, ended within the 1.5 s the test gives it)."""
    import queue
    import threading
    import time

    docs = _documents(tmp_path / "docs")
    db, release = tmp_path / "db", tmp_path / "disk-answers"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SLOW_WRITER,
            str(exported_tiny.folder),
            str(db),
            str(docs),
            str(release),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(
        target=lambda: ([lines.put(line.strip()) for line in child.stdout], lines.put(None)),
        daemon=True,
    )
    reader.start()
    seen: list[str] = []
    try:
        _lines_until(lines, lambda line: line == "queued", seen)  # the writer hangs, a job waits
        child.send_signal(signal.SIGINT)
        time.sleep(1.5)  # the first is being handled: the run waits for the writer
        assert child.poll() is None, (seen, child.stderr.read())
        child.send_signal(signal.SIGINT)
        time.sleep(0.5)
    finally:
        release.touch()  # the disk answers (also when the test failed above: no hung child)
    err = child.stderr.read()
    child.wait(timeout=300)
    reader.join(timeout=60)
    while (line := lines.get()) is not None:
        seen.append(line)
    assert child.returncode == 130, err
    assert "resume by re-running the same command" in err and "Traceback" not in err
    handed = sum(int(line.split()[1]) for line in seen if line.startswith("upsert "))
    # the pages queued behind the hang were written too (were the wait cut short by the second
    # Ctrl-C, the process would exit with them in the queue), and the run stopped early
    assert 2 < handed < len(clean), (handed, seen, err)
    with Index(db) as index:
        assert len(index) == handed
    with Index(db, model=small_model) as index:
        assert index.add([docs], progress=False).ok
        assert _contents(index, docs) == clean
