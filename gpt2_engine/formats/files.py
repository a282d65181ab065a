"""Files written whole or not at all: each is written beside its destination under a temporary name, flushed to disk,
and renamed over it, so that a reader (or a run killed midway) never sees half a file. The file gets the mode a
plain open() would give it, 0666 less the user's umask, not the 0600 of a temporary file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def umask() -> int:
    """This process's umask, read without changing it (Linux's /proc; elsewhere set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temporary(dest: Path) -> tuple[int, Path]:
    """An open descriptor and the path of a new file beside `dest`, with a plain file's mode; OSError as mkstemp's."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.chmod(fd, 0o666 & ~umask())
    return fd, Path(tmp)


def atomic_write(dest: Path, write: Callable[[Path], None]) -> None:
    """`write(path)` fills a temporary file beside `dest`, which is then synced and renamed over `dest`."""
    fd, tmp = temporary(dest)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())  # again: a writer may have replaced the file (safetensors makes it 0600)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
