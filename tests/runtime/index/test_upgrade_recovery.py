"""`colembed upgrade` leaves nothing behind and works on a folder that cannot be renamed.

- A killed upgrade's copy (`.db.staging-*`, the size of the index) or the old index it set aside
  (`.db.replaced-*`) is removed by the next open or upgrade; only folders carrying the upgrade's
  marker are touched, never a user's folder of a similar name.
- A folder that is a mount point (rename() fails with EBUSY, across devices EXDEV) is upgraded
  in place; a kill in the middle of the in-place swap is finished by the next open.
"""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from colembed.index import edge, open_store
from colembed.index.edge import upgrade_index
from colembed.index.schema import make_point
from colembed.model import PageLayout
from colembed.safe_fs import STAGING_MARKER
from tests.fixtures.stores import one_page_payload

DIM, ROWS, COLS, START = 16, 2, 3, 1
N_PAGES = 6
LAYOUT = PageLayout(
    grid_rows=ROWS, grid_cols=COLS, image_start=START, num_tokens=START + ROWS * COLS, token_px=28
)


def _points():
    rng = np.random.default_rng(0)
    out = []
    for i in range(N_PAGES):
        x = rng.standard_normal((START + ROWS * COLS, DIM))
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
        out.append(
            make_point(
                x,
                LAYOUT,
                one_page_payload(i, 84, 56, schema=2),
            )
        )
    return out


@pytest.fixture
def old_index(tmp_path, monkeypatch):
    """A schema-2 Edge folder of N_PAGES pages (what an older colembed wrote)."""
    with monkeypatch.context() as m:
        m.setattr(edge, "SCHEMA_VERSION", 2)
        store = open_store(tmp_path / "db", dim=DIM)
    store.upsert(_points())
    store.close()
    return tmp_path / "db"


def _marked(folder, purpose="colembed index upgrade", *, big: bool = True):
    folder.mkdir()
    (folder / STAGING_MARKER).write_text(json.dumps({"purpose": purpose, "pid": 1}))
    if big:
        (folder / "shard").mkdir()
        (folder / "shard" / "segment").write_bytes(b"\0" * 4096)
    return folder


def _count(db) -> int:
    store = open_store(db, create=False)
    try:
        return store.count()
    finally:
        store.close()


# ------------------------------------------------------------------ leftovers of a killed upgrade
def test_a_killed_upgrades_copies_are_removed_by_the_next_open(old_index):
    parent = old_index.parent
    staging = _marked(parent / ".db.staging-123-456")  # killed while copying
    replaced = _marked(parent / ".db.replaced-123-789", "replaced output")  # killed after the swap
    inside = _marked(old_index / edge.IN_PLACE_NEW)  # an in-place copy, killed while copying
    assert _count(old_index) == N_PAGES
    assert not staging.exists() and not replaced.exists() and not inside.exists()


def test_only_the_upgrades_own_folders_are_removed(old_index):
    parent = old_index.parent
    users = parent / ".db.staging-mine"  # a user's folder of a similar name, no marker
    users.mkdir()
    (users / "notes.txt").write_text("keep me")
    other = _marked(parent / ".db.staging-999-1", purpose="export")  # another job's marker
    linked = parent / ".db.replaced-5-5"
    linked.symlink_to(users, target_is_directory=True)
    assert _count(old_index) == N_PAGES
    assert (users / "notes.txt").read_text() == "keep me" and other.exists()
    assert linked.is_symlink()


def test_the_next_upgrade_removes_them_too_and_upgrades(old_index):
    staging = _marked(old_index.parent / ".db.staging-123-456")
    done = upgrade_index(old_index)
    assert done.rewritten == N_PAGES and not staging.exists()
    assert sorted(p.name for p in old_index.parent.iterdir()) == ["db"]
    assert _count(old_index) == N_PAGES


# ----------------------------------------------------------------------- a folder that is a mount
@pytest.mark.parametrize("code", [errno.EBUSY, errno.EXDEV])
def test_a_folder_that_cannot_be_renamed_is_upgraded_in_place(old_index, monkeypatch, code):
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if os.fspath(src) == os.fspath(old_index):  # the folder itself: a mount point
            raise OSError(code, os.strerror(code), os.fspath(src))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    done = upgrade_index(old_index)
    assert (done.rewritten, done.old_schema) == (N_PAGES, 2)
    store = open_store(old_index, create=False)
    try:
        assert store.schema == 3 and store.count() == N_PAGES and store.has_tokens()
    finally:
        store.close()
    assert sorted(p.name for p in old_index.parent.iterdir()) == ["db"]
    assert (
        not (old_index / edge.IN_PLACE_NEW).exists()
        and not (old_index / edge.IN_PLACE_OLD).exists()
    )
    assert not upgrade_index(old_index)  # already current


def test_a_mount_point_is_upgraded_in_place_without_trying_a_sibling(old_index, monkeypatch):
    monkeypatch.setattr(edge, "_renamable", lambda folder: False)
    made = []
    monkeypatch.setattr(edge, "staging_folder", lambda *a, **k: made.append(a))
    assert upgrade_index(old_index).rewritten == N_PAGES and not made
    assert _count(old_index) == N_PAGES


@pytest.mark.parametrize("moved_in", [0, 1, 2])
def test_a_kill_during_the_in_place_swap_is_finished_by_the_next_open(
    old_index, monkeypatch, moved_in
):
    """Killed after the old entries were set aside and `moved_in` of the new ones moved in."""
    real_move = edge._move_entries
    calls = []

    def move_then_die(source, dest):
        calls.append(source)
        if source.name == edge.IN_PLACE_NEW:
            for name in edge._SWAPPED[:moved_in]:
                if (source / name).exists():
                    os.rename(source / name, dest / name)
            raise KeyboardInterrupt  # the kill
        return real_move(source, dest)

    monkeypatch.setattr(edge, "_renamable", lambda folder: False)
    monkeypatch.setattr(edge, "_move_entries", move_then_die)
    with pytest.raises(KeyboardInterrupt):
        upgrade_index(old_index)
    monkeypatch.setattr(edge, "_move_entries", real_move)
    assert (old_index / edge.IN_PLACE_OLD / edge.SET_ASIDE_DONE).is_file()
    store = open_store(old_index, create=False)
    try:
        assert store.schema == 3 and store.count() == N_PAGES
    finally:
        store.close()
    assert (
        not (old_index / edge.IN_PLACE_NEW).exists()
        and not (old_index / edge.IN_PLACE_OLD).exists()
    )
