"""`gpt2 inspect PROMPT`: the views of report.py for one prompt, as PNG, HTML and JSON files."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..documents import read_text
from ..interp.sae import SAE
from ..inspect.analysis import IG_MAX_STEPS
from ..inspect.report import ReportSettings, build_report, parse_layers, write_report
from ..inspect.sae import feature_attribution
from ..options import ModelOptions, UsageError, add_model_options, load_model


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt (the argument, or stdin's text for '-'), with --ig-steps checked."""
    prompt = read_text("-", sys.stdin.buffer) if args.prompt == "-" else args.prompt
    if not prompt:
        raise UsageError("the prompt is empty; expected text (or '-' to read it from stdin)")
    if not 1 <= args.ig_steps <= IG_MAX_STEPS:  # the most attribution() doubles its steps to
        raise UsageError(f"--ig-steps: expected an integer in [1, {IG_MAX_STEPS}], got {args.ig_steps}")
    return prompt


def read_sae(args: argparse.Namespace) -> SAE | None:
    """The --sae, if given, read before the model loads: a bad file fails first."""
    if args.sae_hook is not None and args.sae is None:
        raise UsageError("--sae-hook names the hook of an --sae; expected --sae PATH with it")
    return SAE.load(args.sae, hook_name=args.sae_hook) if args.sae is not None else None


def summary(report: dict, out: Path, written: list[Path], seconds: float) -> None:
    """The lines on stderr: the SAE feature that drives the target most, the target and the files written."""
    target = report["target"]
    if "sae" in report and report["sae"]["top"]:
        best = report["sae"]["top"][0]
        print(f"SAE: feature #{best['feature']} at {best['token']!r} (position {best['position']}) drives it most "
              f"({best['attribution']:+.4f})", file=sys.stderr)
    print(f"target {target['text']!r} ({target['chosen']}, log p {target['logprob']:.3f}); wrote "
          f"{', '.join(p.name for p in written)} to {out}/ in {seconds:.1f} s", file=sys.stderr)


def run_inspect(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    t0 = time.perf_counter()
    sae = read_sae(args)
    model = load_model(ModelOptions.from_args(args))
    layers = parse_layers(args.layers, model.config.n_layer)
    report = build_report(model, prompt, ReportSettings(target=args.target, layers=layers, ig_steps=args.ig_steps))
    if sae is not None:
        report["sae"] = feature_attribution(model, sae, report["ids"], report["target"]["id"])
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    if args.out is not None or not args.json:
        out = args.out if args.out is not None else Path("inspect")
        written = write_report(report, out)
        if not args.quiet:
            summary(report, out, written, time.perf_counter() - t0)
    return 0


def add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="look inside the model on one prompt (attention, logit lens, attributions)",
        description="Run one prompt through the engine with every activation cached and write what it shows: "
                    "attention patterns, the logit lens, direct logit attribution per head and MLP, the prompt "
                    "coloured by gradient attribution, and head-detector scores, as PNGs, one self-contained "
                    "interactive HTML page (report.html, no network needed) and report.json.",
        epilog="examples:\n  gpt2 inspect \"When Mary and John went to the store, John gave a drink to\" --target ' Mary'\n"
               "  gpt2 inspect 'The Eiffel Tower is in' --layers 0,5-7 --out eiffel/\n"
               "  gpt2 inspect 'Hello world' --json | jq .target",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt text ('-' reads it from stdin); <|endoftext|> is read as the special token")
    p.add_argument("--target", metavar="TOKEN",
                   help="the next token to explain, as text that is exactly one token, e.g. ' Paris' "
                        "(default: the model's most likely next token)")
    p.add_argument("--layers", default="all", metavar="LIST",
                   help="layers whose attention patterns are drawn: 'all' or e.g. '0,3,5-7' (default all)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="directory for the PNGs, report.html and report.json (default ./inspect; with --json, "
                        "files are written only if --out is given)")
    p.add_argument("--sae", metavar="PATH",
                   help="also show which features of this SAE (SAELens's directory or OpenAI's .pt) drive the target: "
                        "activation x gradient per token and feature, the reconstruction error added back")
    p.add_argument("--sae-hook", metavar="NAME", help="the SAE's hook point (required for OpenAI's .pt files)")
    p.add_argument("--json", action="store_true", help="print the report's JSON to stdout")
    p.add_argument("--ig-steps", type=int, default=ReportSettings.ig_steps, metavar="N",
                   help=f"integrated-gradients quadrature points to start with; doubled until the attributions add up "
                        f"within 1%% (default {ReportSettings.ig_steps})")
    p.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    add_model_options(p)
    p.set_defaults(run=run_inspect)
