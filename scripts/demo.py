#!/usr/bin/env python3
"""The demo model: a small GPT-2 trained from scratch by `gpt2 finetune --init`, for machines without the weights.

    python scripts/demo.py                    # prints the demo model's directory, training it first if needed
    python scripts/demo.py --weights DIR      # prints DIR if it holds weights or they download into it; otherwise
                                              # says so in one line and prints the demo model's directory

`make generate` runs the second form, `make demo` the first. The demo model has 4 layers, 4 heads and 256 channels
(GPT-2's full vocabulary) and is trained for a few minutes on the docstrings of Python's standard library (the
text is on every machine, offline). It writes docstring-like English, not GPT-2's text. It is built once into the
git-ignored .cache/demo/ of this checkout (the directory name carries a hash of this script; an interrupted build
resumes), and .cache/demo/latest points to it: every `gpt2` command then finds it, from any working directory, as
`--weights demo` or as the default when weights/ holds no checkpoint (formats/hf.py's demo_caches says where it looks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).absolute().parent
ROOT = SCRIPTS.parent  # the checkout, as the package finds it (formats/hf.py's demo_caches)
sys.path.insert(0, str(ROOT))  # the package, also where it is not installed

from gpt2_engine.formats.files import atomic_write  # noqa: E402 - after the path above
from gpt2_engine.formats.hf import DEMO_CACHE, DEMO_LATEST, DEMO_NAME  # noqa: E402

CONFIG = {"n_layer": 4, "n_head": 4, "n_embd": 256, "n_positions": 256, "vocab_size": 50257, "model_type": "gpt2"}
TRAIN = ["--steps", "300", "--context", "128", "--batch-size", "8", "--lr", "2e-3", "--warmup", "20",
         "--weight-decay", "0.01", "--eval-every", "100", "--sample-every", "100", "--sample-prompt", "Return the",
         "--val-fraction", "0.02", "--seed", "0"]


def has_weights(directory: Path) -> bool:
    return (directory / "model.safetensors").is_file() or (directory / "pytorch_model.bin").is_file()


def demo_key() -> str:
    """The build's name: a hash of this script, so that a changed recipe builds a new model."""
    return hashlib.sha256((SCRIPTS / "demo.py").read_bytes()).hexdigest()[:12]


def point_latest(dest: Path) -> None:
    """Point .cache/demo/latest at `dest`, atomically (a new link renamed over the old one)."""
    latest = dest.parent / DEMO_LATEST
    if latest.is_symlink() and os.readlink(latest) == dest.name:
        return
    tmp = latest.with_name(f".{latest.name}-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(dest.name, target_is_directory=True)
    os.replace(tmp, latest)


def ensure_demo() -> Path:
    """The demo model's directory, trained first (with gpt2 finetune's progress bar on stderr) if it is not built."""
    key = demo_key()
    cache = ROOT / DEMO_CACHE  # where formats/hf.py's demo_caches looks first
    dest = cache / f"model-{key}"
    if has_weights(dest):
        point_latest(dest)
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f"partial-{key}"
    sys.path.insert(0, str(SCRIPTS))
    from train_fixture import docstrings

    data = cache / f"docstrings-{key}.jsonl"
    if not data.is_file():
        def write(path: Path) -> None:
            with open(path, "w", encoding="utf-8") as f:
                for doc in docstrings():
                    f.write(json.dumps({"text": doc}) + "\n")

        atomic_write(data, write)
    config = cache / f"config-{key}.json"
    config.write_text(json.dumps(CONFIG) + "\n")
    resume = ["--resume"] if (partial / "last" / "trainer_state.json").is_file() else ["--overwrite"]
    print(f"demo: training the demo model once into {dest} (a few minutes; resumable) ...", file=sys.stderr, flush=True)
    gpt2 = [sys.executable, "-m", "gpt2_engine", "finetune", str(data), "--init", str(config), "--out", str(partial)]
    subprocess.run(gpt2 + TRAIN + resume, check=True, stdout=sys.stderr, cwd=ROOT)
    os.replace(partial, dest)
    point_latest(dest)
    print(f"demo: the demo model is ready in {cache / DEMO_LATEST} (-> {dest.name}); every gpt2 command finds it "
          f"as --weights {DEMO_NAME}, and by default while weights/ holds no checkpoint", file=sys.stderr)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=Path, help="use these official weights if present or downloadable")
    args = parser.parse_args()
    if args.weights is not None:
        if has_weights(args.weights):
            print(args.weights)
            return 0
        from gpt2_engine.core.errors import GPT2EngineError
        from gpt2_engine.download import download

        try:
            download(dest=args.weights, log=lambda *a, **k: None)
            print(args.weights)
            return 0
        except GPT2EngineError as e:
            print(f"demo: the official weights could not be downloaded ({e}); using the demo model instead "
                  "(make demo; docs/training.md: the demo model)", file=sys.stderr)
    try:
        print(ensure_demo())
    except subprocess.CalledProcessError as e:
        print(f"demo: training the demo model failed (exit {e.returncode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
