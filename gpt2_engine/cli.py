"""`gpt2 generate | score | eval | finetune | merge-lora | serve | inspect | sae | compare | download`: a thin command line over the library.

Exit codes: 0 success; 1 a comparison found a mismatch; 2 bad input, a load or download error (one line on stderr);
130 interrupted (Ctrl-C), 143 terminated (SIGTERM), each after removing the files it had not finished.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from .commands.compare import add_compare
from .commands.convert import add_convert
from .commands.download import add_download
from .commands.eval import add_eval
from .commands.finetune import add_finetune
from .commands.generate import add_generate
from .commands.inspect import add_inspect
from .commands.merge import add_merge_lora
from .commands.sae import add_sae
from .commands.score import add_score
from .commands.serve import add_serve
from .commands.tokenize import add_tokenize
from .core.errors import GPT2EngineError, one_line
from .formats.files import error_number
from .formats.peft import recorded_base
from .formats.hf import weights_directory


def version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("gpt2-engine")
    except PackageNotFoundError:
        from . import __version__

        return __version__


# OS errors that are the user's machine or paths, not the engine's bugs: with or without the path they concern
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)
ABOUT_A_PATH = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP, errno.ENXIO,
                errno.EINVAL, errno.ENOTEMPTY, errno.EXDEV, errno.EBUSY, errno.ETXTBSY)
OUTPUT_ARGUMENTS = ("out", "dst", "output", "per_token")  # where a command that names no file was writing


def system_error(e: BaseException, args: argparse.Namespace) -> str | None:
    """One line for an error the operating system raised about the user's files (a full disk, a read-only folder,
    a missing path); None for anything else, which is a bug to report."""
    number = error_number(e)
    if number is None:
        return None
    name = getattr(e, "filename", None)
    if number in NO_SPACE:  # a write() that failed names no file: the command's output does
        outputs = [str(v) for a in OUTPUT_ARGUMENTS if (v := getattr(args, a, None)) is not None and str(v) != "-"]
        name = name or (outputs[0] if outputs else None)
        return f"no space left writing {name}" if name else "no space left on the device"
    if name is not None and number in REFUSED + ABOUT_A_PATH:
        return f"{name}: {os.strerror(number)}"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2", description="A from-scratch GPT-2 engine: generate, score, fine-tune, serve, inspect.")
    parser.add_argument("--version", action="version", version=f"gpt2-engine {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_generate(sub)
    add_score(sub)
    add_eval(sub)
    add_finetune(sub)
    add_merge_lora(sub)
    add_convert(sub)
    add_tokenize(sub)
    add_serve(sub)
    add_inspect(sub)
    add_sae(sub)
    add_compare(sub)
    add_download(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job runner's stop, `timeout`, `kill`), raised where the command is, as Ctrl-C is: its files written
    beside their destinations are removed and a training run keeps its last state, as on Ctrl-C."""


def terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gpt2` command."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return run_command(argv)
    previous = signal.signal(signal.SIGTERM, terminate)  # gpt2 serve installs its own while it serves
    try:
        return run_command(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_command(argv: list[str] | None) -> int:
    """Parse `argv` and run its command: its exit status, every error one line on stderr."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a misspelt flag: the subcommand's usage, not the top level's
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if hasattr(args, "weights"):  # every command that loads a checkpoint
            lora = getattr(args, "lora", None)
            if args.weights is None and isinstance(lora, Path) and Path(base := recorded_base(lora)).is_dir():
                args.weights = Path(base)  # the adapter's own base
                print(f"gpt2 {args.command}: --lora {lora}: on the base it records, {base}", file=sys.stderr)
            args.weights, note = weights_directory(args.weights)
            if note:
                print(f"gpt2 {args.command}: {note}", file=sys.stderr)
        return args.run(args)
    except GPT2EngineError as e:
        print(f"gpt2 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"gpt2 {args.command}: terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a shell reports a process it ended
    except KeyboardInterrupt:
        print(f"gpt2 {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `gpt2 generate ... | head -1`
        sys.stderr.close()
        return 0
    except Exception as e:  # noqa: BLE001 - a CLI never shows a raw traceback
        if (line := system_error(e, args)) is not None:
            print(f"gpt2 {args.command}: error: {line}", file=sys.stderr)
            return 2
        print(f"gpt2 {args.command}: internal error: {type(e).__name__}: {one_line(e, 300)} "
              "(please report it)", file=sys.stderr)
        return 1
