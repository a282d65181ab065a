"""The build at first use: the fallback where the module built at install is missing or cannot be used (a checkout
run without installing it, its kernel sources edited since, another torch). torch's cpp_extension compiles the
sources with ninja into torch's extension cache, under a lock that dies with the process that holds it.

Why a lock of our own: torch guards a build with a `lock` file (FileBaton) that only the builder removes, so a build
killed mid-way leaves it behind, and torch's `load` waits on it forever in every later process. Here each build takes
an flock on a file in the build directory first, which the kernel drops when its holder ends however it ends; whoever
holds it knows no other build runs there, so a torch `lock` file it finds was left by a killed build and goes, with
one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

LOCK = "gpt2-engine.lock"  # ours, beside torch's `lock` in the build directory


def build_directory(name: str) -> Path:
    """Where torch's cache keeps the build of `name` (TORCH_EXTENSIONS_DIR, torch's own variable, or its default)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


def cache_name(prefix: str, sources: Sequence[Path]) -> str:
    """`prefix` and a hash of where the sources are and of the torch and Python they are built for: torch's cache is
    per user, and two checkouts (or two environments) under one name would rebuild over each other's module at each
    switch, or load one built for another torch. So are two spellings of torch's directory (a venv's python through
    a link, and a console script's shebang through its real path: the build's include flags hold the spelling) and two
    ninjas on PATH (a venv's 1.13 and the system's 1.11 hash a command line differently, so each takes the other's
    objects for stale; keyed by version, not path): under one name, each switch between them rebuilt every kernel,
    minutes on 2 cores."""
    import torch

    where = "|".join([str(Path(sources[0]).resolve().parent), torch.__version__, str(Path(torch.__file__).parent),
                      ninja_version(), sys.version])
    return f"{prefix}_{hashlib.sha1(where.encode()).hexdigest()[:10]}"


def ninja_version() -> str:
    """The version of the ninja on PATH ("" if none), which torch's build runs."""
    ninja = shutil.which("ninja")
    if ninja is None:
        return ""
    try:
        return subprocess.run([ninja, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@contextlib.contextmanager
def builder_lock(directory: Path) -> Iterator[None]:
    """Hold the build directory for this process: wait (saying for whom) while a live process builds there, then
    clear a torch `lock` file that a killed build left behind."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "another process"
            print(f"gpt2-engine: waiting for {owner}, which is building the native kernels in {directory} ...",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)  # the kernel wakes us when the holder unlocks or ends
        f.truncate(0)
        f.write(f"process {os.getpid()} ({' '.join(sys.argv)[:100]})")
        f.flush()
        baton = directory / "lock"
        if baton.exists():
            baton.unlink()
            print(f"gpt2-engine: removed {baton}, left by a build of the native kernels that was killed",
                  file=sys.stderr, flush=True)
        yield  # closing the file at the end drops the flock


def build(prefix: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str], *,
          what: str) -> ModuleType:
    """The module built from `sources` in torch's extension cache, imported; where it is not there yet, one line says
    that `what` is being built."""
    from torch.utils.cpp_extension import load

    name = cache_name(prefix, sources)
    directory = build_directory(name)
    with builder_lock(directory):
        if not (directory / f"{name}.so").exists():
            print(f"gpt2-engine: building {what} ...", file=sys.stderr, flush=True)
        return load(name=name, sources=[str(s) for s in sources], extra_cflags=list(cflags),
                    extra_ldflags=list(ldflags), build_directory=str(directory), verbose=False)
