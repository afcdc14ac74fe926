"""colembed deletes only what it made, and reads model files only from inside their folder."""

from __future__ import annotations

import os

import pytest

from colembed.errors import ModelFolderError
from colembed.safe_fs import (
    UnsafeDeletionError,
    commit_folder,
    inside,
    is_staging_folder,
    is_work_folder,
    make_work_folder,
    remove_tree,
    staging_folder,
)


@pytest.mark.parametrize("name", ["/etc/passwd", "../secret", "a/../../b", "..", "", "C:\\x"])
def test_inside_refuses_names_that_leave_the_folder(tmp_path, name):
    with pytest.raises(ModelFolderError):
        inside(tmp_path, name)


def test_inside_refuses_a_link_pointing_out(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(outside, folder / "vision.onnx")
    with pytest.raises(ModelFolderError, match="outside"):
        inside(folder, "vision.onnx")
    (folder / "sub").mkdir()
    assert inside(folder, "sub/x.onnx") == (folder / "sub" / "x.onnx").resolve()


def test_work_folder_refuses_a_users_folder_and_keeps_its_files(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    with pytest.raises(UnsafeDeletionError):
        make_work_folder(user, "demo")
    with pytest.raises(UnsafeDeletionError):
        remove_tree(user, owner=is_work_folder)
    assert (user / "thesis.tex").read_text() == "years of work"
    made = make_work_folder(tmp_path / "new", "demo")
    assert is_work_folder(made) and make_work_folder(made, "demo") == made
    remove_tree(made, owner=is_work_folder)
    assert not made.exists()


def test_remove_tree_refuses_the_working_folder_even_if_marked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_work_folder(tmp_path, "demo")
    with pytest.raises(UnsafeDeletionError, match="working"):
        remove_tree(tmp_path, owner=is_work_folder)
    with pytest.raises(UnsafeDeletionError, match="working"):
        remove_tree(tmp_path.parent, owner=lambda p: True)


def test_commit_replaces_only_what_the_caller_vouches_for(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    staging = staging_folder(dest, "test")
    (staging / "result.txt").write_text("new")
    with pytest.raises(UnsafeDeletionError):
        commit_folder(staging, dest, replaceable=lambda p: False)
    assert (dest / "notes.txt").read_text() == "keep me" and is_staging_folder(staging)
    commit_folder(staging, dest, replaceable=lambda p: True)
    assert sorted(p.name for p in dest.iterdir()) == ["result.txt"]
    assert not any(p.name.startswith(".out.") for p in tmp_path.iterdir())
