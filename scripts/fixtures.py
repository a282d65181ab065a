#!/usr/bin/env python3
"""Test and benchmark checkpoints, written once into the git-ignored `.cache/fixtures/` and reused.

    python scripts/fixtures.py small|trained|induction|saes ...   # prints each checkpoint's directory, building it if needed

Each checkpoint's directory name carries a hash of the scripts that write it, so a changed recipe is rebuilt and an
unchanged one is reused across test runs and `make bench`. A build goes to a temporary directory that is renamed
into place when complete: an interrupted build leaves nothing that looks finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
CACHE = SCRIPTS.parent / ".cache" / "fixtures"
# name -> (the script that writes it, its arguments, the scripts whose text decides the weights)
RECIPES: dict[str, tuple[str, list[str], list[str]]] = {
    "small": ("make_fixture.py", [], ["make_fixture.py"]),  # random weights, full GPT-2-small shape
    "trained": ("train_fixture.py", [], ["train_fixture.py", "make_fixture.py"]),  # 4 layers trained on docstrings
    "induction": ("train_induction.py", [], ["train_induction.py", "make_fixture.py"]),  # 2 layers that copy a repeated run
    # SAEs of every architecture, made by sae-lens on the trained checkpoint (the SAE tests' reference)
    "saes": ("sae_reference.py", [], ["sae_reference.py", "train_fixture.py", "make_fixture.py"]),
}


def ensure(name: str) -> Path:
    """The directory of checkpoint `name`, built first if it is not in the cache yet."""
    script, args, inputs = RECIPES[name]
    key = hashlib.sha256(b"".join((SCRIPTS / f).read_bytes() for f in inputs) + " ".join(args).encode()).hexdigest()[:12]
    dest = CACHE / f"{name}-{key}"
    if dest.is_dir():  # a build is renamed into place whole, so a directory there is a finished one
        return dest
    CACHE.mkdir(parents=True, exist_ok=True)
    # one build at a time (pytest-xdist's workers may ask at once): the others wait, then find it built
    with open(CACHE / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.is_dir():
            return dest
        for stale in CACHE.glob(f"{name}-*"):  # older recipes of the same checkpoint
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))
        try:
            print(f"fixtures: building the {name!r} checkpoint into {dest} (once) ...", file=sys.stderr, flush=True)
            build(name, [sys.executable, str(SCRIPTS / script), str(tmp / "out"), *args])
            os.replace(tmp / "out", dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build(name: str, command: list[str], heartbeat: float = 30.0) -> None:
    """Run a fixture script, relaying its output (progress lines) to stderr with the elapsed time, and saying every
    `heartbeat` seconds that it is still at work when it prints nothing; a failure raises CalledProcessError."""
    start = time.monotonic()
    last = [start]
    done = threading.Event()

    def say(line: str) -> None:
        last[0] = time.monotonic()
        print(f"fixtures: [{name} {time.monotonic() - start:5.0f} s] {line}", file=sys.stderr, flush=True)

    def beat() -> None:
        while not done.wait(heartbeat / 3):
            if time.monotonic() - last[0] >= heartbeat:
                say("still building ...")

    ticker = threading.Thread(target=beat, daemon=True)
    ticker.start()
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
            for line in child.stdout:
                if line.strip():
                    say(line.rstrip())
        if child.returncode:
            raise subprocess.CalledProcessError(child.returncode, command)
    finally:
        done.set()
        ticker.join()
    say("done")


if __name__ == "__main__":
    if len(sys.argv) < 2 or any(name not in RECIPES for name in sys.argv[1:]):
        print(f"usage: fixtures.py {'|'.join(RECIPES)} ... (got {' '.join(sys.argv[1:]) or 'nothing'})", file=sys.stderr)
        sys.exit(2)
    for name in sys.argv[1:]:
        try:
            print(ensure(name))
        except subprocess.CalledProcessError as e:
            sys.exit(f"fixtures: building {name!r} failed (exit {e.returncode}); its output is above")
