"""What the model thought of actual next tokens: their log-probabilities, ranks, entropies and alternatives, from
residual rows through the head (scoring, echoed prompt logprobs, the prefix cache's memo of them)."""

from __future__ import annotations

import torch

from ..core.config import GPT2Config
from ..core.model import logits
from ..interp.steering import SteeringTap
from ..core.weights import GPT2Weights
from .plan import TokenStats

HEAD_POSITIONS = 256  # positions sent through the head at once: [256, 50257] float32 logits are 51 MB


def token_stats(w: GPT2Weights, config: GPT2Config, x: torch.Tensor, targets: torch.Tensor, *, top: int = 0,
                details: bool = False, tap: SteeringTap | None = None) -> TokenStats:
    """Residual rows x [N, C] and next tokens targets [N] -> their log-probabilities under the full vocabulary,
    with the `top` most likely alternatives and their ranks, and (details) ranks and entropy. The head runs HEAD_POSITIONS
    rows at a time; `tap`: the rows' steering (at ln_final)."""
    parts = [stats_of(logits(w, config, x[i : i + HEAD_POSITIONS], head_tap(tap, i, min(i + HEAD_POSITIONS, x.shape[0]))),
                      targets[i : i + HEAD_POSITIONS], top, details)
             for i in range(0, x.shape[0], HEAD_POSITIONS)]
    return TokenStats.cat(parts)


def head_tap(tap: SteeringTap | None, lo: int, hi: int) -> SteeringTap | None:
    """The steering of rows [lo, hi) at the head (only ln_final's points can apply there)."""
    if tap is None or not any(p.startswith("ln_final.") for p in tap.points):
        return None
    return tap.select(torch.arange(lo, hi))


def prompt_stats(w: GPT2Weights, config: GPT2Config, x: torch.Tensor, targets: torch.Tensor, *, top: int = 0,
                 details: bool = False, tap: SteeringTap | None = None) -> tuple[TokenStats, torch.Tensor]:
    """A prompt's residual rows x [N + 1, C] -> (token_stats of rows 0..N-1 for targets [N], the logits [V] after
    the last row): one pass of the head over every row, which a prefill of a few new tokens is dominated by."""
    n, parts = targets.shape[0], []
    for i in range(0, n + 1, HEAD_POSITIONS):
        lg = logits(w, config, x[i : i + HEAD_POSITIONS], head_tap(tap, i, min(i + HEAD_POSITIONS, n + 1)))  # [m, V]
        scored = min(lg.shape[0], n - i)  # the chunk's rows that have a target (all but the very last row)
        parts.append(stats_of(lg[:scored], targets[i : i + scored], top, details))
    return TokenStats.cat(parts), lg[-1]


def stats_of(lg: torch.Tensor, targets: torch.Tensor, top: int, details: bool) -> TokenStats:
    """Logits [n, V] and their targets [n] -> TokenStats (n may be 0), on the CPU whatever device the logits are on."""
    targets = targets.to(lg.device)
    lse = torch.logsumexp(lg, dim=-1, keepdim=True)  # [n, 1]
    chosen = lg.gather(-1, targets[:, None])  # [n, 1]
    part = TokenStats((chosen - lse)[:, 0])
    if details or top:
        part.rank = (lg > chosen).sum(-1)  # [n]
    if details:
        lg64 = lg.double()  # a float32 sum over 50,257 terms is off by ~1e-4 nats; float64 is exact enough
        part.entropy = (torch.logsumexp(lg64, -1) - (torch.softmax(lg64, -1) * lg64).sum(-1)).float()  # lse - E[l]
    if top:
        values, part.top_ids = lg.topk(top, dim=-1)  # [n, top]
        part.top_logprobs = values - lse
    if lg.device.type != "cpu":  # the torch runner's GPU: a few numbers a token come back
        part = TokenStats(*(None if t is None else t.cpu() for t in (part.logprob, part.rank, part.entropy,
                                                                      part.top_ids, part.top_logprobs)))
    return part
