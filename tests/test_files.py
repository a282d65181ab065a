"""formats/files.py: whole files or none, with a plain file's mode (the user's umask), not a temporary file's 0600."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from gpt2_engine.formats.files import (OutputError, OutputFile, atomic_write, output_directory, through_descriptor,
                                       umask)


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


# --- destinations that are not regular files (issue #57, item 3) --------------------------------------------------


def device(path: Path, minor: int = 3) -> Path:
    """A character device node like /dev/null (minor 3) or /dev/full (minor 7), made in a test's own folder."""
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    return path


class Reader(threading.Thread):
    """What a FIFO's other end reads, to its end."""

    def __init__(self, fifo: Path) -> None:
        super().__init__(daemon=True)
        self.fifo, self.data = fifo, b""
        self.start()

    def run(self) -> None:
        with open(self.fifo, "rb") as f:
            self.data = f.read()

    def result(self) -> bytes:
        self.join(timeout=60)
        assert not self.is_alive(), "the writer never closed the FIFO"
        return self.data


@contextlib.contextmanager
def small_disk(tmp_path: Path, options: str = "size=64k"):
    """A tmpfs of 64 KB (or read-only) mounted on a folder of the test's, unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True,
                      check=False).returncode:
        pytest.skip("this machine does not let a test mount a tmpfs")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_character_device_is_written_into_and_stays_a_device(tmp_path: Path) -> None:
    null = device(tmp_path / "null")
    atomic_write(null, lambda p: p.write_bytes(b"x" * 100_000))
    file = OutputFile(null)
    file.write("a line\n")
    file.commit()
    assert stat.S_ISCHR(null.stat().st_mode) and null.stat().st_rdev == os.makedev(1, 3)
    assert os.listdir(tmp_path) == ["null"]  # no temporary, nothing renamed


def test_a_fifo_is_written_into_and_stays_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = Reader(fifo)
    atomic_write(fifo, lambda p: p.write_bytes(b"weights" * 1000))
    assert reader.result() == b"weights" * 1000
    reader = Reader(fifo)
    file = OutputFile(fifo)
    file.write('{"a": 1}\n')
    file.commit()
    assert reader.result() == b'{"a": 1}\n'
    assert stat.S_ISFIFO(fifo.stat().st_mode) and os.listdir(tmp_path) == ["pipe"]


def test_a_descriptors_link_is_written_into_not_replaced(tmp_path: Path) -> None:
    """/dev/stdout and /dev/fd/N lead through /proc/self/fd: the file the descriptor is open on is written, and no
    link in /dev or /proc is replaced."""
    target = tmp_path / "redirected.txt"
    with open(target, "w") as f:
        inode = target.stat().st_ino
        atomic_write(Path(f"/dev/fd/{f.fileno()}"), lambda p: p.write_text("through the descriptor"))
        atomic_write(Path(f"/proc/self/fd/{f.fileno()}"), lambda p: p.write_text("again"))
    assert target.read_text() == "again" and target.stat().st_ino == inode and os.listdir(tmp_path) == ["redirected.txt"]
    assert through_descriptor(Path("/dev/stdout")) and Path("/dev/stdout").is_symlink()
    link = tmp_path / "link"
    link.symlink_to(target)
    assert not through_descriptor(link) and not through_descriptor(target)
    atomic_write(link, lambda p: p.write_text("new"))  # an ordinary link: replaced in its folder, its target untouched
    assert not link.is_symlink() and link.read_text() == "new" and target.read_text() == "again"


def test_a_directory_a_socket_or_a_block_device_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.sock"))
    sock.close()
    cases = [(tmp_path / "dir", "a directory"), (tmp_path / "s.sock", "a socket")]
    if os.geteuid() == 0:
        os.mknod(tmp_path / "disk", stat.S_IFBLK | 0o600, os.makedev(7, 200))  # a loop device's numbers, never opened
        cases.append((tmp_path / "disk", "a block device"))
    for path, kind in cases:
        with pytest.raises(OutputError) as e:
            atomic_write(path, lambda p: p.write_text("x"))
        assert str(e.value) == f"{path}: {kind}; expected a file to write (or a character device or FIFO to write into)"
        with pytest.raises(OutputError, match=kind):
            OutputFile(path)
    assert (tmp_path / "dir").is_dir() and stat.S_ISSOCK((tmp_path / "s.sock").stat().st_mode)


def test_a_full_disk_is_one_line_and_the_old_file_survives(tmp_path: Path) -> None:
    with small_disk(tmp_path) as disk:
        (disk / "a.bin").write_bytes(b"old")
        with pytest.raises(OutputError) as e:
            atomic_write(disk / "a.bin", lambda p: p.write_bytes(b"x" * 200_000))
        assert str(e.value) == f"no space left writing {disk / 'a.bin'}"
        from safetensors.torch import (
            save_file,  # its writer reports the OS error in its own exception type
        )

        with pytest.raises(OutputError, match=f"^no space left writing {disk / 'a.bin'}$"):
            atomic_write(disk / "a.bin", lambda p: save_file({"x": torch.zeros(50_000)}, p))
        file = OutputFile(disk / "a.bin")
        with pytest.raises(OutputError, match=f"^no space left writing {disk / 'a.bin'}$"):
            for _ in range(1000):
                file.write("y" * 1000)
            file.commit()
        file.discard()
        assert (disk / "a.bin").read_bytes() == b"old" and os.listdir(disk) == ["a.bin"]
    full = device(tmp_path / "full", minor=7)
    with pytest.raises(OutputError, match=f"^no space left writing {full}$"):
        atomic_write(full, lambda p: p.write_bytes(b"x"))


def test_a_read_only_folder_is_one_line(tmp_path: Path) -> None:
    with small_disk(tmp_path, "ro") as disk:
        with pytest.raises(OutputError, match=f"^cannot write {disk / 'a.bin'}: Read-only file system$"):
            atomic_write(disk / "a.bin", lambda p: p.write_bytes(b"x"))
        with pytest.raises(OutputError, match=f"^cannot write {disk / 'sub'}: Read-only file system$"):
            output_directory(disk / "sub")
