"""The hand-written attention layer (train/backward.py) against torch.autograd, in float64; the whole model's
backward is tests/test_training.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from gpt2_engine import GPT2
from gpt2_engine.core.model import BlockCall, attention_mask, causal_self_attention, query_blocks
from gpt2_engine.core.projection import as_float32
from gpt2_engine.core.weights import Linear
from gpt2_engine.train.backward import (
    attention_backward,
    attention_buffers,
    attention_forward,
    draw_keep,
    linear_backward,
    linear_forward,
)

RTOL = 1e-10


@dataclass
class AttentionRun:
    """One attention layer run through train/backward.py's functions on buffers of its own."""

    out: torch.Tensor  # [B, T, C]
    heads: torch.Tensor
    att: tuple[torch.Tensor, ...]  # by causal block
    att_keep: tuple[torch.Tensor, ...] | None
    out_keep: torch.Tensor | None
    y: torch.Tensor
    p: float


def attention_forward_train(x, c_attn: Linear, c_proj: Linear, n_head: int, p: float = 0.0,
                            generator: torch.Generator | None = None) -> AttentionRun:
    B, T, C = x.shape
    new = lambda *shape: torch.zeros(shape, dtype=x.dtype)  # noqa: E731
    qkv, att, y = new(B, T, 3 * C), attention_buffers(B, n_head, T, x.dtype), new(B, T, C)
    heads = new(3, B, n_head, T, C // n_head)
    att_keep, out_keep, dropped = ((attention_buffers(B, n_head, T, x.dtype), new(B, T, C), new(B * n_head * T * T))
                                   if p else (None, None, None))
    linear_forward(x.view(-1, C), c_attn, qkv.view(-1, 3 * C))
    for keep in att_keep or ():
        draw_keep(keep, p, generator)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    attention_forward(qkv, n_head, heads, att, att_keep, future, y, dropped)
    out = new(B * T, C)
    linear_forward(y.view(-1, C), c_proj, out)
    draw_keep(out_keep, p, generator)
    out = out.view(B, T, C) if out_keep is None else out.view(B, T, C) * out_keep
    return AttentionRun(out, heads, att, att_keep, out_keep, y, p)


def attention_backward_run(grad_out, run: AttentionRun, x, c_attn: Linear, c_proj: Linear, n_head: int):
    """(dx, dc_attn, dc_proj) from dL/d out, by train/backward.py's functions."""
    B, T, C = x.shape
    new = lambda *shape: torch.zeros(shape, dtype=x.dtype)  # noqa: E731
    g_attn, g_proj = Linear(new(C, 3 * C), new(3 * C)), Linear(new(C, C), new(C))
    d_out = grad_out if run.out_keep is None else grad_out * run.out_keep
    d_y, d_qkv, d_x = new(B * T, C), new(B, T, 3 * C), new(B * T, C)
    linear_backward(d_out.reshape(-1, C), run.y.view(-1, C), c_proj, g_proj, d_y)
    dropped = None if run.att_keep is None else new(B * n_head * T * T)
    attention_backward(d_y.view(B, T, C), run.heads, run.att, run.att_keep, n_head, d_qkv, new(B * n_head * T * T),
                       new(3, B, n_head, T, C // n_head), new(B, n_head, T, C // n_head), dropped)
    linear_backward(d_qkv.view(-1, 3 * C), x.reshape(-1, C), c_attn, g_attn, d_x)
    return d_x.view(B, T, C), g_attn, g_proj


def autograd_attention(x, w_attn, b_attn, w_proj, b_proj, n_head, run: AttentionRun):
    """An independent autograd formulation: per-head loops, the same dropout masks as the forward kept."""
    B, T, C = x.shape
    hs = C // n_head
    qkv = x @ w_attn + b_attn
    heads = []
    for h in range(n_head):
        q = qkv[..., h * hs : (h + 1) * hs]
        k = qkv[..., C + h * hs : C + (h + 1) * hs]
        v = qkv[..., 2 * C + h * hs : 2 * C + (h + 1) * hs]
        scores = q @ k.transpose(-2, -1) / math.sqrt(hs)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        att = torch.softmax(scores, dim=-1)
        if run.att_keep is not None:
            att = att * full_mask(run.att_keep, T)[:, h]
        heads.append(att @ v)
    out = torch.cat(heads, dim=-1) @ w_proj + b_proj
    if run.out_keep is not None:
        out = out * run.out_keep
    return out


def full_mask(blocks: tuple[torch.Tensor, ...], T: int) -> torch.Tensor:
    """[B, nh, T, T] from the per-block masks (0 above the diagonal, where the weights are 0 anyway)."""
    full = torch.zeros(*blocks[0].shape[:2], T, T, dtype=blocks[0].dtype)
    for (i, j, _), keep in zip(query_blocks(T, T), blocks):
        full[:, :, i:j, :j] = keep
    return full


def check_against_autograd(x, c_attn: Linear, c_proj: Linear, n_head: int, p: float, seed: int) -> None:
    run = attention_forward_train(x, c_attn, c_proj, n_head, p, generator=torch.Generator().manual_seed(seed))
    grad_out = torch.randn(run.out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    d_x, g_attn, g_proj = attention_backward_run(grad_out, run, x, c_attn, c_proj, n_head)

    leaves = [t.detach().clone().requires_grad_(True) for t in (x, c_attn.weight, c_attn.bias, c_proj.weight, c_proj.bias)]
    ref_out = autograd_attention(*leaves, n_head, run)
    assert torch.allclose(ref_out, run.out, rtol=RTOL, atol=0), "forward differs from the autograd formulation"
    ref_out.backward(grad_out)
    found = [d_x, g_attn.weight, g_attn.bias, g_proj.weight, g_proj.bias]
    for name, got, leaf in zip(["x", "c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"], found, leaves):
        err = (got - leaf.grad).abs().max().item()
        scale = leaf.grad.abs().max().item()
        assert err <= RTOL * scale, f"d{name}: max |diff| {err:.3g} > {RTOL} x {scale:.3g}"


def random_linear(n_in: int, n_out: int, g: torch.Generator) -> Linear:
    return Linear(torch.randn(n_in, n_out, dtype=torch.float64, generator=g) / math.sqrt(n_in),
                  torch.randn(n_out, dtype=torch.float64, generator=g) * 0.1)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("B, T, C, n_head", [(2, 7, 16, 4), (1, 1, 8, 2), (3, 33, 48, 6), (1, 261, 16, 2)])
def test_gradients_match_autograd_on_random_inputs(B: int, T: int, C: int, n_head: int, p: float) -> None:
    g = torch.Generator().manual_seed(B * 1000 + T)
    x = torch.randn(B, T, C, dtype=torch.float64, generator=g)
    check_against_autograd(x, random_linear(C, 3 * C, g), random_linear(C, C, g), n_head, p, seed=T)


def fixture_block(model: GPT2, layer: int) -> tuple[Linear, Linear]:
    blk = model.weights.blocks[layer]
    as64 = lambda p: Linear(as_float32(p.weight).double(), p.bias.double())  # noqa: E731 (panels on some CPUs)
    return as64(blk.c_attn), as64(blk.attn_c_proj)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gradients_match_autograd_on_a_fixture_block(model: GPT2, p: float) -> None:
    c_attn, c_proj = fixture_block(model, 3)
    x = torch.randn(2, 16, model.config.n_embd, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    check_against_autograd(x, c_attn, c_proj, model.config.n_head, p, seed=5)


def test_dropout_masks_are_reproducible_with_a_seeded_generator() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=g)
    c_attn, c_proj = random_linear(16, 48, g), random_linear(16, 16, g)
    a, b = (attention_forward_train(x, c_attn, c_proj, 4, 0.2, torch.Generator().manual_seed(42)) for _ in range(2))
    assert torch.equal(a.out, b.out) and all(torch.equal(m, n) for m, n in zip(a.att_keep, b.att_keep))
    other = attention_forward_train(x, c_attn, c_proj, 4, 0.2, torch.Generator().manual_seed(43))
    assert not torch.equal(other.out, a.out)
    kept = (a.att_keep[0] > 0).double().mean().item()
    assert 0.75 < kept < 0.85  # about 1 - p over 2 x 4 x 9 x 9 entries
    assert set(a.att_keep[0].unique().tolist()) == {0.0, 1 / 0.8}  # inverted dropout: kept entries scaled by 1 / (1 - p)


def test_backward_is_causal() -> None:
    g = torch.Generator().manual_seed(1)
    T, C = 10, 16
    x = torch.randn(1, T, C, dtype=torch.float64, generator=g)
    c_attn, c_proj = random_linear(C, 3 * C, g), random_linear(C, C, g)
    run = attention_forward_train(x, c_attn, c_proj, 4)
    for t in range(T):
        grad_out = torch.zeros(1, T, C, dtype=torch.float64)
        grad_out[0, t] = torch.randn(C, dtype=torch.float64, generator=g)
        dx = attention_backward_run(grad_out, run, x, c_attn, c_proj, 4)[0]
        assert torch.count_nonzero(dx[0, t + 1 :]) == 0  # exactly zero: nothing after t influenced output t
        assert torch.count_nonzero(dx[0, : t + 1].abs().sum(-1)) == t + 1


def test_p_zero_is_the_inference_forward(model: GPT2) -> None:
    blk = model.weights.blocks[0]
    x = torch.randn(2, 20, model.config.n_embd, generator=torch.Generator().manual_seed(3))
    run = attention_forward_train(x, blk.c_attn, blk.attn_c_proj, model.config.n_head)
    assert run.att_keep is None and run.out_keep is None
    expected = causal_self_attention(x, blk, model.config.n_head, BlockCall(mask=attention_mask(20, 0, None, x.device)))
    # Once bit-equal; the training forward's softmax is now written out in place (max, exp, divide) where the
    # inference one is torch's fused kernel: they differ by rounding, measured 2.6e-7 of the largest output here
    assert (run.out - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


def test_gelu_backward_is_its_written_out_derivative() -> None:
    from gpt2_engine.train.backward import gelu_backward, gelu_backward_reference

    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-14), (torch.float32, 2e-6)):
        x = torch.randn(64, 96, generator=g, dtype=dtype) * 4
        d = torch.randn(64, 96, generator=g, dtype=dtype)
        fast, ref = torch.empty_like(x), torch.empty_like(x)
        gelu_backward(d, x, fast)
        gelu_backward_reference(d, x, ref)
        assert (fast - ref).abs().max().item() <= tol * ref.abs().max().item()
        xs = x.clone().requires_grad_(True)  # and both are the derivative autograd finds
        torch.nn.functional.gelu(xs, approximate="tanh").backward(d)
        assert (ref - xs.grad).abs().max().item() <= tol * xs.grad.abs().max().item()
