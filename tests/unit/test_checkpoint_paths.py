"""Which checkpoint --load means, and atomic publishing (pure file-system logic, no ranks)."""

from __future__ import annotations

import os

import pytest

from megatron_parm.checkpointing.paths import (
    CheckpointError,
    REQUIRED_FILES,
    TRACKER_FILE,
    checkpoint_dir,
    partial_dir,
    publish,
    resolve_load,
)


def fake_checkpoint(path):
    os.makedirs(path, exist_ok=True)
    for name in REQUIRED_FILES:
        open(os.path.join(path, name), "w").close()


def test_missing_load_is_an_error_unless_it_is_the_save_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_load(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_load(str(tmp_path / "nowhere"), save=str(tmp_path / "elsewhere"))
    # The documented auto-resume case: --load == --save, nothing saved yet.
    assert resolve_load(str(tmp_path / "run"), save=str(tmp_path / "run")) is None
    os.makedirs(tmp_path / "run")
    assert resolve_load(str(tmp_path / "run"), save=str(tmp_path / "run")) is None


def test_empty_folder_is_an_error_without_auto_resume(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        resolve_load(str(tmp_path))


def test_tracker_names_the_checkpoint(tmp_path):
    fake_checkpoint(checkpoint_dir(str(tmp_path), 5))
    fake_checkpoint(checkpoint_dir(str(tmp_path), 10))
    (tmp_path / TRACKER_FILE).write_text("5\n")
    assert resolve_load(str(tmp_path)) == (checkpoint_dir(str(tmp_path), 5), 5)
    assert resolve_load(checkpoint_dir(str(tmp_path), 10)) == (checkpoint_dir(str(tmp_path), 10), 10)


def test_corrupted_tracker_or_missing_folder_is_an_error(tmp_path):
    (tmp_path / TRACKER_FILE).write_text("garbage")
    with pytest.raises(CheckpointError, match="corrupted tracker"):
        resolve_load(str(tmp_path), save=str(tmp_path))
    (tmp_path / TRACKER_FILE).write_text("7")
    with pytest.raises(CheckpointError, match="iter_0000007 does not exist"):
        resolve_load(str(tmp_path), save=str(tmp_path))


def test_partial_saves_are_never_loaded(tmp_path):
    fake_checkpoint(partial_dir(str(tmp_path), 4))
    # Only an unfinished save: with auto-resume a fresh start, otherwise an error naming it.
    assert resolve_load(str(tmp_path), save=str(tmp_path)) is None
    with pytest.raises(CheckpointError, match=r"iter_0000004\.partial"):
        resolve_load(str(tmp_path))
    # A folder without its index files is incomplete: an error, even with auto-resume.
    os.makedirs(checkpoint_dir(str(tmp_path), 2))
    with pytest.raises(CheckpointError, match="incomplete checkpoint folders: iter_0000002"):
        resolve_load(str(tmp_path), save=str(tmp_path))


def test_published_checkpoint_without_tracker_is_found(tmp_path):
    # A kill between the rename and the tracker write.
    fake_checkpoint(checkpoint_dir(str(tmp_path), 2))
    fake_checkpoint(checkpoint_dir(str(tmp_path), 4))
    assert resolve_load(str(tmp_path)) == (checkpoint_dir(str(tmp_path), 4), 4)


def test_publish_renames_then_writes_the_tracker(tmp_path):
    root = str(tmp_path)
    fake_checkpoint(checkpoint_dir(root, 3))
    (tmp_path / TRACKER_FILE).write_text("3")
    fake_checkpoint(partial_dir(root, 3))
    (tmp_path / "iter_0000003.partial" / "new").write_text("x")
    publish(root, 3)  # replaces the older iter_0000003
    assert (tmp_path / "iter_0000003" / "new").exists()
    assert not os.path.exists(partial_dir(root, 3))
    fake_checkpoint(partial_dir(root, 6))
    fake_checkpoint(partial_dir(root, 4))  # a save killed earlier
    publish(root, 6)
    assert (tmp_path / TRACKER_FILE).read_text() == "6"
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000006", TRACKER_FILE]
