"""`gpt2 score --ray`: documents through Ray Data, scored by actors that each load the model once.

Reading: each input file is read by a Ray Data task with the local command's reader (the same documents, names and
errors); every input is read and checked before any model loads. Scoring: `map_batches` with `Scorer`, a callable
class, on `--workers` actors; each batch of documents goes through runtime/scoring.py exactly as `gpt2 score` runs it,
so every document's windows, and its NLL, are the local command's. Rows come back in input order.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import GPT2EngineError
from ..documents import InputError, read_documents
from ..options import ModelOptions, load_model
from ..runtime.scoring import Score, ScoreSettings

DOCUMENTS_PER_BATCH = 16


def read_file(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Ray Data flat_map: one input file -> its documents, or one row holding the reader's error message."""
    try:
        docs = read_documents([row["path"]], sys.stdin.buffer)
    except InputError as e:
        return [{"file": row["file"], "line": 0, "name": row["path"], "text": "", "error": str(e)}]
    return [{"file": row["file"], "line": n, "name": name, "text": text, "error": ""} for n, (name, text) in enumerate(docs)]


class Scorer:
    """Ray Data map_batches callable: loads the model once per actor, then scores batches of documents."""

    def __init__(self, options: ModelOptions, settings: ScoreSettings) -> None:
        self.model = load_model(options)
        self.settings = settings

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        docs = list(zip(batch["name"].tolist(), batch["text"].tolist()))
        scores = list(self.model.score_documents(docs, self.settings))
        return {"file": batch["file"], "line": batch["line"], "name": batch["name"],
                "tokens": np.array([s.tokens for s in scores]), "bytes": np.array([s.bytes for s in scores]),
                "nll": np.array([s.nll for s in scores], dtype=np.float64)}


def score_on_ray(args: argparse.Namespace, paths: list[str], stdin_docs: list[tuple[str, str]],
                 settings: ScoreSettings) -> Iterator[Score]:
    """Scores of every document of `paths` (stdin, '-', read by the caller into `stdin_docs`), in input order."""
    ray = start_ray(args)
    docs = read_on_ray(ray, paths, stdin_docs)
    threads = args.threads or 1
    workers = args.workers or max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
    options = dataclasses.replace(ModelOptions.from_args(args), threads=threads)
    scored = docs.map_batches(Scorer, fn_constructor_args=(options, settings), batch_size=DOCUMENTS_PER_BATCH,
                              num_cpus=threads,
                              # one batch at a time per actor: the first actor up would otherwise queue them all
                              compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=1))
    for row in scored.iter_rows():
        yield Score(str(row["name"]), int(row["tokens"]), int(row["bytes"]), float(row["nll"]))


def start_ray(args: argparse.Namespace) -> Any:
    """The ray module, joined to --address (or started here), with Ray Data keeping input order and its progress
    bars only where stderr is a terminal."""
    try:
        import ray
    except ImportError:
        raise GPT2EngineError("--ray needs Ray: pip install 'gpt2-engine[distributed]' (ray[serve,data])") from None
    ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             ignore_reinit_error=True)
    # Ray Data's own setting (read at every execution): its INFO lines to its log file, not to our stderr
    os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", str(Path(__file__).with_name("ray_data_logging.yaml")))
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # results in input order
    context.enable_progress_bars = not args.quiet and sys.stderr.isatty()
    return ray


def read_on_ray(ray: Any, paths: list[str], stdin_docs: list[tuple[str, str]]) -> Any:
    """Every document as a Ray dataset of (file, line, name, text) rows in input order, each file read by a task and
    every one checked (the first reader's error raised) before any model loads; one block per batch of documents."""
    rows = [{"file": i, "path": p} for i, p in enumerate(paths) if p != "-"]
    docs = ray.data.from_items(rows).flat_map(read_file).materialize() if rows else None  # read and checked first
    if docs is not None and (errors := [r["error"] for r in docs.select_columns(["error"]).take_all() if r["error"]]):
        raise InputError(errors[0])
    if stdin_docs:  # stdin is the driver's: its documents join the dataset with their place in the input
        typed = ray.data.from_items([{"file": paths.index("-"), "line": n, "name": name, "text": text, "error": ""}
                                     for n, (name, text) in enumerate(stdin_docs)])
        docs = typed if docs is None else docs.union(typed).sort(["file", "line"])
    if docs is None or docs.count() == 0:
        raise InputError("nothing to score: the input holds no documents")
    # one block per batch of documents, made now: a .jsonl file is read into one block, which one actor would score
    # alone; and left lazy, the repartition's tasks would wait forever for the CPUs the scoring actors hold
    return docs.repartition(max(1, math.ceil(docs.count() / DOCUMENTS_PER_BATCH))).materialize()
