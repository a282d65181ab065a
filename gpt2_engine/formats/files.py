"""Files written whole or not at all, where a destination can be replaced, and written into where it cannot.

- A new path or a regular file: written beside it under a temporary name, flushed to disk and renamed over it, so
  that a reader (or a run killed midway) never sees half a file. The file gets the mode a plain open() would give it,
  0666 less the user's umask, not the 0600 of a temporary file. A symbolic link there is replaced by the file, so
  nothing outside the destination's folder is touched.
- A character device (/dev/null), a FIFO or pipe, or a file reached through a descriptor's link (/dev/stdout,
  /dev/fd/N, a shell's `>(...)`): written into, as `cp` writes, and never replaced (a rename would leave a regular
  file where /dev/null was, or drop what the shell redirects into).
- A directory, a socket or a block device: refused, in one line naming what is there. So is a FIFO, pipe or
  terminal for a writer that must seek (gguf-py's asks the file for its position), before anything is written.

A failed write leaves a replaced destination as it was and no temporary file, and is an OutputError naming the
destination ("no space left writing PATH" for a full disk).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from ..core.errors import GPT2EngineError, one_line


class OutputError(GPT2EngineError):
    """A destination that cannot be written: what is there, a full disk, a read-only or missing folder."""


KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


WRITTEN_INTO = ("a character device", "a FIFO")  # as cp writes them; a block device is a disk, never a model's file


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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


def what_is(path: Path) -> str | None:
    """What is at `path`, links followed ('a regular file', 'a character device', ...); None where nothing is."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return KINDS.get(stat.S_IFMT(mode), "a special file")


def through_descriptor(path: Path) -> bool:
    """Whether `path` reaches its file through a process's descriptor links (/dev/stdout -> /proc/self/fd/1,
    /dev/fd/N): writing there means writing into what the descriptor is open on."""
    for _ in range(40):  # the kernel's own limit on links followed
        parent = Path(os.path.realpath(path.parent)).parts
        if len(parent) == 4 and parent[1] == "proc" and parent[3] == "fd":
            return True
        if not path.is_symlink():
            return False
        path = path.parent / os.readlink(path)
    return False


def written_into(dest: Path) -> bool:
    """Whether `dest` is written into rather than replaced (see the module docstring); OutputError where it can be
    neither."""
    kind = what_is(dest)
    if kind in WRITTEN_INTO:
        return True
    if kind == "a regular file":
        return through_descriptor(dest)
    if kind is not None:
        raise OutputError(f"{dest}: {kind}; expected a file to write (or a character device or FIFO to write into)")
    return False


def seekable(dest: Path) -> bool:
    """Whether `dest`, written into, can report and change its position: a regular file or /dev/null can, a FIFO, a
    pipe or a terminal cannot."""
    kind = what_is(dest)
    if kind == "a FIFO":
        return False
    if kind != "a character device":
        return True
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return True  # the write itself reports what is wrong
    try:
        os.lseek(fd, 0, os.SEEK_CUR)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def check_seekable(dest: Path, why: str) -> None:
    """OutputError where `dest` is written into and cannot seek, which the writer needs (`why`)."""
    if written_into(dest) and not seekable(dest):
        raise OutputError(f"{dest}: {what_is(dest)} that cannot seek, and {why}; write to a file, then copy it")


def error_number(e: BaseException) -> int | None:
    """The OS error behind `e`: an OSError's errno, or the one safetensors' writer quotes ("... (os error 28)")
    or numpy's short write implies."""
    if isinstance(e, OSError):
        if e.errno is None and re.fullmatch(r"\d+ requested and \d+ written", str(e)):
            return errno.ENOSPC  # numpy's tofile (gguf-py's writer) reports a short write without the errno: a full disk
        return e.errno
    found = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return int(found.group(1)) if found else None


def output_error(dest: Path, e: BaseException) -> OutputError:
    """`e`, raised while writing `dest`, as one line naming it."""
    number = error_number(e)
    if number in NO_SPACE:
        return OutputError(f"no space left writing {dest}")
    reason = os.strerror(number) if number else one_line(e)
    return OutputError(f"cannot write {dest}: {reason}")


def about_output(e: BaseException, *paths: Path) -> bool:
    """Whether `e` is the OS refusing to write one of `paths` (not a bug, nor a source that could not be read)."""
    if error_number(e) is None:
        return False
    name = getattr(e, "filename", None)
    return name is None or str(name) in {str(p) for p in paths}


def output_directory(path: Path) -> Path:
    """`path` as a folder to write files into, made with its parents where missing; OutputError where something
    else is there or it cannot be made."""
    kind = what_is(path)
    if kind not in (None, "a directory"):
        raise OutputError(f"{path}: {kind}; expected a directory to write into")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise output_error(path, e) from None
    return path


def check_not_replacing(dest: Path, overwrite: bool, held: tuple[str, ...] = ()) -> None:
    """Refuse, unless `overwrite`, a write that would replace a model already at `dest`: an existing regular file,
    or, for a directory, the `held` files in it (a checkpoint's config and weights). `gpt2 finetune` refuses the
    same way; a device or FIFO is written into, never replaced, and is not refused here."""
    if overwrite:
        return
    if what_is(dest) == "a regular file":
        raise OutputError(f"{dest}: already exists; pass --overwrite to replace it")
    if dest.is_dir() and (there := sorted(name for name in held if (dest / name).exists())):
        raise OutputError(f"{dest}: already holds a model ({', '.join(there)}); pass --overwrite to replace it, or "
                          "write somewhere else")


def check_not_an_input(dest: Path, inputs: list[Path] | Mapping[Path, str], flag: str) -> None:
    """Refuse an output that is one of the files being read (by inode: through links and other spellings too), which
    writing would replace with its own results; a mapping's values say what each input is, for the message."""
    roles = inputs if isinstance(inputs, Mapping) else dict.fromkeys(inputs, "")
    try:
        if not dest.exists() or what_is(dest) != "a regular file":
            return
        same = next((p for p in roles if p.exists() and os.path.samefile(p, dest)), None)
    except OSError:
        return  # unreadable inputs are the readers' to name
    if same is not None:
        role = f" ({roles[same]})" if roles[same] else ""
        raise OutputError(f"{flag} {dest}: is {same}, one of the inputs{role}, which writing would replace; write the "
                          "results somewhere else")


def files_of(path: str | Path | None, role: str) -> dict[Path, str]:
    """The files a command reads from `path` (a checkpoint or adapter folder: each file in it; a file: itself), each
    with `role` for check_not_an_input's message; nothing where `path` is None or names nothing here ("demo")."""
    if path is None or not Path(path).exists():
        return {}
    p = Path(path)
    try:
        return {f: f"a file of {role}" for f in p.iterdir()} if p.is_dir() else {p: role}
    except OSError:
        return {}  # unreadable: the reader names it


def temporary(dest: Path) -> tuple[int, Path]:
    """An open descriptor and the path of a new file beside `dest`, with a plain file's mode; OSError as mkstemp's."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.chmod(fd, 0o666 & ~umask())
    return fd, Path(tmp)


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back until the block ends, then raised again. A file is created and its path taken by
    the code that removes it on a stop inside one such block: a stop that landed between the two would leave it
    behind. Python's handlers are swapped rather than the signals masked, since a mask is per thread and a process's
    signal goes to any thread that does not block it (torch's among them); only the main thread runs the handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = {s: signal.signal(s, lambda signum, _: caught.append(signum))
            for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


def beside(dest: Path, seeks: str) -> Path | None:
    """A new empty file beside `dest` for atomic_write, or None where `dest` is written into; OutputError."""
    try:
        if seeks:
            check_seekable(dest, seeks)
        if written_into(dest):
            return None
        fd, tmp = temporary(dest)
        os.close(fd)
        return tmp
    except OSError as e:
        raise output_error(dest, e) from None


def atomic_write(dest: Path, write: Callable[[Path], None], seeks: str = "") -> None:
    """`write(path)` fills a temporary file beside `dest`, which is then synced and renamed over `dest`; a device,
    FIFO or descriptor is written into instead (`write(dest)`), unless the writer seeks (`seeks` says why) and it
    cannot. OutputError where `dest` cannot be written."""
    tmp: Path | None = None
    try:
        with stops_held():
            tmp = beside(dest, seeks)
        target = dest if tmp is None else tmp
        try:
            write(target)
            if tmp is not None:
                os.chmod(tmp, 0o666 & ~umask())  # again: a writer may have replaced the file (safetensors: 0600)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, dest)
        except Exception as e:
            if about_output(e, target, dest):
                raise output_error(dest, e) from None
            raise
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


class OutputFile:
    """A file at `dest` written as atomic_write writes one, for a writer that writes as it goes: beside `dest` and
    renamed over it by commit(), or into a device, FIFO or descriptor. discard() leaves a replaced destination as
    it was. Every OS error is an OutputError naming `dest`. Open one inside stops_held() and the try that discards
    it, so that no stop lands between its file and that try."""

    def __init__(self, dest: Path, mode: str = "w") -> None:
        self.dest, self.tmp = dest, None
        encoding = None if "b" in mode else "utf-8"
        try:
            if written_into(dest):
                self.file: IO[Any] = open(dest, mode, encoding=encoding)  # noqa: SIM115 - open until commit()
            else:
                fd, self.tmp = temporary(dest)
                self.file = os.fdopen(fd, mode, encoding=encoding)
        except OSError as e:
            raise output_error(dest, e) from None

    def write(self, data: Any) -> None:
        try:
            self.file.write(data)
        except OSError as e:
            raise output_error(self.dest, e) from None

    def commit(self) -> None:
        """Flush what was written and, for a replaced destination, sync it and rename it over `dest`."""
        try:
            self.file.flush()
            if self.tmp is not None:
                os.fsync(self.file.fileno())
            self.file.close()
            if self.tmp is not None:
                os.replace(self.tmp, self.dest)
        except OSError as e:
            self.discard()
            raise output_error(self.dest, e) from None

    def discard(self) -> None:
        """Close without committing; a temporary file is removed."""
        try:
            self.file.close()
        except OSError:
            pass  # what could not be flushed is what is being thrown away
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
