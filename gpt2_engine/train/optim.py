"""AdamW as GPT-2 and nanoGPT train with it, global-norm gradient clipping, and the learning-rate schedule.

One update, for parameter p with gradient g at step t (1-based), as torch.optim.AdamW computes it:
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p = p - lr * wd * p                                   (decoupled weight decay, only where `decay` says)
    p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.kernels import training_kernels


@dataclass(frozen=True)
class AdamWSettings:
    beta1: float = 0.9
    beta2: float = 0.95  # nanoGPT's and GPT-3's; torch's default is 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, got {self.eps} and {self.weight_decay}")


class AdamW:
    """The optimizer's state: both moments of every parameter (allocated once) and the step count."""

    def __init__(self, params: dict[str, torch.Tensor], decay: set[str], settings: AdamWSettings,
                 native: bool = True) -> None:
        self.params = params
        self.decay = decay  # names of the parameters that weight decay applies to
        self.settings = settings
        self.m = {n: torch.zeros_like(p) for n, p in params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in params.items()}
        self.steps = 0
        self.kernels = training_kernels() if native else None

    def step(self, grads: dict[str, torch.Tensor], lr: float, grad_scale: float = 1.0) -> None:
        """One update of every parameter in place from grad_scale * grads (the clipping factor folded in)."""
        s = self.settings
        self.steps += 1
        bias1 = 1 - s.beta1 ** self.steps
        bias2 = 1 - s.beta2 ** self.steps
        for name, p in self.params.items():
            wd = s.weight_decay if name in self.decay else 0.0
            m, v, g = self.m[name], self.v[name], grads[name]
            if self.kernels is not None and p.dtype == torch.float32 and p.is_contiguous():
                self.kernels.adamw(p, g, m, v, lr, s.beta1, s.beta2, s.eps, wd, bias1, bias2, grad_scale)
            else:
                adamw_reference(p, g, m, v, lr, s.beta1, s.beta2, s.eps, wd, bias1, bias2, grad_scale)

    def state(self) -> dict[str, torch.Tensor]:
        """The moments under `m.NAME` / `v.NAME`, for a training-state file."""
        return {**{"m." + n: t for n, t in self.m.items()}, **{"v." + n: t for n, t in self.v.items()}}

    def load_state(self, tensors: dict[str, torch.Tensor], steps: int) -> None:
        """Restore what state() returned (shapes checked by the caller's accounting)."""
        for n in self.params:
            self.m[n].copy_(tensors["m." + n])
            self.v[n].copy_(tensors["v." + n])
        self.steps = steps


def adamw_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, beta1: float,
                    beta2: float, eps: float, wd: float, bias1: float, bias2: float, grad_scale: float) -> None:
    """One AdamW update in torch ops (the native kernel's reference; the module docstring has the formula)."""
    if grad_scale != 1.0:
        g = g * grad_scale
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if wd:
        p.mul_(1 - lr * wd)
    denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bias1)


def clip_factor(grads: dict[str, torch.Tensor], max_norm: float | None) -> tuple[float, float]:
    """(the global L2 norm of all gradients, the factor that brings it down to max_norm): torch's
    clip_grad_norm_ rule, min(1, max_norm / (norm + 1e-6)); factor 1 without clipping."""
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(g)) ** 2 for g in grads.values()))
    if max_norm is None or not math.isfinite(norm):
        return norm, 1.0
    return norm, min(1.0, max_norm / (norm + 1e-6))


def learning_rate(step: int, total: int, lr: float, min_lr: float, warmup: int) -> float:
    """The rate for update `step` (0-based) of `total`: linear warmup over `warmup` updates, then cosine decay
    from lr to min_lr at the last update (nanoGPT's schedule)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)
