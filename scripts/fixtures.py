#!/usr/bin/env python3
"""Test and benchmark checkpoints, written once into the git-ignored `.cache/fixtures/` and reused.

    python scripts/fixtures.py small|trained|induction    # prints the checkpoint's directory, building it if needed

Each checkpoint's directory name carries a hash of the scripts that write it, so a changed recipe is rebuilt and an
unchanged one is reused across test runs and `make bench`. A build goes to a temporary directory that is renamed
into place when complete: an interrupted build leaves nothing that looks finished.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
CACHE = SCRIPTS.parent / ".cache" / "fixtures"
# name -> (the script that writes it, its arguments, the scripts whose text decides the weights)
RECIPES: dict[str, tuple[str, list[str], list[str]]] = {
    "small": ("make_fixture.py", [], ["make_fixture.py"]),  # random weights, full GPT-2-small shape
    "trained": ("train_fixture.py", [], ["train_fixture.py", "make_fixture.py"]),  # 4 layers trained on docstrings
    "induction": ("train_induction.py", [], ["train_induction.py", "make_fixture.py"]),  # 2 layers that copy a repeated run
}


def ensure(name: str) -> Path:
    """The directory of checkpoint `name`, built first if it is not in the cache yet."""
    script, args, inputs = RECIPES[name]
    key = hashlib.sha256(b"".join((SCRIPTS / f).read_bytes() for f in inputs) + " ".join(args).encode()).hexdigest()[:12]
    dest = CACHE / f"{name}-{key}"
    if (dest / "config.json").is_file():
        return dest
    CACHE.mkdir(parents=True, exist_ok=True)
    for stale in CACHE.glob(f"{name}-*"):  # older recipes of the same checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))
    try:
        print(f"building the {name!r} checkpoint into {dest} (once) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, str(SCRIPTS / script), str(tmp / "out"), *args], check=True,
                       stdout=subprocess.DEVNULL)
        os.replace(tmp / "out", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in RECIPES:
        sys.exit(f"usage: fixtures.py {'|'.join(RECIPES)}")
    print(ensure(sys.argv[1]))
