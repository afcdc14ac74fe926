"""numpy's BLAS held to one thread around the ingest path's small products (colembed/blas.py):
OpenBLAS spin-waits for its helper threads, so beside a busy core a page's k-means took 0.5 s
instead of 0.03 s. These check the limit is taken and given back, and that the page-level
products of the index (centroids, pooling) run under it."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from colembed import blas
from colembed.index import pooling, tokens


@pytest.fixture
def recorded(monkeypatch):
    calls: list[int] = []

    def limit(n: int) -> int:
        calls.append(n)
        return 7  # the "previous" count the block must restore

    monkeypatch.setattr(blas, "_LIMIT", limit)
    return calls


def test_one_thread_sets_one_and_restores_the_previous_count(recorded):
    with blas.one_thread():
        assert recorded == [1]
    assert recorded == [1, 7]


def test_one_thread_restores_after_an_error(recorded):
    with pytest.raises(RuntimeError):
        with blas.one_thread():
            raise RuntimeError("boom")
    assert recorded == [1, 7]


def test_without_a_local_limit_the_block_just_runs(monkeypatch):
    monkeypatch.setattr(blas, "_LIMIT", None)
    with blas.one_thread():
        pass


def test_page_centroids_and_pooling_run_single_threaded(recorded):
    rng = np.random.default_rng(1)
    page = rng.standard_normal((200, 16)).astype(np.float32)
    page /= np.linalg.norm(page, axis=1, keepdims=True)
    tokens.page_centroids(page, 8)
    assert recorded == [1, 7]
    pytest.importorskip("scipy")
    pooling.pool_tokens(page, 3)
    assert recorded == [1, 7, 1, 7]


def test_centroids_unchanged_by_the_limit(monkeypatch):
    """The same centroids with and without the limit (the limit changes threads, not maths, to
    float tolerance: a reopened index's table stays current)."""
    rng = np.random.default_rng(2)
    page = rng.standard_normal((700, 128)).astype(np.float32)
    page /= np.linalg.norm(page, axis=1, keepdims=True)
    limited = tokens.page_centroids(page)
    monkeypatch.setattr(blas, "_LIMIT", None)
    np.testing.assert_allclose(tokens.page_centroids(page), limited, atol=1e-5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="found through /proc/self/maps")
def test_the_openblas_of_numpys_wheel_is_found_and_limits_only_this_thread():
    limit = blas._find_local_limit()
    if "openblas" not in str(np.show_config(mode="dicts")).lower():
        pytest.skip("numpy is not linked to OpenBLAS here")
    assert limit is not None
    seen = {}

    def other():  # another thread's count is untouched by this thread's block
        seen["other"] = limit(limit(3))  # set 3, read back by setting it again

    with blas.one_thread():
        assert limit(1) == 1  # inside the block this thread's count is 1
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["other"] == 3
