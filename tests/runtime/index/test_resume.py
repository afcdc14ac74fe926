"""A run killed with SIGKILL, then re-run, ends with exactly the store an uninterrupted run makes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import colembed
from colembed.index import Index
from tests.fixtures.documents import write_pdf

CHILD = textwrap.dedent("""
    import sys
    import colembed
    from colembed.index import Index

    model = colembed.load(sys.argv[1], max_image_tokens=64)
    index = Index(sys.argv[2], model=model)
    store_upsert = index.store.upsert

    def upsert(points):  # the real store; the parent learns when a page is down
        store_upsert(points)
        print("stored", len(points), flush=True)

    index.store.upsert = upsert
    index.add([sys.argv[3]], batch_size=1, progress=False)
    print("finished", flush=True)
""")


def _contents(index):
    payloads = dict(index.store.payloads())
    return payloads, index.store.page_vectors(list(payloads))


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path, exported_tiny):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, pages in (("a", 3), ("b", 2), ("c", 3)):
        write_pdf(docs / f"{name}.pdf", [f"{name} {i}" for i in range(pages)])
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    killed_db = tmp_path / "killed"
    child = subprocess.Popen(
        [sys.executable, str(script), str(exported_tiny.folder), str(killed_db), str(docs)],
        stdout=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in child.stdout:
        seen.append(line.strip())
        if len(seen) == 3:
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL and "finished" not in seen

    model = colembed.load(exported_tiny.folder, max_image_tokens=64)
    with Index(killed_db, model=model) as index:
        before = len(index)
        assert 3 <= before < 8  # whole pages only, and not all of them
        rerun = index.add([docs], batch_size=1)
        assert rerun.ok and rerun.pages_added == 8 - before  # stored pages are not embedded again
        resumed_payloads, resumed_vectors = _contents(index)
    with Index(tmp_path / "clean", model=model) as index:
        index.add([docs])
        clean_payloads, clean_vectors = _contents(index)
    assert resumed_payloads == clean_payloads and len(clean_payloads) == 8
    for pid, vectors in clean_vectors.items():  # batches differ (1 vs 4 pages): float noise only
        np.testing.assert_allclose(resumed_vectors[pid], vectors, atol=2e-3)
        assert resumed_vectors[pid].shape == vectors.shape
