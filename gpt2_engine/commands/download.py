"""`gpt2 download`: fetch a checkpoint from the Hugging Face Hub and verify every file (download.py does the work)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..formats.hf import DEFAULT_WEIGHTS
from ..download import OFFICIAL_REPO, SHORTHANDS, WEIGHT_FILES, check_loads, download


def add_download(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("download", help="download and verify the official weights",
                       description="Download a GPT-2 checkpoint with huggingface_hub into DEST and verify every file's "
                                   "hash. Honours HF_ENDPOINT, HF_HUB_OFFLINE and HF_TOKEN. Re-running is safe: files "
                                   "already in place are verified, not downloaded again.")
    add_download_arguments(p)
    p.set_defaults(run=run_download)


def add_download_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", default=OFFICIAL_REPO,
                   help=f"repository id or one of {', '.join(SHORTHANDS)} (default {OFFICIAL_REPO})")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    p.add_argument("--dest", type=Path, default=DEFAULT_WEIGHTS, help=f"destination directory (default {DEFAULT_WEIGHTS}/)")
    p.add_argument("--format", dest="fmt", choices=sorted(WEIGHT_FILES),
                   help="weights format (default safetensors, or bin when the repo has no safetensors)")


def run_download(args: argparse.Namespace) -> int:
    download(args.repo, revision=args.revision, dest=args.dest, fmt=args.fmt)
    summary = check_loads(args.dest)
    print(f"{args.dest}/ holds {summary}")
    print(f"next: gpt2 generate \"Hello, my dog is\" --weights {args.dest}")
    return 0
