"""The native kernels' build: after an install the module compiled at install is the one used and no command compiles
anything; the build at first use (the fallback) never hangs on the lock file a killed build leaves behind, and waits,
saying for whom, while a live process builds. The fallback's tests build a one-function module (a second or two)
through the same code as the kernels' (kernels/jit.py), not the kernels themselves (minutes)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from gpt2_engine.core.kernels import HERE, jit
from gpt2_engine.core.kernels.sources import MODULE

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds for a one-function build; a build that hangs on a lock fails here instead of never ending
# ninja is a dependency of the package: the venv's, where the venv is not on PATH
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

TINY = r"""
// One function, built by torch's cpp_extension as the kernels are, under the name it is given
#include <Python.h>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(x) #x
#define STR(x) STR2(x)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""
# the fallback's build, as decode_kernels() calls it, of the source named on the command line
BUILD = ("import sys; from pathlib import Path; from gpt2_engine.core.kernels import jit; "
         "print(jit.build('tiny', [Path(sys.argv[1])], [], [], what='tiny.cpp').answer())")


def installed_from() -> Path | None:
    """The checkout gpt2-engine is installed from in editable mode (pip's direct_url.json), or None."""
    for dist in importlib.metadata.distributions(name="gpt2-engine"):  # the checkout's own egg-info has no url
        info = json.loads(dist.read_text("direct_url.json") or "{}")
        url = urlparse(info.get("url", ""))
        if url.scheme == "file" and info.get("dir_info", {}).get("editable", False):
            return Path(unquote(url.path)).resolve()
    return None


def test_the_kernels_built_at_install_are_used_and_nothing_compiles(tmp_path: Path) -> None:
    """After `make install` (pip install --no-build-isolation -e .) the module sits in the package and a command's
    first call of decode_kernels() imports it: no line on stderr, nothing in torch's extension cache."""
    if installed_from() != ROOT:
        pytest.skip(f"gpt2-engine is installed from {installed_from()}, not from this checkout ({ROOT}): here the "
                    "kernels are built at first use")
    code = ("from gpt2_engine.core.kernels import decode_kernels; m = decode_kernels(); "
            "print(m.__name__ if m else None, getattr(m, '__file__', None))")
    cache = tmp_path / "torch_extensions"
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, "PATH": PATH, "TORCH_EXTENSIONS_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr
    name, file = proc.stdout.split()
    assert (name, Path(file).parent) == (MODULE, HERE), proc.stderr
    assert proc.stderr == ""
    assert not cache.exists()


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The one-function source in a fresh TORCH_EXTENSIONS_DIR (inherited by the builds the tests start), and the
    build directory the fallback uses for it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    monkeypatch.setenv("PATH", PATH)
    assert shutil.which("ninja"), "ninja, a dependency of the package, is not installed"
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    return source, jit.build_directory(jit.cache_name("tiny", [source]))


def build_lines(directory: Path, stale: bool) -> list[str]:
    """What the fallback says when it builds into `directory`: the stale lock it cleared, then that it builds."""
    removed = f"gpt2-engine: removed {directory / 'lock'}, left by a build of the native kernels that was killed"
    return [removed] * stale + ["gpt2-engine: building tiny.cpp ..."]


def test_a_lock_left_by_a_killed_build_is_cleared_with_one_line(tiny: tuple[Path, Path]) -> None:
    source, directory = tiny
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # torch's FileBaton as a killed build leaves it: no process behind it
    # before the fix this process waited on the file forever; the timeout turns that into a failure
    proc = subprocess.run([sys.executable, "-c", BUILD, str(source)], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "42\n"
    assert proc.stderr.splitlines() == build_lines(directory, stale=True)
    assert not (directory / "lock").exists()


def read_line(stream, timeout: float) -> str:
    """The next line of a child's unbuffered pipe, or a failure once `timeout` seconds pass without one."""
    line = b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no full line within {timeout} s (got {line!r})"
        byte = stream.read(1)
        assert byte, f"the stream ended (got {line!r})"
        line += byte
    return line.decode().rstrip("\n")


def test_a_build_killed_mid_way_leaves_nothing_that_blocks_the_next(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """A builder is killed (SIGKILL, with its ninja) while it compiles; a second build, started meanwhile, says that
    it waits for that process, and then clears the lock the killed one left and builds."""
    source, directory = tiny
    started = tmp_path / "ninja-started"
    stuck = tmp_path / "stuck" / "ninja"  # a ninja that starts the build and never ends it
    stuck.parent.mkdir()
    stuck.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {shutil.which("ninja")} --version\n'
                     f"touch {started}\nexec sleep {TIMEOUT * 5}\n")
    stuck.chmod(0o755)
    builder = subprocess.Popen([sys.executable, "-c", BUILD, str(source)], cwd=ROOT, start_new_session=True,
                               env={**os.environ, "PATH": f"{stuck.parent}{os.pathsep}{PATH}"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    waiter = None
    try:
        deadline = time.monotonic() + TIMEOUT
        while not started.exists():  # the builder holds both locks once its ninja runs
            assert builder.poll() is None, "the first build ended before its ninja started"
            assert time.monotonic() < deadline, "the first build's ninja did not start"
            time.sleep(0.05)
        assert (directory / "lock").exists()  # torch's FileBaton, taken for the build in progress
        waiter = subprocess.Popen([sys.executable, "-c", BUILD, str(source)], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, bufsize=0)
        waiting = read_line(waiter.stderr, TIMEOUT)
        assert waiting.startswith(f"gpt2-engine: waiting for process {builder.pid} ("), waiting
        assert waiting.endswith(f", which is building the native kernels in {directory} ..."), waiting
        assert waiter.poll() is None
        os.killpg(builder.pid, signal.SIGKILL)  # the builder, its ninja and the ninja's sleep
        builder.wait(timeout=TIMEOUT)
        out, err = waiter.communicate(timeout=TIMEOUT)
    finally:
        if builder.poll() is None:
            os.killpg(builder.pid, signal.SIGKILL)
            builder.wait()
        if waiter is not None and waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert waiter.returncode == 0, err
    assert out == b"42\n"
    assert err.decode().splitlines() == build_lines(directory, stale=True)
    assert not (directory / "lock").exists()


def test_two_paths_to_torch_or_two_ninjas_build_under_two_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """A venv's python through a link and a console script's shebang (its real path) give torch's include flags two
    spellings, and a venv's ninja and the system's hash command lines differently: under one name each switch rebuilt
    every kernel (minutes), under two each builds once."""
    import torch

    source = [HERE / "decode.cpp"]
    here = jit.cache_name("k", source)
    assert jit.cache_name("k", source) == here
    with monkeypatch.context() as m:
        m.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
        assert jit.cache_name("k", source) != here
    assert jit.cache_name("k", source) == here
    monkeypatch.setattr(jit, "ninja_version", lambda: "1.0.0")  # another ninja on PATH
    assert jit.cache_name("k", source) != here
