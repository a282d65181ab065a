"""`gpt2 generate`: text from a prompt, streamed (or as JSON), with one stats line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..core.errors import GenerationError
from ..options import (ModelOptions, UsageError, add_model_options, add_steer_option, load_model, parse_steer_args,
                       positive_int, steering_from_args)
from ..runtime.constraints import Constraint, GrammarLimits
from ..runtime.requests import GenerationSettings
from ..runtime.sampling import SamplingParams
from ..runtime.speculation import ADAPTIVE_MAX, ADAPTIVE_START, MAX_DRAFT_TOKENS, check_draft_tokens


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
                   help=f"softmax temperature; 0 is greedy (default {s.temperature})")
    p.add_argument("--top-k", type=int, default=s.top_k, metavar="K", help=f"keep the K most likely tokens; 0 keeps all (default {s.top_k})")
    p.add_argument("--top-p", type=float, default=s.top_p, metavar="P",
                   help=f"nucleus sampling: keep the most likely tokens holding P of the mass; 1 keeps all (default {s.top_p})")
    p.add_argument("--repetition-penalty", type=float, default=s.repetition_penalty, metavar="R",
                   help=f"penalise tokens already in the text; 1 is off (default {s.repetition_penalty})")
    p.add_argument("--seed", type=int, help="random seed for a reproducible run (default: random, printed on stderr)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this string (repeatable; escapes like \\n are understood)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past <|endoftext|>")
    p.add_argument("--num-samples", type=positive_int, default=g.num_samples, metavar="K", help="completions to generate (default 1)")
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


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The structured-output flag given, as a Constraint (at most one)."""
    given = [flag for flag, value in (("--json-schema", args.json_schema), ("--json-object", args.json_object or None),
                                      ("--regex", args.regex), ("--choice", args.choice), ("--grammar", args.grammar))
             if value is not None]
    if len(given) > 1:
        raise UsageError(f"give one structured-output flag, not {' and '.join(given)}")
    if args.whitespace_flexible and given not in (["--json-schema"], ["--json-object"]):
        raise UsageError("--whitespace-flexible applies to --json-schema or --json-object")
    if not given:
        return None
    try:
        if args.json_object:
            constraint = Constraint.json_object(whitespace_flexible=args.whitespace_flexible)
        elif args.regex is not None:
            constraint = Constraint.regex(args.regex)
        elif args.choice is not None:
            constraint = Constraint.choice(args.choice)
        else:
            path = args.json_schema or args.grammar
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"{given[0]} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
            constraint = (Constraint.json_schema(text, whitespace_flexible=args.whitespace_flexible)
                          if args.json_schema else Constraint.grammar(text))
        GrammarLimits().check(constraint)  # its size, before the model loads (the compile checks the rest)
        return constraint
    except GenerationError as e:
        raise UsageError(f"{given[0]}: {e}") from None


def read_prompt(args: argparse.Namespace) -> str:
    if args.file is not None:
        if args.prompt is not None:
            raise UsageError("give the prompt either as an argument or with -f FILE, not both")
        try:
            return args.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read prompt file {args.file}: {getattr(e, 'strerror', None) or e}") from None
    if args.prompt is None:
        raise UsageError("no prompt: give PROMPT, '-' for stdin, or -f FILE")
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt


def run_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    stop = tuple(s.encode("utf-8").decode("unicode_escape") if "\\" in s else s for s in args.stop)
    settings = GenerationSettings(  # checked before the model loads: a typo costs no load time
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty),
        stop=stop, ignore_eos=args.ignore_eos, seed=args.seed, num_samples=args.num_samples, truncate=args.truncate,
        constraint=constraint_from_args(args))
    check_draft_tokens(args.draft_tokens, "--draft-tokens")
    if args.draft_tokens is not None and args.speculate is None:
        raise UsageError("--draft-tokens applies to speculative decoding: give --speculate too")
    steer = parse_steer_args(args.steer)
    t0 = time.perf_counter()
    model = load_model(ModelOptions.from_args(args))
    if steer:
        settings = replace(settings, steering=steering_from_args(steer, model.config))
    run = model.generation(prompt, allow_special=args.allow_special, settings=settings, speculate=args.speculate,
                           draft_tokens=args.draft_tokens)
    load_seconds = time.perf_counter() - t0  # with the draft model's
    if run.stats.truncated_tokens:
        print(f"gpt2: prompt truncated from the left: dropped {run.stats.truncated_tokens} tokens to fit the context "
              f"of {model.config.n_positions}", file=sys.stderr)
    if run.stats.context_limited:
        print(f"gpt2: the context of {model.config.n_positions} tokens leaves room for {run.stats.context_limited} new "
              f"tokens, not {args.max_new_tokens}: generation stops there (--truncate left keeps room for all of them)",
              file=sys.stderr)
    stream = not (args.no_stream or args.json or settings.num_samples > 1)
    for _, piece in run:
        if stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if args.json:  # one object per sample, one per line (JSON Lines): the same shape for one sample or many
        st = run.stats
        for i, c in enumerate(run.completions):
            doc = {"index": i, "text": c.text, "token_ids": c.token_ids, "logprobs": [round(x, 6) for x in c.logprobs],
                   "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens, "seed": st.seed}
            if args.speculate is not None:
                doc["speculation"] = {"drafter": args.speculate, "drafted": st.drafted, "accepted": st.accepted,
                                      "acceptance_rate": none_if_nan(st.acceptance_rate),
                                      "verify_passes": st.verify_passes, "tokens_per_verify": none_if_nan(st.tokens_per_verify)}
            print(json.dumps(doc, ensure_ascii=False))
    elif stream:
        print()
    else:
        for i, c in enumerate(run.completions):
            if len(run.completions) > 1:
                print(f"--- sample {i + 1} ({c.finish_reason}) ---")
            print(c.text)
    st = run.stats
    seed = "greedy" if args.temperature == 0 else f"seed {st.seed}"  # a seed changes nothing at temperature 0
    speculation = ""
    if args.speculate is not None:
        speculation = (f" | drafted {st.drafted}, accepted {st.accepted} ({st.acceptance_rate:.0%}), "
                       f"{st.tokens_per_verify:.2f} tokens per verify pass" if st.verify_passes else " | no drafts")
    print(f"load {load_seconds:.2f} s | prompt {run.completions[0].prompt_tokens} tokens | {st.new_tokens} new tokens | "
          f"prefill {st.prefill_tokens_per_second:.1f} tok/s | decode {st.decode_tokens_per_second:.1f} tok/s | "
          f"{seed}{speculation}", file=sys.stderr)
    return 0


def none_if_nan(x: float) -> float | None:
    return None if x != x else round(x, 4)
