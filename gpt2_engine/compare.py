"""`gpt2 compare`: the engine's logits against transformers' GPT2LMHeadModel, and where they part ways.

transformers is imported here only, as the reference; the engine never uses it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import GPT2EngineError, WeightsError
from .weights import DEFAULT_WEIGHTS

# Default tolerances, relative to max |reference|: measured errors are ~1e-6 (torch fp32) and ~1e-6 (NumPy).
DEFAULT_RTOL = {"torch": 1e-4, "numpy": 1e-3}

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
    return logits.float(), [b.float() for b in blocks]


def engine_outputs(model, ids: torch.Tensor, engine: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The engine's logits [1, T, V] and block outputs, from the torch engine or the NumPy reference."""
    blocks: list = []
    if engine == "torch":
        logits = model.forward(ids, hidden_states=blocks)
        return logits.float(), [b.float() for b in blocks]
    from . import numpy_ref

    logits = numpy_ref.forward(model.weights, model.config, ids[0].numpy(), hidden_states=blocks)
    return torch.from_numpy(logits)[None].float(), [torch.from_numpy(b)[None].float() for b in blocks]


def compare_outputs(name: str, engine: str, ref: tuple[torch.Tensor, list[torch.Tensor]],
                    got: tuple[torch.Tensor, list[torch.Tensor]], rtol: float) -> Report:
    """Every figure of the report, for reference and engine outputs of one prompt."""
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
        bad = (block_diff > rtol * b.abs().max().item()).any(-1)  # [T]
        if first_block is None and bool(bad.any()):
            first_block, first_position = i, int(bad.nonzero()[0])
    bad_logits = (diff > rtol * scale).any(-1)
    if first_position is None and bool(bad_logits.any()):
        first_position = int(bad_logits.nonzero()[0])
    return Report(
        prompt=name, engine=engine, tokens=diff.shape[0], max_abs=diff.max().item(), mean_abs=diff.mean().item(),
        max_rel=diff.max().item() / scale, kl_max=max(kl.max().item(), 0.0),
        top1_agreement=(ref_logits[0].argmax(-1) == logits[0].argmax(-1)).float().mean().item(),
        top5_overlap=overlap.item(), per_block_max_abs=per_block, first_divergent_block=first_block,
        first_divergent_position=first_position, passed=first_position is None)


def load_reference(directory: Path):
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise GPT2EngineError("transformers is not installed; it is the reference: pip install transformers") from None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        return GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).eval()
    except (OSError, ValueError, RuntimeError) as e:
        raise WeightsError(f"{directory}: transformers cannot load the reference ({' '.join(str(e).split())[:200]})") from None


def collect_prompts(args: argparse.Namespace) -> dict[str, str]:
    prompts: dict[str, str] = {}
    for i, text in enumerate(args.prompt or []):
        prompts[f"prompt{i + 1}"] = text
    if args.prompts_file is not None:
        try:
            lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise GPT2EngineError(f"cannot read prompts file {args.prompts_file}: {getattr(e, 'strerror', None) or e}") from None
        for i, line in enumerate(l for l in lines if l.strip()):
            prompts[f"{args.prompts_file.name}:{i + 1}"] = line
        if not prompts:
            raise GPT2EngineError(f"{args.prompts_file}: no prompts (expected one prompt per non-empty line)")
    return prompts or {**BUILTIN_PROMPTS, "long": long_prompt()}


def run_compare(args: argparse.Namespace) -> int:
    from .engine import GPT2

    engines = ["torch", "numpy"] if args.engine == "all" else [args.engine]
    prompts = collect_prompts(args)
    model = GPT2.from_pretrained(args.weights)
    reference_dir = args.reference or args.weights
    hf_model = load_reference(reference_dir)
    if hf_model.config.n_layer != model.config.n_layer or hf_model.config.n_embd != model.config.n_embd:
        raise WeightsError(f"{reference_dir}: the reference has another shape than {args.weights}")

    reports = []
    for name, text in prompts.items():
        ids = model.tokenizer.encode(text)[: model.config.n_positions] or [model.tokenizer.eot_id]
        ids_t = torch.tensor([ids])
        ref = reference_outputs(hf_model, ids_t)
        for engine in engines:
            rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[engine]
            reports.append(compare_outputs(name, engine, ref, engine_outputs(model, ids_t, engine), rtol))
    passed = all(r.passed for r in reports)
    rtols = {e: args.rtol if args.rtol is not None else DEFAULT_RTOL[e] for e in engines}
    if args.json:
        print(json.dumps({"passed": passed, "weights": str(args.weights), "reference": str(reference_dir),
                          "rtol": rtols, "results": [asdict(r) for r in reports]}, indent=2))
    else:
        print_table(reports, rtols, args.weights, reference_dir)
    return 0 if passed else 1


def print_table(reports: list[Report], rtols: dict[str, float], weights: Path, reference: Path) -> None:
    print(f"engine ({weights}) vs transformers GPT2LMHeadModel ({reference}), float32; "
          f"tolerance: max |diff| <= rtol x max |reference| with rtol " + ", ".join(f"{e} {r:g}" for e, r in rtols.items()))
    header = f"{'prompt':<14} {'engine':<6} {'tokens':>6} {'max_abs':>9} {'mean_abs':>9} {'max_rel':>9} " \
             f"{'kl_max':>9} {'top1':>7} {'top5':>7} {'worst block':>14}  result"
    print(header)
    print("-" * len(header))
    for r in reports:
        worst = int(np.argmax(r.per_block_max_abs)) if r.per_block_max_abs else 0
        result = "ok" if r.passed else (
            f"MISMATCH from block {r.first_divergent_block}, position {r.first_divergent_position}"
            if r.first_divergent_block is not None else f"MISMATCH in logits at position {r.first_divergent_position}")
        print(f"{r.prompt[:14]:<14} {r.engine:<6} {r.tokens:>6} {r.max_abs:>9.2e} {r.mean_abs:>9.2e} {r.max_rel:>9.2e} "
              f"{r.kl_max:>9.2e} {r.top1_agreement:>7.2%} {r.top5_overlap:>7.2%} "
              f"{worst:>3} ({r.per_block_max_abs[worst]:.1e})  {result}")
    bad = [r for r in reports if not r.passed]
    print(f"{len(reports) - len(bad)} passed, {len(bad)} failed" if bad else f"all {len(reports)} comparisons within tolerance")


def add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="check the engine's logits against transformers",
                       description="Run the engine and transformers' GPT2LMHeadModel on the same token ids and report "
                                   "how far the logits and every block's output differ. Exit 0 within tolerance, 1 on a "
                                   "mismatch, 2 on a usage or load error.")
    p.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS, metavar="DIR", help=f"checkpoint directory (default {DEFAULT_WEIGHTS}/)")
    p.add_argument("--reference", type=Path, metavar="DIR", help="load the reference from another directory (default: --weights)")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt to compare on (repeatable)")
    p.add_argument("--prompts-file", type=Path, metavar="FILE", help="prompts, one per line")
    p.add_argument("--engine", choices=["torch", "numpy", "all"], default="torch", help="which engine to check (default torch)")
    p.add_argument("--rtol", type=float, metavar="R",
                   help="tolerance relative to max |reference| (default 1e-4 for torch, 1e-3 for numpy)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.set_defaults(run=run_compare)
