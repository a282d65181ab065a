"""`gpt2 eval`: EleutherAI's lm-evaluation-harness (`lm_eval.simple_evaluate`) with the engine as its model
(harness.py). Tasks are lm-eval's names or YAML files; lm-eval is the optional `[eval]` extra."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..core.errors import one_line
from ..formats.files import atomic_write, check_not_an_input, what_is, written_into
from ..options import (ModelOptions, UsageError, add_model_options, add_steer_option, load_model, parse_steer_args,
                       positive_int, seed_value, steering_from_args)
from ..runtime.prefix import DEFAULT_CAPACITY_MB

HUB_HINT = "tasks whose data lm-eval downloads need the Hugging Face Hub; a task on a local file needs none (docs/evaluation.md)"


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="evaluate with EleutherAI's lm-evaluation-harness",
        description="Run lm-eval's own evaluator (lm_eval.simple_evaluate) with this engine as the model: the same "
                    "requests and metrics as `lm_eval --model hf`, with contexts shared across their continuations "
                    "and few-shot preambles through the prefix cache. Needs: pip install 'gpt2-engine[eval]'.",
        epilog="examples:\n  gpt2 eval --tasks lambada_openai --weights weights/\n"
               "  gpt2 eval --tasks my_task.yaml --trust-task-code --num-fewshot 5 --limit 100 --output results.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", required=True, metavar="NAME|YAML",
                   help="lm-eval task or group names, or task YAML files (comma-separated lists work too)")
    p.add_argument("--include-path", type=Path, metavar="DIR", help="a directory of more task YAML files")
    p.add_argument("--trust-task-code", action="store_true",
                   help="run task YAML files (given, or in --include-path): lm-eval runs their templates, metrics and "
                        "!function imports as code; off, only lm-eval's own tasks run")
    p.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--limit", type=float, metavar="N",
                   help="documents per task: a count, or a fraction below 1 (for quick checks, not reportable figures)")
    p.add_argument("--output", type=Path, metavar="FILE.json", help="write lm-eval's results (and samples) as JSON")
    p.add_argument("--log-samples", action="store_true", help="with --output: each document's requests and answers")
    p.add_argument("--seed", type=seed_value, default=1234, help="lm-eval's seeds and the engine's sampling seed (default 1234)")
    p.add_argument("--prefix-cache-mb", type=float, metavar="MB",
                   help=f"memory for cached prompt blocks (default {DEFAULT_CAPACITY_MB})")
    p.add_argument("--no-prefix-cache", action="store_true", help="run every prompt from its first token")
    p.add_argument("--slots", type=positive_int, default=8, metavar="N",
                   help="sequences generated together for generate_until tasks (default 8)")
    add_model_options(p)
    add_steer_option(p)
    p.set_defaults(run=run_eval)


def check_flags(args: argparse.Namespace) -> list[str]:
    """The task names and files (comma-separated lists split), with every flag checked before lm-eval imports."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UsageError("gpt2 eval needs lm-eval, which is not installed: pip install 'gpt2-engine[eval]'")
    for bad, message in (
            (args.prefix_cache_mb is not None and not 0 < args.prefix_cache_mb < math.inf,  # NaN too
             f"--prefix-cache-mb must be a positive, finite number of MB, got {args.prefix_cache_mb}"),
            (args.num_fewshot is not None and args.num_fewshot < 0,
             f"--num-fewshot must be at least 0, got {args.num_fewshot}"),
            (args.limit is not None and args.limit <= 0,
             f"--limit must be a positive count or fraction, got {args.limit}"),
            (args.include_path is not None and not args.include_path.is_dir(),
             f"--include-path {args.include_path}: not a directory"),
            (args.log_samples and args.output is None,
             "--log-samples writes the samples into --output FILE: give --output too")):
        if bad:
            raise UsageError(message)
    tasks = [t for spec in args.tasks for t in spec.split(",") if t]
    if args.output is not None:
        written_into(args.output)  # a directory or socket is refused before the run, not after it
        weights = Path(args.weights)
        read = [*(weights.iterdir() if weights.is_dir() else [weights]), *(Path(t) for t in tasks)]
        check_not_an_input(args.output, read, "--output")
    return tasks


TASK_CODE = ("is code to lm-eval (it renders the file's Jinja templates unsandboxed, loads metrics by path and imports "
             "!function modules)")


def check_task_code(args: argparse.Namespace, tasks: list[str]) -> None:
    """Refuse, unless --trust-task-code, a task given as a file or folder and --include-path: lm-eval runs what a task
    file says in several ways (above), so a file from elsewhere is code, and only lm-eval's own tasks run without
    the flag."""
    if args.trust_task_code:
        return
    if args.include_path is not None:
        raise UsageError(f"--include-path {args.include_path}: a task file {TASK_CODE}; pass --trust-task-code if you "
                         "trust the files there")
    for task in tasks:
        if Path(task).expanduser().exists() or task.endswith((".yaml", ".yml")):  # lm-eval reads an existing path as YAML
            raise UsageError(f"--tasks {task}: a task file {TASK_CODE}; pass --trust-task-code if you trust it")


def kind_of(path: Path, name: str) -> str | None:
    """what_is(path); a path that cannot be looked at (a symlink loop) is a UsageError naming `name`."""
    try:
        return what_is(path)
    except OSError as e:
        reason = "a symlink loop" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror or one_line(e)})"
        raise UsageError(f"{name}: {reason}") from None


def check_task_paths(tasks: list[str]) -> None:
    """Refuse a task named by a YAML path where nothing is, and a path to something other than a file or folder (a
    FIFO, which lm-eval's open would wait on forever)."""
    for task in tasks:
        kind = kind_of(Path(task).expanduser(), f"--tasks {task}")
        if kind not in (None, "a regular file", "a directory"):
            raise UsageError(f"--tasks {task}: {kind}, not a task YAML file")
        if kind is None and task.endswith((".yaml", ".yml")):
            raise UsageError(f"--tasks {task}: no such task file")


def evaluate(args: argparse.Namespace, lm: Any, tasks: list[str]) -> dict[str, Any]:
    """lm-eval's simple_evaluate on the tasks, every seed --seed; an unknown task or data that cannot be loaded is
    a UsageError."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(args.include_path) if args.include_path else None)
    limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
    try:
        return simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit, task_manager=manager,
                               log_samples=args.log_samples, random_seed=args.seed, numpy_random_seed=args.seed,
                               torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    except KeyError as e:  # lm-eval's "not a registered task/group/tag name or valid YAML path"
        said = " ".join(str(e).strip(chr(39) + chr(34)).split())
        if not e.args or e.args[0] is None or len(said) < 8:  # a registry lookup of a name the YAML left unset
            said = (f"lm-eval could not build the task (it looked up {said or 'nothing'} in a registry: a metric, "
                    f"filter or output_type the task's YAML names that lm-eval does not know?)")
        raise UsageError(f"--tasks: {one_line(said, 300)}") from None
    except (OSError, ConnectionError) as e:
        raise UsageError(f"a task's data could not be loaded: {one_line(e, 300)} ({HUB_HINT})") from None


def run_eval(args: argparse.Namespace) -> int:
    tasks = check_flags(args)
    steer = parse_steer_args(args.steer)
    check_task_paths(tasks)
    check_task_code(args, tasks)

    from lm_eval.utils import make_table

    from ..harness import EngineLM

    model = load_model(ModelOptions.from_args(args))
    mb = None if args.no_prefix_cache else args.prefix_cache_mb or DEFAULT_CAPACITY_MB
    lm = EngineLM(model, prefix_cache_mb=mb, slots=args.slots, seed=args.seed,
                  steering=steering_from_args(steer, model.config))
    results = evaluate(args, lm, tasks)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if args.output is not None:
        write_json(args.output, results)
        print(f"gpt2 eval: results written to {args.output}", file=sys.stderr)
    return 0


def write_json(path: Path, results: dict[str, Any]) -> None:
    """lm-eval's results as JSON, written beside `path` and renamed over it (nothing half-written on failure)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(results, indent=2, default=str), encoding="utf-8"))
