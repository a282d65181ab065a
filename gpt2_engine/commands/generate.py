"""`gpt2 generate`: text from a prompt, streamed (or as JSON), with one stats line on stderr."""

from __future__ import annotations

import argparse
import codecs
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.config import GPT2Config
from ..core.errors import GenerationError
from ..core.packing import Packing
from ..documents import read_text
from ..options import (ModelOptions, UsageError, add_model_options, add_steer_option, load_model, parse_steer_args,
                       positive_int, steering_from_args)
from ..runtime.constraints import Constraint, GrammarLimits
from ..runtime.generate import Completion, Generation, GenerationStats
from ..runtime.requests import MAX_SAMPLES, GenerationSettings
from ..runtime.sampling import SamplingParams
from ..runtime.speculation import ADAPTIVE_MAX, ADAPTIVE_START, MAX_DRAFT_TOKENS, check_draft_tokens

if TYPE_CHECKING:
    from ..api import GPT2


def add_generate(sub: argparse._SubParsersAction) -> None:
    g, s = GenerationSettings(), SamplingParams()
    p = sub.add_parser(
        "generate", help="generate text from a prompt",
        description="Generate text from a prompt, streaming it to stdout. A stats line goes to stderr.",
        epilog="examples:\n  gpt2 generate \"Hello, my dog is\" -n 40 --seed 0\n  echo 'Once upon a time' | gpt2 generate - "
               "--temperature 0\n  gpt2 generate -f prompt.txt --stop '\\n\\n' --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the prompt text; '-' reads it from stdin; '' starts from <|endoftext|>")
    p.add_argument("-f", "--file", type=Path, help="read the prompt from FILE (UTF-8)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=g.max_new_tokens, metavar="N",
                   help=f"tokens to generate at most (default {g.max_new_tokens})")
    p.add_argument("--temperature", type=float, default=s.temperature, metavar="T",
                   help=f"softmax temperature in [0, 2]; 0 (or below 1e-5) is greedy (default {s.temperature})")
    p.add_argument("--top-k", type=int, default=s.top_k, metavar="K", help=f"keep the K most likely tokens; 0 keeps all (default {s.top_k})")
    p.add_argument("--top-p", type=float, default=s.top_p, metavar="P",
                   help=f"nucleus sampling: keep the most likely tokens holding P of the mass; 1 keeps all (default {s.top_p})")
    p.add_argument("--repetition-penalty", type=float, default=s.repetition_penalty, metavar="R",
                   help=f"penalise tokens already in the text, in [0.01, 100]; 1 is off (default {s.repetition_penalty})")
    p.add_argument("--seed", type=int, help="random seed for a reproducible run (default: random, printed on stderr)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this string (repeatable; escapes like \\n are understood)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past <|endoftext|>")
    p.add_argument("--num-samples", type=positive_int, default=g.num_samples, metavar="K",
                   help=f"completions to generate, at most {MAX_SAMPLES:,} (default 1)")
    p.add_argument("--truncate", choices=["left"], help="keep the last tokens of a prompt too long for the context")
    p.add_argument("--allow-special", action="store_true", help="read <|endoftext|> in the prompt as the special token, not text")
    p.add_argument("--no-stream", action="store_true", help="print the text only when it is complete")
    p.add_argument("--json", action="store_true", help="print JSON Lines, one object per sample: index, text, token_ids, logprobs, finish_reason, "
                        "prompt_tokens, seed (token_ids and logprobs include a stop string's tokens; text ends before it)")
    p.add_argument("--speculate", metavar="DRAFTER",
                   help="speculative decoding: 'int4' or 'int8' (this model quantized drafts), 'ngram' (prompt lookup: "
                        "for text that quotes the prompt) or a GPT-2 checkpoint directory with the same tokenizer; "
                        "greedy output is the same tokens as without, sampled output the same distribution")
    p.add_argument("--draft-tokens", type=int, metavar="K",
                   help=f"tokens drafted per verify pass, 1..{MAX_DRAFT_TOKENS} (default: adaptive, from "
                        f"{ADAPTIVE_START} up to {ADAPTIVE_MAX} while drafts are accepted, down to none while not)")
    add_steer_option(p)
    shape = p.add_argument_group("structured output (one of these; llguidance enforces it token by token)")
    shape.add_argument("--json-schema", type=Path, metavar="FILE", help="the text is JSON valid against this schema")
    shape.add_argument("--json-object", action="store_true", help="the text is a JSON object")
    shape.add_argument("--regex", metavar="RE", help="the whole text matches this regular expression (Rust regex syntax)")
    shape.add_argument("--choice", action="append", metavar="TEXT", help="the text is one of these (repeatable)")
    shape.add_argument("--grammar", type=Path, metavar="FILE",
                       help="the text matches this grammar: Lark (llguidance's dialect) or GBNF (llama.cpp's)")
    shape.add_argument("--whitespace-flexible", action="store_true",
                       help="with --json-schema or --json-object: allow whitespace between JSON tokens (default: "
                            "compact JSON, none outside strings)")
    add_model_options(p)
    p.set_defaults(run=run_generate)


# The structured-output flags and the Constraint each makes from its value (a file's text for the two that take one)
CONSTRAINTS: dict[str, Callable[[Any, bool], Constraint]] = {
    "--json-schema": lambda path, flexible: Constraint.json_schema(read_text(path, sys.stdin.buffer, "--json-schema"),
                                                                   whitespace_flexible=flexible),
    "--json-object": lambda _, flexible: Constraint.json_object(whitespace_flexible=flexible),
    "--regex": lambda text, _: Constraint.regex(text),
    "--choice": lambda texts, _: Constraint.choice(texts),
    "--grammar": lambda path, _: Constraint.grammar(read_text(path, sys.stdin.buffer, "--grammar")),
}

# The settings' names (GenerationError.param) and the flags that set them: an error names what the user typed
FLAGS = {"max_new_tokens": "--max-new-tokens", "num_samples": "--num-samples", "temperature": "--temperature",
         "top_k": "--top-k", "top_p": "--top-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed",
         "stop": "--stop", "ignore_eos": "--ignore-eos"}


@contextmanager
def flags_named() -> Iterator[None]:
    """The engine's GenerationErrors in the command line's words: the flag at fault in place of the setting's name
    (`num_samples must be ...` -> `--num-samples must be ...`), or before the message."""
    try:
        yield
    except GenerationError as e:
        flag, message = FLAGS.get(e.param or ""), str(e)
        if flag is not None:
            message = flag + message[len(e.param):] if message.startswith(e.param) else f"{flag}: {message}"
        raise UsageError(message) from None


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The structured-output flag given, as a Constraint (at most one)."""
    given = [(flag, value) for flag in CONSTRAINTS
             if (value := getattr(args, flag[2:].replace("-", "_"))) is not None and value is not False]
    if len(given) > 1:
        raise UsageError(f"give one structured-output flag, not {' and '.join(flag for flag, _ in given)}")
    if args.whitespace_flexible and [flag for flag, _ in given] not in (["--json-schema"], ["--json-object"]):
        raise UsageError("--whitespace-flexible applies to --json-schema or --json-object")
    if not given:
        return None
    flag, value = given[0]
    try:
        constraint = CONSTRAINTS[flag](value, args.whitespace_flexible)
        GrammarLimits().check(constraint)  # its size, before the model loads (the compile checks the rest)
        return constraint
    except GenerationError as e:
        raise UsageError(f"{flag}: {e}") from None


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt: the argument, stdin ('-') or -f FILE's text (UTF-8, checked)."""
    if args.file is not None and args.prompt is not None:
        raise UsageError("give the prompt either as an argument or with -f FILE, not both")
    if args.file is not None:
        return read_text(args.file, sys.stdin.buffer, "-f")
    if args.prompt is None:
        raise UsageError("no prompt: give PROMPT, '-' for stdin, or -f FILE")
    return read_text("-", sys.stdin.buffer) if args.prompt == "-" else args.prompt


# Python's string escapes; anything else after a backslash is an error (a shell passes "\\n" as two characters)
ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|N\{[^}]*\}|[0-7]{1,3}|[\\'\"abfnrtv])|\\(.?)",
                    re.DOTALL)


def unescape(text: str, flag: str) -> str:
    """`text` with its escapes (\\n, \\t, \\xHH, \\uHHHH, \\N{name}, ...) replaced by what they mean, every other
    character as given (decoding the whole string as unicode_escape read its UTF-8 bytes as Latin-1: é became Ã©)."""
    def one(m: re.Match) -> str:
        if m.group(1) is None:
            what = f"\\{m.group(2)}" if m.group(2) else "a \\ at the end"
            raise UsageError(f"{flag} '{text}': {what} is not an escape; expected \\n, \\t, \\\\, \\xHH, \\uHHHH, "
                             f"\\UHHHHHHHH or \\N{{name}}")
        try:
            return codecs.decode("\\" + m.group(1), "unicode_escape")
        except UnicodeDecodeError as e:
            raise UsageError(f"{flag} '{text}': \\{m.group(1)}: {e.reason}") from None
    return ESCAPE.sub(one, text)


def settings_from_args(args: argparse.Namespace) -> GenerationSettings:
    """The run's settings, checked before the model loads (a typo costs no load time)."""
    stop = tuple(unescape(s, "--stop") for s in args.stop)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty),
        stop=stop, ignore_eos=args.ignore_eos, seed=args.seed, num_samples=args.num_samples, truncate=args.truncate,
        constraint=constraint_from_args(args))
    check_draft_tokens(args.draft_tokens, "--draft-tokens")
    if args.draft_tokens is not None and args.speculate is None:
        raise UsageError("--draft-tokens applies to speculative decoding: give --speculate too")
    return settings


def start(args: argparse.Namespace, prompt: str, settings: GenerationSettings) -> tuple[GPT2, Generation, float]:
    """(model, the run, seconds to load the model and any draft model): the model loaded, steering applied."""
    steer = parse_steer_args(args.steer)
    t0 = time.perf_counter()
    model = load_model(ModelOptions.from_args(args))
    if steer:
        settings = replace(settings, steering=steering_from_args(steer, model.config))
    run = model.generation(prompt, allow_special=args.allow_special, settings=settings, speculate=args.speculate,
                           draft_tokens=args.draft_tokens)
    return model, run, time.perf_counter() - t0


def warn_about_context(run: Generation, config: GPT2Config, max_new_tokens: int) -> None:
    """A line on stderr when the prompt was truncated, or leaves room for fewer new tokens than asked."""
    if run.stats.truncated_tokens:
        print(f"gpt2: prompt truncated from the left: dropped {run.stats.truncated_tokens} tokens to fit the context "
              f"of {config.n_positions}", file=sys.stderr)
    if run.stats.context_limited:
        print(f"gpt2: the context of {config.n_positions} tokens leaves room for {run.stats.context_limited} new "
              f"tokens, not {max_new_tokens}: generation stops there (--truncate left keeps room for all of them)",
              file=sys.stderr)


def json_record(i: int, c: Completion, st: GenerationStats, speculate: str | None) -> dict[str, Any]:
    """One sample as a --json line."""
    doc = {"index": i, "text": c.text, "token_ids": c.token_ids, "logprobs": [round(x, 6) for x in c.logprobs],
           "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens, "seed": st.seed}
    if speculate is not None:
        doc["speculation"] = {"drafter": speculate, "drafted": st.drafted, "accepted": st.accepted,
                              "acceptance_rate": none_if_nan(st.acceptance_rate),
                              "verify_passes": st.verify_passes, "tokens_per_verify": none_if_nan(st.tokens_per_verify)}
    return doc


def write_text(run: Generation, args: argparse.Namespace) -> None:
    """The samples on stdout: streamed as they come (one sample), or whole when done, as text or JSON Lines."""
    stream = not (args.no_stream or args.json or run.settings.num_samples > 1)
    for _, piece in run:
        if stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if args.json:  # one object per sample, one per line (JSON Lines): the same shape for one sample or many
        for i, c in enumerate(run.completions):
            print(json.dumps(json_record(i, c, run.stats, args.speculate), ensure_ascii=False))
    elif stream:
        print()
    else:
        for i, c in enumerate(run.completions):
            if len(run.completions) > 1:
                print(f"--- sample {i + 1} ({c.finish_reason}) ---")
            print(c.text)


def stats_line(run: Generation, args: argparse.Namespace, load_seconds: float, packing: Packing | None = None) -> str:
    """The line on stderr after the text: load time (and the packed weights' size), token counts, speeds, the seed
    and the drafts."""
    st = run.stats
    seed = "greedy" if args.temperature == 0 else f"seed {st.seed}"  # a seed changes nothing at temperature 0
    speculation = ""
    if args.speculate is not None:
        speculation = (f" | drafted {st.drafted}, accepted {st.accepted} ({st.acceptance_rate:.0%}), "
                       f"{st.tokens_per_verify:.2f} tokens per verify pass" if st.verify_passes else " | no drafts")
    packed = f" ({packing.packed_bytes / 1e6:.0f} MB packed)" if packing else ""
    prompt = run.completions[0].prompt_tokens
    return (f"load {load_seconds:.2f} s{packed} | prompt {prompt} token{'s' * (prompt != 1)} | "
            f"{st.new_tokens} new token{'s' * (st.new_tokens != 1)} | prefill {st.prefill_tokens_per_second:.1f} tok/s | "
            f"decode {st.decode_tokens_per_second:.1f} tok/s | {seed}{speculation}")


def run_generate(args: argparse.Namespace) -> int:
    with flags_named():
        prompt = read_prompt(args)
        settings = settings_from_args(args)
        model, run, load_seconds = start(args, prompt, settings)
    warn_about_context(run, model.config, args.max_new_tokens)
    write_text(run, args)
    print(stats_line(run, args, load_seconds, model.packing), file=sys.stderr)
    return 0


def none_if_nan(x: float) -> float | None:
    return None if x != x else round(x, 4)
