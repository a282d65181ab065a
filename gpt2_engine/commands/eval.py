"""`gpt2 eval`: EleutherAI's lm-evaluation-harness (`lm_eval.simple_evaluate`) with the engine as its model
(harness.py). Tasks are lm-eval's names or YAML files; lm-eval is the optional `[eval]` extra."""

from __future__ import annotations

import argparse
import errno
import fnmatch
import importlib.util
import io
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from ..core.config import read_bytes
from ..core.errors import GPT2EngineError, one_line
from ..formats.files import OutputError, atomic_write, check_not_an_input, what_is, written_into
from ..options import (ModelOptions, UsageError, add_model_options, add_steer_option, load_model, parse_steer_args,
                       positive_int, seed_value, steering_from_args)
from ..runtime.prefix import DEFAULT_CAPACITY_MB

HUB_HINT = "tasks whose data lm-eval downloads need the Hugging Face Hub; a task on a local file needs none (docs/evaluation.md)"
TASK_YAML_BYTES = 16 << 20  # a task file is a few KB; lm-eval reads any file an include names whole, 3 GB too
GROUP_DEPTH = 32  # lm-eval nests inline groups without a bound; its own suites nest two or three deep
SKIPPED_FOLDERS = {"__pycache__", ".ipynb_checkpoints"}  # lm-eval's index leaves their YAML files out


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


def task_loader() -> type:
    """lm-eval's task YAML loader (libyaml's safe loader where built), with a `!function` tag kept as its text
    instead of importing the module it names."""
    import yaml

    base = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.FullLoader
    loader = type("TaskLoader", (base,), {})
    loader.add_constructor("!function", lambda load, node: load.construct_scalar(node))
    return loader


def read_task_yaml(path: Path, name: str, loader: type) -> dict[str, Any]:
    """A task YAML file parsed as lm-eval parses it; a UsageError naming `name` where it is missing, not a regular
    file (checked before it is opened: lm-eval's open of a FIFO waits forever), too large, not YAML or not a
    mapping."""
    import yaml

    kind = kind_of(path, name)
    if kind != "a regular file":
        raise UsageError(f"{name}: {kind or 'no such file'}; expected a task YAML file")
    try:
        stream = io.BytesIO(read_bytes(path, TASK_YAML_BYTES, "a task YAML file", name=name, regular=True))
        stream.name = path.name  # what the parser's messages call it
        cfg = yaml.load(stream, Loader=loader)  # noqa: S506 (a safe loader)
    except OSError as e:
        raise UsageError(f"{name}: cannot be read ({e.strerror or one_line(e)})") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{name}: not a task YAML file ({one_line(e, 300)})") from None
    except RecursionError:
        raise UsageError(f"{name}: its values nest too deeply for a task YAML file") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{name}: holds {type(cfg).__name__}; expected a task YAML file (a mapping of task keys)")
    return cfg


def task_config(path: Path, name: str, loader: type, read: dict[Path, str], seen: set[str]) -> dict[str, Any]:
    """The file's keys over those of its includes, merged as lm-eval's load_yaml merges them (an include's path is
    taken from the real folder of the file naming it); each include is added to `read` with what it is."""
    real = os.path.realpath(path)
    if real in seen:  # lm-eval refuses a file read twice for one task
        raise UsageError(f"{name}: {real} is read already for this task (an include cycle?); include it once")
    seen.add(real)
    cfg = read_task_yaml(path, name, loader)
    includes = cfg.pop("include", [])
    merged: dict[str, Any] = {}
    for include in includes if isinstance(includes, list) else [includes]:
        if not isinstance(include, str):
            raise UsageError(f"{name}: include {include!r}: expected the path of a task YAML file")
        included = Path(real).parent / include  # an absolute include replaces the folder
        read[included] = f"included by {path}"
        config = task_config(included, f"include {include}", loader, read, seen)
        config.pop("task_list", None)  # as lm-eval: an included file's task_list is its own
        merged.update(config)
    return {**merged, **cfg}


def strings(value: Any) -> list[str]:
    """The paths in a data_files value: a string, a list of them, or a mapping of either per split."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [s for v in value for s in strings(v)] if isinstance(value, list) else []


def data_inputs(cfg: dict[str, Any], task: str) -> dict[Path, str]:
    """The local paths a task's data is read from, with what each is: datasets.load_dataset(dataset_path,
    **dataset_kwargs) reads data_files under data_dir, both under dataset_path where that is a local folder."""
    found: dict[Path, str] = {}
    kwargs = cfg.get("dataset_kwargs") if isinstance(cfg.get("dataset_kwargs"), dict) else {}
    base = Path()
    if isinstance(cfg.get("dataset_path"), str) and cfg["dataset_path"]:
        source = Path(cfg["dataset_path"]).expanduser()
        if source.exists():
            found[source] = f"task {task}'s dataset_path"
            base = source if source.is_dir() else base
    if isinstance(kwargs.get("data_dir"), str) and kwargs["data_dir"]:
        base = base / Path(kwargs["data_dir"]).expanduser()
        found[base] = f"task {task}'s data_dir"
    for name in strings(kwargs.get("data_files")):
        found.setdefault(base / Path(name).expanduser(), f"task {task}'s data_files")
    return found


def task_data(cfg: dict[str, Any], name: str, passed: dict[str, Any] | None = None, depth: int = 0) -> dict[Path, str]:
    """data_inputs of a task file's task, or of each task a group defines inline at any depth (`task: [{group: g,
    task: [{task: t, ...}]}]`), with the keys each group passes down merged in as lm-eval's factory merges them."""
    if depth > GROUP_DEPTH:
        raise UsageError(f"{name}: its groups nest inline more than {GROUP_DEPTH} deep; expected a few levels")
    members = cfg.get("task")
    if not isinstance(members, list):  # a task: its own keys win over its groups'
        return data_inputs({**(passed or {}), **cfg}, members if isinstance(members, str) else name)
    # a group: an enclosing group's keys win over an inline group's own (lm-eval's _build_group), and the result is
    # what a member named by reference (a registered task) is built with, so its data are read here too
    passed = {**{k: v for k, v in cfg.items() if k not in ("group", "task")}, **(passed or {})}
    found = data_inputs(passed, f"group {cfg['group']}" if isinstance(cfg.get("group"), str) else name)
    for member in members:
        if isinstance(member, dict):
            found.update(task_data(member, name, passed, depth + 1))
    return found


def task_inputs(args: argparse.Namespace, tasks: list[str]) -> dict[Path, str]:
    """What the task files given and in --include-path are and read (their includes, local data files and folders),
    each with what it is; every file walked with its includes before lm-eval reads them, so that an include that is
    not a regular file, or not YAML, is one line naming it rather than a hang or an internal error."""
    files = [(Path(t).expanduser(), f"--tasks {t}", "a task file") for t in tasks if Path(t).expanduser().is_file()]
    if args.include_path is not None:  # lm-eval indexes every YAML file there, includes and all
        files += [(p, f"--include-path {p}", f"a task file in --include-path {args.include_path}")
                  for p in sorted(args.include_path.glob("**/*.yaml")) if not SKIPPED_FOLDERS & set(p.parts)]
    loader, read = task_loader(), {}
    for path, name, role in files:
        read.setdefault(path, role)
        read.update(task_data(task_config(path, name, loader, read, set()), name))
    return read


def check_not_task_data(dest: Path, read: dict[Path, str], include_path: Path | None) -> None:
    """Refuse an --output that is a file a task reads (or a task file), lies in a folder its data is read from or in
    --include-path, or matches a data_files pattern: writing it would replace the task's data or file, or put the
    results among them."""
    check_not_an_input(dest, read, "--output")
    real = Path(os.path.realpath(dest))
    if include_path is not None and real.is_relative_to(os.path.realpath(include_path)):
        # a results file there is indexed by the next run, and one named .yaml is read as a task
        raise OutputError(f"--output {dest}: is in {include_path}, the --include-path folder, whose YAML files "
                          "lm-eval reads; write the results somewhere else")
    for path, role in read.items():
        if path.is_dir() and real.is_relative_to(os.path.realpath(path)):
            raise OutputError(f"--output {dest}: is in {path}, one of the inputs ({role}), which the results would "
                              "join; write the results somewhere else")
        pattern = os.path.abspath(path)
        if any(c in str(path) for c in "*?[") and any(fnmatch.fnmatchcase(p, pattern)
                                                       for p in (str(real), os.path.abspath(dest))):
            raise OutputError(f"--output {dest}: matches {path}, one of the inputs ({role}); write the results "
                              "somewhere else")


def evaluate(args: argparse.Namespace, lm: Any, tasks: list[str]) -> dict[str, Any]:
    """lm-eval's simple_evaluate on the tasks, every seed --seed; an unknown task, data that cannot be loaded or a
    template naming what the data's rows lack is a UsageError (task_error)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(args.include_path) if args.include_path else None)
    limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
    try:
        return simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit, task_manager=manager,
                               log_samples=args.log_samples, random_seed=args.seed, numpy_random_seed=args.seed,
                               torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    except GPT2EngineError:
        raise
    except Exception as e:
        raise task_error(e, args.trust_task_code) from None


def task_error(e: Exception, trusted: bool) -> Exception:
    """What lm-eval's exception `e` means to the user: a UsageError for an unknown task, data that cannot be loaded,
    a template naming what the rows lack, or (`trusted` task files) lm-eval failing on a file; else `e` itself."""
    from jinja2 import UndefinedError

    if isinstance(e, KeyError):  # lm-eval's "not a registered task/group/tag name or valid YAML path"
        said = " ".join(str(e).strip(chr(39) + chr(34)).split())
        if not e.args or e.args[0] is None or len(said) < 8:  # a registry lookup of a name the YAML left unset
            said = (f"lm-eval could not build the task (it looked up {said or 'nothing'} in a registry: a metric, "
                    f"filter or output_type the task's YAML names that lm-eval does not know?)")
        return UsageError(f"--tasks: {one_line(said, 300)}")
    if isinstance(e, (OSError, ConnectionError)):
        return UsageError(f"a task's data could not be loaded: {one_line(e, 300)} ({HUB_HINT})")
    if isinstance(e, UndefinedError):  # lm-eval renders doc_to_text and the like with each data row's fields
        said = one_line(e, 200)
        name = re.fullmatch(r"'(.+)' is undefined", said)
        what = repr(name[1]) if name else "something"
        return UsageError(f"--tasks: a task's template names {what}, which its data rows do not have (jinja2: "
                          f"{said})")
    if trusted and not in_the_engine(e):
        # lm-eval's own code failing on a task file the user wrote (no split to test on, a wrong type): the file's
        # error, not the engine's
        return UsageError(f"--tasks: lm-eval failed on the task file ({type(e).__name__}: {one_line(e, 200)}); "
                          f"check its keys against lm-eval's task guide")
    return e


def in_the_engine(e: BaseException) -> bool:
    """Whether `e` was raised in this package's code (the model lm-eval calls), not in lm-eval's alone."""
    here = Path(__file__).resolve()
    package = here.parent.parent
    tb = e.__traceback__
    while tb is not None:
        frame = Path(tb.tb_frame.f_code.co_filename).resolve()
        if frame != here and frame.is_relative_to(package):
            return True
        tb = tb.tb_next
    return False


def run_eval(args: argparse.Namespace) -> int:
    tasks = check_flags(args)
    steer = parse_steer_args(args.steer)
    check_task_paths(tasks)
    check_task_code(args, tasks)
    if args.trust_task_code:
        read = task_inputs(args, tasks)
        if args.output is not None:
            check_not_task_data(args.output, read, args.include_path)

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
