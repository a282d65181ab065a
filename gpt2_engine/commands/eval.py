"""`gpt2 eval`: EleutherAI's lm-evaluation-harness (`lm_eval.simple_evaluate`) with the engine as its model
(harness.py). Tasks are lm-eval's names or YAML files; lm-eval is the optional `[eval]` extra."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..core.config import read_bytes
from ..core.errors import one_line
from ..formats.files import atomic_write, written_into
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
               "  gpt2 eval --tasks my_task.yaml --num-fewshot 5 --limit 100 --output results.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", required=True, metavar="NAME|YAML",
                   help="lm-eval task or group names, or task YAML files (comma-separated lists work too)")
    p.add_argument("--include-path", type=Path, metavar="DIR", help="a directory of more task YAML files")
    p.add_argument("--trust-task-code", action="store_true",
                   help="allow task YAML files that import Python (lm-eval's !function tag); off: such a file is refused")
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
    if args.output is not None:
        written_into(args.output)  # a directory or socket is refused before the run, not after it
    return [t for spec in args.tasks for t in spec.split(",") if t]


# A task YAML is a few KB; lm-eval's own task folder holds ~14,000 of them. The check reads no more than this.
TASK_BYTES = 4 << 20
TASK_FILES = 20_000  # files checked in all: those given, those in --include-path and those they include
INCLUDE_DEPTH = 32  # lm-eval's includes, one inside another (its own tasks nest two or three deep)


class ForeignTag(Exception):
    """A YAML tag outside YAML's standard types, met where a task file is checked: (tag, line)."""


def task_loader() -> type:
    """The YAML loader lm-eval parses task files with (libyaml's where PyYAML has it, as lm_eval/tasks/_yaml_loader.py
    picks), constructing YAML's standard types only: any other tag, as the parser resolves it (`!function` spelled
    through a %TAG handle, a verbatim or URI-escaped tag, in UTF-16...), raises ForeignTag instead of running."""
    import yaml

    class TaskLoader(yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader):  # type: ignore[misc]
        pass

    def foreign(loader: Any, suffix: str, node: Any) -> None:
        raise ForeignTag(node.tag, node.start_mark.line + 1)

    TaskLoader.add_multi_constructor("", foreign)  # every tag the safe constructor has no constructor of its own for
    return TaskLoader


def check_task_code(args: argparse.Namespace, tasks: list[str]) -> None:
    """Refuse, unless --trust-task-code, a task YAML that names Python to import (lm-eval's `!function module.name`
    tag runs the module beside the file): those given, those in --include-path, and every file they include, parsed
    as lm-eval parses them, so that files from elsewhere run no code here."""
    if args.trust_task_code:
        return
    import itertools

    # lm-eval reads a task that names a file as a YAML, whatever its suffix
    files = [Path(t).expanduser() for t in tasks if t.endswith((".yaml", ".yml")) or Path(t).expanduser().is_file()]
    if args.include_path is not None:
        found = (p for suffix in ("*.yaml", "*.yml") for p in args.include_path.rglob(suffix))
        files += sorted(itertools.islice(found, TASK_FILES + 1))
    loader, seen = task_loader(), set[Path]()
    for path in files:
        check_task_file(path, loader, seen)


def check_task_file(path: Path, loader: type, seen: set[Path], by: Path | None = None, depth: int = 0) -> None:
    """One task YAML and, as lm-eval follows them, the files its `include:` names (relative to it, after links are
    resolved), each once: a tag other than YAML's standard ones is refused, as is a file that does not parse."""
    import yaml

    path = path.resolve()
    name = f"{path} (included by {by})" if by is not None else str(path)
    if path in seen:
        return  # checked already (or an include cycle, which lm-eval refuses itself)
    seen.add(path)
    if len(seen) > TASK_FILES:
        raise UsageError(f"{name}: more than {TASK_FILES:,} task YAML files to check (given, in --include-path and "
                         "included); expected a task folder, not a whole tree")
    try:
        data = read_bytes(path, TASK_BYTES, "a task YAML", name)
    except OSError as e:
        raise UsageError(f"{name}: cannot read the task file ({e.strerror or e})") from None
    try:
        cfg = yaml.load(data, Loader=loader)  # bytes, as lm-eval reads them: PyYAML detects UTF-16 by its BOM
    except ForeignTag as e:
        tag, line = e.args
        if tag == "!function":
            raise UsageError(f"{name}: the task names Python code to run (lm-eval's !function tag imports a module "
                             "beside it); pass --trust-task-code if you trust it") from None
        raise UsageError(f"{name}: line {line}: the YAML tag {tag} is none of YAML's standard types, and lm-eval's "
                         "loader may build Python objects from it; pass --trust-task-code if you trust it") from None
    except (yaml.YAMLError, RecursionError) as e:
        raise UsageError(f"{name}: not a task YAML lm-eval can read ({one_line(e, 300)})") from None
    includes = cfg.get("include") if isinstance(cfg, dict) else None
    if includes is None:
        return
    if depth >= INCLUDE_DEPTH:
        raise UsageError(f"{name}: includes nest more than {INCLUDE_DEPTH} deep; expected a task and its templates")
    for include in includes if isinstance(includes, list) else [includes]:
        if not isinstance(include, str):
            raise UsageError(f"{name}: include {include!r}; expected the path of a YAML file, or a list of them")
        included = Path(include) if Path(include).is_absolute() else path.parent / include  # lm-eval's order
        if included.expanduser().is_file():  # one that is not is lm-eval's error, and runs nothing
            check_task_file(included.expanduser(), loader, seen, path, depth + 1)


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
        raise UsageError(f"--tasks: {' '.join(str(e).strip(chr(39) + chr(34)).split())}") from None
    except (OSError, ConnectionError) as e:
        raise UsageError(f"a task's data could not be loaded: {one_line(e, 300)} ({HUB_HINT})") from None


def run_eval(args: argparse.Namespace) -> int:
    tasks = check_flags(args)
    steer = parse_steer_args(args.steer)
    for t in tasks:
        if t.endswith((".yaml", ".yml")) and not Path(t).is_file():
            raise UsageError(f"--tasks {t}: no such task file")
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
