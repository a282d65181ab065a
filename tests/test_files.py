"""formats/files.py: whole files or none, with a plain file's mode (the user's umask), not a temporary file's 0600."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from gpt2_engine.formats.files import atomic_write, umask


def test_umask_is_read_without_changing_it() -> None:
    old = os.umask(0o027)
    try:
        assert umask() == 0o027 and umask() == 0o027
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_written_files_get_the_users_umask(tmp_path: Path, mask: int) -> None:
    from safetensors.torch import load_file, save_file

    old = os.umask(mask)
    try:
        atomic_write(tmp_path / "a.json", lambda tmp: tmp.write_text("{}"))
        # safetensors writes a file of its own, 0600, in place of the temporary one
        atomic_write(tmp_path / "b.safetensors", lambda tmp: save_file({"x": torch.ones(2)}, tmp))
    finally:
        os.umask(old)
    for name in ("a.json", "b.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask, name
    assert (tmp_path / "a.json").read_text() == "{}" and sorted(os.listdir(tmp_path)) == ["a.json", "b.safetensors"]
    assert torch.equal(load_file(tmp_path / "b.safetensors")["x"], torch.ones(2))


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "a.json", fail)
    assert (tmp_path / "a.json").read_text() == "old" and os.listdir(tmp_path) == ["a.json"]
