"""`gpt2 compare`: the engine's logits against transformers' GPT2LMHeadModel, and where they part ways.

transformers is imported here only, as the reference; the engine never uses it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.errors import GPT2EngineError, WeightsError, one_line
from ..core.tokenizer import Tokenizer
from ..documents import read_text
from ..options import add_device_options, add_force_option, add_weights_option
from ..runtime.requests import prompt_or_endoftext

# Default tolerances, relative to max |reference|: measured errors are ~1e-6 (torch fp32) and ~1e-6 (NumPy).
DEFAULT_RTOL = {"torch": 1e-4, "numpy": 1e-3}
# bfloat16, int8 and int4 weights cannot match to rounding; they pass on top-1 agreement with the reference and on
# the change of perplexity, both over all prompts' tokens together.
DEFAULT_MIN_TOP1 = {"bfloat16": 0.995, "float16": 0.995, "int8": 0.99, "int4": 0.95}
DEFAULT_MAX_PPL_CHANGE = {"bfloat16": 0.005, "float16": 0.005, "int8": 0.005, "int4": 0.02}

BUILTIN_PROMPTS = {
    "english": "The old lighthouse keeper climbed the spiral stairs each evening, counting the steps as his father "
               "had, and lit the lamp before the fog rolled in from the harbour.",
    "code": "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
            "        out.append(a)\n        a, b = b, a + b\n    return out\n\nprint(fibonacci(10))\n",
    "unicode": "Zoë's café served crème brûlée; 東京の天気は晴れ。Привет, мир! 🤖🚀 ½ ≈ 0.5 — «quoted» text.",
}


def long_prompt() -> str:
    """About 1000 tokens of varied English: repeated, numbered paragraphs."""
    topics = ["rivers", "mountains", "libraries", "machines", "gardens", "cities", "oceans", "forests"]
    parts = [f"Chapter {i + 1}. On {t}: people have written about {t} for centuries, describing how they change with "
             f"the seasons, how they shape the lives of those nearby, and why we return to them again and again. "
             for i, t in enumerate(topics * 3)]
    return "".join(parts)


@dataclass
class Report:
    """The comparison of one prompt on one engine."""

    prompt: str
    engine: str
    tokens: int
    max_abs: float
    mean_abs: float
    max_rel: float  # max |diff| / max |reference logit|
    kl_max: float  # max over positions of KL(reference || engine) of the next-token distributions
    top1_agreement: float
    top5_overlap: float
    nll_reference: float  # summed over the T - 1 predicted tokens (nats)
    nll: float
    nll_change_sq: float  # sum over the predicted tokens of (engine's - reference's NLL)^2: the change's spread
    ppl_reference: float  # exp(nll / (T - 1)); nan for a one-token prompt
    ppl: float
    per_block_max_abs: list[float]
    first_divergent_block: int | None
    first_divergent_position: int | None
    passed: bool


def reference_outputs(hf_model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' logits [1, T, V] and its residual stream after each block (forward hooks)."""
    blocks: list[torch.Tensor] = []
    handles = [b.register_forward_hook(lambda _m, _i, out: blocks.append(out[0] if isinstance(out, tuple) else out))
               for b in hf_model.transformer.h]
    try:
        with torch.no_grad():
            logits = hf_model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return logits.float().cpu(), [b.float().cpu() for b in blocks]


def engine_outputs(model, ids: torch.Tensor, engine: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The engine's logits [1, T, V] and block outputs, from the torch engine or the NumPy reference."""
    blocks: list = []
    if engine == "torch":
        logits = model.forward(ids, hidden_states=blocks)
        return logits.float().cpu(), [b.float().cpu() for b in blocks]
    from ..core import numpy_ref
    from ..core.weights import assemble, named_tensors

    plain = assemble(named_tensors(model.weights), model.config)  # the (K, N) matrices, however the loader keeps them
    logits = numpy_ref.forward(plain, model.config, ids[0].numpy(), hidden_states=blocks)
    return torch.from_numpy(logits)[None].float(), [torch.from_numpy(b)[None].float() for b in blocks]


def compare_outputs(name: str, engine: str, ids: torch.Tensor, ref: tuple[torch.Tensor, list[torch.Tensor]],
                    got: tuple[torch.Tensor, list[torch.Tensor]], rtol: float | None) -> Report:
    """Every figure of the report, for reference and engine outputs of one prompt (ids [T]).

    Within tolerance means: no logit and no block output differs by more than rtol x max |reference| (skipped when
    rtol is None; the narrow variants are judged over all prompts, by summarize()).
    """
    (ref_logits, ref_blocks), (logits, blocks) = ref, got
    diff = (logits - ref_logits).abs()[0]  # [T, V]
    scale = ref_logits.abs().max().item()
    log_p, log_q = torch.log_softmax(ref_logits[0].double(), -1), torch.log_softmax(logits[0].double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [T]
    top5_ref, top5 = ref_logits[0].topk(5, -1).indices, logits[0].topk(5, -1).indices  # [T, 5]
    overlap = (top5_ref[:, :, None] == top5[:, None, :]).any(-1).float().mean()

    first_block = first_position = None
    per_block = []
    for i, (a, b) in enumerate(zip(blocks, ref_blocks)):
        block_diff = (a - b).abs()[0]  # [T, C]
        per_block.append(block_diff.max().item())
        if rtol is None or first_block is not None:
            continue
        bad = (block_diff > rtol * b.abs().max().item()).any(-1)  # [T]
        if bool(bad.any()):
            first_block, first_position = i, int(bad.nonzero()[0])
    bad_logits = (diff > rtol * scale).any(-1) if rtol is not None else torch.zeros(0, dtype=torch.bool)
    if first_position is None and bool(bad_logits.any()):
        first_position = int(bad_logits.nonzero()[0])
    top1 = (ref_logits[0].argmax(-1) == logits[0].argmax(-1)).float().mean().item()
    token_nll_ref, token_nll = (-lp[:-1].gather(1, ids[1:, None])[:, 0] for lp in (log_p, log_q))  # [T - 1]
    nll_ref, nll = token_nll_ref.sum().item(), token_nll.sum().item()
    scored = ids.shape[0] - 1
    return Report(
        prompt=name, engine=engine, tokens=diff.shape[0], max_abs=diff.max().item(), mean_abs=diff.mean().item(),
        max_rel=diff.max().item() / scale, kl_max=max(kl.max().item(), 0.0),
        top1_agreement=top1, top5_overlap=overlap.item(), nll_reference=nll_ref, nll=nll,
        nll_change_sq=(token_nll - token_nll_ref).square().sum().item(),
        ppl_reference=math.exp(nll_ref / scored) if scored else math.nan, ppl=math.exp(nll / scored) if scored else math.nan,
        per_block_max_abs=per_block,
        first_divergent_block=first_block, first_divergent_position=first_position,
        passed=first_position is None)


def load_reference(directory: Path, lora: Path | None = None):
    """transformers' GPT2LMHeadModel on `directory`, float32, eval mode; with `lora`, wrapped by peft's PeftModel
    with that adapter (peft is then the reference for the adapter's arithmetic)."""
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise GPT2EngineError("transformers is not installed; it is the reference: pip install transformers") from None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).eval()
    except (OSError, ValueError, RuntimeError) as e:
        raise WeightsError(f"{directory}: transformers cannot load the reference ({one_line(e)})") from None
    if lora is None:
        return model
    try:
        from peft import PeftModel
    except ImportError:
        raise GPT2EngineError("peft is not installed; it is the reference for --lora: pip install peft") from None
    try:
        return PeftModel.from_pretrained(model, lora).eval()
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise WeightsError(f"{lora}: peft cannot load the adapter ({one_line(e)})") from None


@dataclass(frozen=True)
class Prompt:
    """A prompt to compare on, and where the user gave it, for an error ("" for the built-in prompts, which are cut
    to a smaller model's context)."""

    text: str
    given: str = ""


def collect_prompts(args: argparse.Namespace) -> dict[str, Prompt]:
    """The prompts by the names the table shows: --prompt's, the non-empty lines of --prompts-file, or the built-in
    ones; an empty --prompt is refused (it would compare <|endoftext|> alone, with no token to predict)."""
    prompts: dict[str, Prompt] = {}
    for i, text in enumerate(args.prompt or []):
        if not text:
            raise GPT2EngineError("--prompt is empty; expected at least one token")
        prompts[f"prompt{i + 1}"] = Prompt(text, f"--prompt {i + 1}")
    if args.prompts_file is not None:
        lines = read_text(args.prompts_file, sys.stdin.buffer, "--prompts-file").splitlines()
        numbered = [(n, text) for n, text in enumerate(lines, 1) if text.strip()]
        for i, (n, line) in enumerate(numbered):
            prompts[f"{args.prompts_file.name}:{i + 1}"] = Prompt(line, f"{args.prompts_file}, line {n}")
        if not prompts:
            raise GPT2EngineError(f"{args.prompts_file}: no prompts (expected one prompt per non-empty line)")
    return prompts or {name: Prompt(text) for name, text in {**BUILTIN_PROMPTS, "long": long_prompt()}.items()}


def prompt_ids(prompts: dict[str, Prompt], tokenizer: Tokenizer, n_positions: int) -> dict[str, list[int]]:
    """Each prompt's token ids, all checked before anything runs: a prompt the user gave that is longer than the
    context is refused, as gpt2 generate refuses it, rather than compared on its first tokens unsaid."""
    ids = {}
    for name, prompt in prompts.items():
        tokens = tokenizer.encode(prompt.text)
        if prompt.given and len(tokens) > n_positions:
            advice = "split it in two" if prompt.given.startswith("--prompt") else "split it across lines"
            raise GPT2EngineError(f"{prompt.given}: the prompt of {len(tokens)} tokens exceeds the context of "
                                  f"{n_positions} tokens; shorten it, or {advice}")
        ids[name] = prompt_or_endoftext(tokens[:n_positions], tokenizer.eot_id)
    return ids


@dataclass(frozen=True)
class Judgement:
    """How a comparison is judged: the engines checked, the variant (None: float32), each engine's tolerance on the
    logits (None: not judged alone), and the bounds over all prompts (None: none)."""

    engines: list[str]
    variant: str | None
    rtols: dict[str, float | None]
    min_top1: float | None
    max_change: float | None


def judgement_from_args(args: argparse.Namespace) -> Judgement:
    """The engines, variant and tolerances the flags ask for (the defaults of the variant where not given); a
    combination the NumPy reference or transformers cannot check is an error."""
    engines = ["torch", "numpy"] if args.engine == "all" else [args.engine]
    variant = args.quantize or (args.dtype if args.dtype != "float32" else None)
    check_checkable(args, engines, variant)
    check_bounds(args)
    rtols = {e: args.rtol if args.rtol is not None or variant else DEFAULT_RTOL[e] for e in engines}
    return Judgement(engines, variant, rtols, given_or(args.min_top1, DEFAULT_MIN_TOP1.get(variant or "")),
                     given_or(args.max_ppl_change, DEFAULT_MAX_PPL_CHANGE.get(variant or "")))


def check_checkable(args: argparse.Namespace, engines: list[str], variant: str | None) -> None:
    """Refuse what the references cannot check: a variant or an adapter on the NumPy reference (float32, no
    adapters), a checkpoint file (transformers reads a Hugging Face directory)."""
    if variant and engines != ["torch"]:
        raise GPT2EngineError("--dtype bfloat16 / --quantize apply to the torch engine; the NumPy reference is float32")
    if args.lora and engines != ["torch"]:
        raise GPT2EngineError("--lora applies to the torch engine; the NumPy reference has no adapters")
    if args.device != "cpu" and engines != ["torch"]:
        raise GPT2EngineError(f"--device {args.device} applies to the torch engine; the NumPy reference runs on "
                              "the CPU")
    if args.weights is not None and args.weights.is_file():
        raise GPT2EngineError(f"{args.weights}: gpt2 compare holds the engine to transformers, which reads a Hugging "
                              f"Face directory; convert the file first (gpt2 convert {args.weights} DIR --to hf)")


# The tolerances a user may set: (flag, attribute, whether a value is allowed, what it must be). A NaN would pass every
# comparison it takes part in, so a mismatch would pass.
BOUNDS = (("--rtol", "rtol", lambda v: 0 <= v < math.inf, "a finite number >= 0 (0: the same bits)"),
          ("--min-top1", "min_top1", lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
          ("--max-ppl-change", "max_ppl_change", lambda v: 0 <= v < math.inf, "a finite number >= 0 (a fraction: 0.01 is 1%)"))


def check_bounds(args: argparse.Namespace) -> None:
    for flag, name, allowed, must in BOUNDS:
        value = getattr(args, name)
        if value is not None and not allowed(value):
            raise GPT2EngineError(f"{flag} must be {must}, got {value}")


def given_or(value: float | None, default: float | None) -> float | None:
    return value if value is not None else default


def load_both(args: argparse.Namespace):
    """(the engine's model, transformers' reference, the reference's directory), checked to be the same shape."""
    from ..api import GPT2

    model = GPT2.from_pretrained(args.weights, dtype=args.dtype, quantize=args.quantize, lora=args.lora,
                                 force=args.force, device=args.device, runner=args.runner)
    reference_dir = args.reference or args.weights
    hf_model = load_reference(reference_dir, args.lora).to(model.device)  # transformers on the engine's device
    if hf_model.config.n_layer != model.config.n_layer or hf_model.config.n_embd != model.config.n_embd:
        raise WeightsError(f"{reference_dir}: the reference has another shape than {args.weights}")
    return model, hf_model, reference_dir


def compare_prompts(prompts: dict[str, Prompt], model, hf_model, judgement: Judgement) -> list[Report]:
    """One Report per prompt and engine: the reference runs once per prompt, each engine against it."""
    reports = []
    for name, ids in prompt_ids(prompts, model.tokenizer, model.config.n_positions).items():
        ids_t = torch.tensor([ids])
        ref = reference_outputs(hf_model, ids_t.to(model.device))
        for engine in judgement.engines:
            reports.append(compare_outputs(name, engine, ids_t[0], ref, engine_outputs(model, ids_t, engine),
                                           judgement.rtols[engine]))
    return reports


def print_total(total: dict, judgement: Judgement, default_prompts: bool) -> None:
    """The line over all prompts: top-1 agreement and the perplexity change, judged (and a note on the default
    prompts when the perplexity failed on them)."""
    low, high = total["ppl_change_range"]
    max_change = judgement.max_change
    print(f"over all prompts ({total['tokens']} tokens): top-1 agreement {total['top1_agreement']:.2%}, perplexity "
          f"{total['ppl_reference']:.4g} (transformers) -> {total['ppl']:.4g} (engine), {total['ppl_change']:+.3%}"
          + (f" ({low:+.2%} to {high:+.2%} at 2 standard errors)" if judgement.variant else "")
          + ("" if max_change is None else f" (allowed: +{max_change:.1%})")
          + ("" if total["passed"] else ": MISMATCH (" + "; ".join(total["failures"]) + ")"))
    if any("perplexity" in f for f in total["failures"]) and default_prompts:
        print("(the default prompts are English prose, code and Unicode, GPT-2's kind of text; a quantization's "
              "cost in perplexity depends on the text, and is larger where the model predicts it poorly: judge "
              "another model on text like its own, with --prompts-file)")


def run_compare(args: argparse.Namespace) -> int:
    judgement = judgement_from_args(args)
    prompts = collect_prompts(args)
    model, hf_model, reference_dir = load_both(args)
    reports = compare_prompts(prompts, model, hf_model, judgement)
    total = summarize(reports, judgement.min_top1, judgement.max_change)
    passed = all(r.passed for r in reports) and total["passed"]
    variant = judgement.variant or "float32"
    if args.json:
        print(json.dumps({"passed": passed, "weights": str(args.weights), "reference": str(reference_dir),
                          "variant": variant, "rtol": judgement.rtols, "min_top1": judgement.min_top1,
                          "max_ppl_change": judgement.max_change, "results": [asdict(r) for r in reports],
                          "total": total}, indent=2))
    else:
        print_table(reports, judgement.rtols, judgement.min_top1, judgement.max_change, variant, args.weights,
                    reference_dir)
        print_total(total, judgement, default_prompts=not args.prompt and args.prompts_file is None)
    return 0 if passed else 1


def summarize(reports: list[Report], min_top1: float | None, max_change: float | None) -> dict:
    """Token-weighted top-1 agreement and the perplexity of all prompts' predicted tokens, reference and engine;
    passed unless the agreement is below min_top1 or the relative perplexity change exceeds max_change. The change
    comes with its range at 2 standard errors of the mean per-token NLL change: whether the prompts are enough
    tokens to judge it."""
    tokens = sum(r.tokens for r in reports)
    top1 = sum(r.top1_agreement * r.tokens for r in reports) / tokens
    ppl_ref, ppl, change, band = perplexity_change(reports)
    failures = ([f"top-1 agreement {top1:.2%} < {min_top1:.1%}"] if min_top1 is not None and top1 < min_top1 else []) \
        + ([f"perplexity {change:+.3%} > +{max_change:.1%}"] if max_change is not None and change > max_change else [])
    return {"tokens": tokens, "top1_agreement": top1, "ppl_reference": ppl_ref, "ppl": ppl, "ppl_change": change,
            "ppl_change_range": band, "passed": not failures, "failures": failures}


def perplexity_change(reports: list[Report]) -> tuple[float, float, float, tuple[float, float]]:
    """(reference perplexity, engine perplexity, relative change, its range at 2 standard errors) over every
    prompt's predicted tokens; nan perplexities and no change when no token is predicted."""
    scored = sum(r.tokens - 1 for r in reports)
    if not scored:
        return math.nan, math.nan, 0.0, (0.0, 0.0)
    nll_ref, nll = sum(r.nll_reference for r in reports), sum(r.nll for r in reports)
    mean = (nll - nll_ref) / scored  # the mean per-token NLL change
    spread = math.sqrt(max(sum(r.nll_change_sq for r in reports) / scored - mean * mean, 0.0) / scored)
    return (math.exp(nll_ref / scored), math.exp(nll / scored), math.exp(mean) - 1,
            (math.expm1(mean - 2 * spread), math.expm1(mean + 2 * spread)))


def print_table(reports: list[Report], rtols: dict[str, float | None], min_top1: float | None,
                max_change: float | None, variant: str, weights: Path, reference: Path) -> None:
    """Each prompt's figures; a row is judged where a tolerance on the logits applies, else (bfloat16, int8, int4)
    it shows its perplexity change, and the line over all prompts judges."""
    rules = [f"max |diff| <= {r:g} x max |reference| ({e})" for e, r in rtols.items() if r is not None]
    rules += [f"top-1 agreement >= {min_top1:.1%} over all prompts"] if min_top1 is not None else []
    rules += [f"perplexity at most +{max_change:.1%} over all prompts"] if max_change is not None else []
    print(f"engine ({weights}, {variant}) vs transformers GPT2LMHeadModel ({reference}, float32); "
          f"tolerance: {'; '.join(rules)}")
    header = f"{'prompt':<14} {'engine':<6} {'tokens':>6} {'max_abs':>9} {'mean_abs':>9} {'max_rel':>9} " \
             f"{'kl_max':>9} {'top1':>7} {'top5':>7} {'worst block':>14}  result"
    print(header)
    print("-" * len(header))
    for r in reports:
        worst = int(np.argmax(r.per_block_max_abs)) if r.per_block_max_abs else 0
        result = row_result(r, rtols.get(r.engine) is not None)
        print(f"{r.prompt[:14]:<14} {r.engine:<6} {r.tokens:>6} {r.max_abs:>9.2e} {r.mean_abs:>9.2e} {r.max_rel:>9.2e} "
              f"{r.kl_max:>9.2e} {r.top1_agreement:>7.2%} {r.top5_overlap:>7.2%} "
              f"{worst:>3} ({r.per_block_max_abs[worst]:.1e})  {result}")
    if all(rtols.get(r.engine) is None for r in reports):
        return
    bad = [r for r in reports if not r.passed]
    print(f"{len(reports) - len(bad)} passed, {len(bad)} failed" if bad else f"all {len(reports)} comparisons within tolerance")


def row_result(r: Report, judged: bool) -> str:
    """A table row's verdict: ok, or where the mismatch starts; a row not judged alone (no tolerance on the logits:
    bfloat16, int8, int4) shows its share of the judgement over all prompts, its perplexity change."""
    if not judged:
        return f"ppl {math.expm1((r.nll - r.nll_reference) / max(r.tokens - 1, 1)):+.2%}"
    if r.passed:
        return "ok"
    if r.first_divergent_block is not None:
        return f"MISMATCH from block {r.first_divergent_block}, position {r.first_divergent_position}"
    return f"MISMATCH in logits at position {r.first_divergent_position}"


def add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="check the engine's logits against transformers",
                       description="Run the engine and transformers' GPT2LMHeadModel on the same token ids and report "
                                   "how far the logits and every block's output differ. Exit 0 within tolerance, 1 on a "
                                   "mismatch, 2 on a usage or load error.")
    add_weights_option(p)
    p.add_argument("--reference", type=Path, metavar="DIR", help="load the reference from another directory (default: --weights)")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt to compare on (repeatable)")
    p.add_argument("--prompts-file", type=Path, metavar="FILE", help="prompts, one per line")
    p.add_argument("--engine", choices=["torch", "numpy", "all"], default="torch", help="which engine to check (default torch)")
    p.add_argument("--rtol", type=float, metavar="R",
                   help="tolerance relative to max |reference| (default 1e-4 for torch, 1e-3 for numpy; "
                        "not applied to bfloat16 / int8 / int4 unless given)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="engine weights dtype (default float32; float16 on the torch runner)")
    add_device_options(p)
    p.add_argument("--quantize", choices=["int8", "int4"], help="check the engine with blockwise int8 or int4 weights")
    p.add_argument("--lora", type=Path, metavar="DIR",
                   help="check with a LoRA adapter (PEFT's format) applied; the reference is peft's PeftModel")
    add_force_option(p)
    p.add_argument("--min-top1", type=float, metavar="F",
                   help="for bfloat16 / int8 / int4: the top-1 agreement required over all prompts "
                        "(default 0.995 / 0.99 / 0.95)")
    p.add_argument("--max-ppl-change", type=float, metavar="F",
                   help="for bfloat16 / int8 / int4: the largest relative perplexity increase allowed over all "
                        "prompts (default 0.005 / 0.005 / 0.02)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.set_defaults(run=run_compare)
