"""`gpt2 inspect`'s report: the numbers of one prompt (JSON), its pictures (PNG, matplotlib's Agg backend) and one
self-contained interactive HTML page. The numbers come from analysis.py; the PNGs and the page only draw them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..api import GPT2
from ..core.errors import GPT2EngineError
from .analysis import HEAD_KINDS, attribution, direct_logit_attribution, head_scores, logit_lens

MAX_TOKENS = 256  # every view draws every token (attention is T x T per head): longer prompts are unreadable
TOP_K = 5


@dataclass(frozen=True)
class ReportSettings:
    target: str | None = None  # a text that is one token; None: the model's most likely next token
    layers: tuple[int, ...] | None = None  # layers whose attention is drawn; None: all
    ig_steps: int = 32


def rounded(x: Any, digits: int = 5) -> Any:
    """Floats (in nested lists) to `digits` significant digits: the JSON stays small and readable."""
    if isinstance(x, list):
        return [rounded(v, digits) for v in x]
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else None
    return x


def token_texts(model: GPT2, ids: list[int]) -> list[str]:
    """Each token on its own (a token holding part of a UTF-8 character shows U+FFFD)."""
    return [model.tokenizer.token_text(i) for i in ids]


def resolve_target(model: GPT2, target: str | None, next_logits: torch.Tensor) -> tuple[int, str]:
    """(token id, how it was chosen): a text that encodes to exactly one token, or the argmax of the next token."""
    if target is None:
        return int(next_logits.argmax()), "most likely next token"
    ids = model.tokenizer.encode(target, allow_special=True)
    if len(ids) != 1:
        raise GPT2EngineError(f"--target {target!r} is {len(ids)} tokens {ids}; expected text that is exactly one token "
                              "(mind the leading space: ' Paris', not 'Paris')")
    return ids[0], "given"


def parse_indices(text: str, n: int, flag: str, what: str) -> tuple[int, ...]:
    """A comma list of indices and ranges ('0,3,5-7') within 0..n-1, sorted, each once; `flag` and `what` ("layers",
    "this SAE's features") name them in the one-line error."""
    found: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first > last:
                raise GPT2EngineError(f"{flag} {text!r}: the range {part.strip()} runs backwards; expected LOW-HIGH")
            if not 0 <= first <= last < n:  # before the range is made: '0-99999999999' would fill memory
                raise GPT2EngineError(f"{flag} {text!r}: {what} are 0..{n - 1}")
            found.update(range(first, last + 1))
    except ValueError:
        raise GPT2EngineError(f"{flag} {text!r}: expected 'all' or a list like '0,3,5-7'") from None
    return tuple(sorted(found))


def parse_layers(text: str, n_layer: int) -> tuple[int, ...] | None:
    """'all' (None), or a comma list of layers and ranges ('0,3,5-7') within 0..n_layer-1."""
    return None if text == "all" else parse_indices(text, n_layer, "--layers", "this model's layers")


def build_report(model: GPT2, prompt: str, settings: ReportSettings = ReportSettings()) -> dict[str, Any]:
    """Everything `gpt2 inspect` shows about one prompt, as plain JSON-ready values."""
    ids = model.tokenizer.encode(prompt, allow_special=True)
    if not ids:
        raise GPT2EngineError("the prompt is empty; expected at least one token")
    if len(ids) > min(MAX_TOKENS, model.config.n_positions):
        raise GPT2EngineError(f"the prompt is {len(ids)} tokens; gpt2 inspect draws every token and takes at most "
                              f"{min(MAX_TOKENS, model.config.n_positions)}")
    cfg = model.config
    layers = settings.layers if settings.layers is not None else tuple(range(cfg.n_layer))
    batch = torch.tensor([ids])  # [1, T]
    logits, cache = model.run_with_cache(batch)
    next_logits = logits[0, -1]  # [V]
    target, chosen = resolve_target(model, settings.target, next_logits)
    logprobs = next_logits - torch.logsumexp(next_logits.double(), -1).float()
    lens = logit_lens(cache, TOP_K, target)
    dla = direct_logit_attribution(cache, target)
    per_head = dla.by_layer_head(cfg.n_layer, cfg.n_head)[0, -1]  # [L, nh + 1]
    grad = attribution(model, ids, target, "grad_x_input")
    ig = attribution(model, ids, target, "integrated_gradients", steps=settings.ig_steps)
    return {
        "prompt": prompt,
        "tokens": token_texts(model, ids),
        "ids": ids,
        "model": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "dtype": str(model.dtype).removeprefix("torch."),
                  "quantize": model.quantize},
        "target": {"id": target, "text": model.tokenizer.token_text(target), "chosen": chosen,
                   "logprob": rounded(float(logprobs[target])), "rank": int((next_logits > next_logits[target]).sum()) + 1},
        "attention": {"layers": list(layers),
                      "patterns": rounded([cache[f"blocks.{i}.attn.hook_pattern"][0].tolist() for i in layers], 4)},
        "logit_lens": {"labels": lens.labels, "top_ids": lens.top_ids[:, 0].tolist(),
                       "top_tokens": [[token_texts(model, row) for row in layer] for layer in lens.top_ids[:, 0].tolist()],
                       "top_probs": rounded(lens.top_probs[:, 0].tolist(), 4), "target_prob": rounded(lens.token_probs[:, 0, -1].tolist(), 4)},
        "dla": {"labels": dla.labels, "values": rounded(dla.values[0, -1].tolist()),
                "per_head": rounded(per_head[:, : cfg.n_head].tolist()), "mlp": rounded(per_head[:, cfg.n_head].tolist()),
                "logit": rounded(float(dla.logit[0, -1])), "ln_f_bias_term": rounded(float(dla.ln_f_bias_term[0, -1]))},
        "attribution": {"grad_x_input": rounded(grad.values.tolist()), "integrated_gradients": rounded(ig.values.tolist()),
                        "ig_steps": ig.steps, "ig_completeness_error": rounded(ig.completeness_error),
                        "logprob": rounded(ig.f_input), "baseline_logprob": rounded(ig.f_baseline)},
        "head_scores": {kind: rounded(head_scores(model, kind).tolist(), 4) for kind in HEAD_KINDS},
    }



def html_page(report: dict[str, Any]) -> str:
    """The interactive page: report.html with the report's JSON inlined (every byte in one file, no CDN)."""
    template = (resources.files("gpt2_engine.inspect") / "report.html").read_text(encoding="utf-8")
    data = json.dumps(report, ensure_ascii=False).replace("</", "<\\/")  # a token '</script>' cannot end the block
    return template.replace("/*REPORT*/", data)


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the PNGs, report.html and report.json into `out` (created); return the paths written."""
    from .pictures import PICTURES

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GPT2EngineError(f"--out {out}: cannot create the directory: {e.strerror or e}") from None
    written = [draw(report, out / name) for name, draw in PICTURES.items()]
    for name, text in (("report.html", html_page(report)), ("report.json", json.dumps(report, ensure_ascii=False, indent=1))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text + "\n", encoding="utf-8")
        tmp.replace(out / name)  # a reader never sees half a file
        written.append(out / name)
    return written
