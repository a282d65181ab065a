"""The hand-written attention backward against torch.autograd, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from gpt2_engine import GPT2
from gpt2_engine.core.backward import AttentionActivations, attention_backward, attention_forward_train
from gpt2_engine.core.model import attention_mask, causal_self_attention
from gpt2_engine.core.weights import Linear

RTOL = 1e-10


def autograd_attention(x, w_attn, b_attn, w_proj, b_proj, n_head, acts: AttentionActivations):
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
        if acts.att_keep is not None:
            att = att * acts.att_keep[:, h] / (1 - acts.p_attn)
        heads.append(att @ v)
    out = torch.cat(heads, dim=-1) @ w_proj + b_proj
    if acts.out_keep is not None:
        out = out * acts.out_keep / (1 - acts.p_resid)
    return out


def check_against_autograd(x, c_attn: Linear, c_proj: Linear, n_head: int, p: float, seed: int) -> None:
    out, acts = attention_forward_train(x, c_attn, c_proj, n_head, p_attn=p, p_resid=p,
                                        generator=torch.Generator().manual_seed(seed))
    grad_out = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    mine = attention_backward(grad_out, acts, c_attn, c_proj, n_head)

    leaves = [t.detach().clone().requires_grad_(True) for t in (x, c_attn.weight, c_attn.bias, c_proj.weight, c_proj.bias)]
    ref_out = autograd_attention(*leaves, n_head, acts)
    assert torch.allclose(ref_out, out, rtol=RTOL, atol=0), "forward differs from the autograd formulation"
    ref_out.backward(grad_out)
    found = [mine.x, mine.c_attn.weight, mine.c_attn.bias, mine.c_proj.weight, mine.c_proj.bias]
    for name, got, leaf in zip(["x", "c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"], found, leaves):
        err = (got - leaf.grad).abs().max().item()
        scale = leaf.grad.abs().max().item()
        assert err <= RTOL * scale, f"d{name}: max |diff| {err:.3g} > {RTOL} x {scale:.3g}"


def random_linear(n_in: int, n_out: int, g: torch.Generator) -> Linear:
    return Linear(torch.randn(n_in, n_out, dtype=torch.float64, generator=g) / math.sqrt(n_in),
                  torch.randn(n_out, dtype=torch.float64, generator=g) * 0.1)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("B, T, C, n_head", [(2, 7, 16, 4), (1, 1, 8, 2), (3, 33, 48, 6)])
def test_gradients_match_autograd_on_random_inputs(B: int, T: int, C: int, n_head: int, p: float) -> None:
    g = torch.Generator().manual_seed(B * 1000 + T)
    x = torch.randn(B, T, C, dtype=torch.float64, generator=g)
    check_against_autograd(x, random_linear(C, 3 * C, g), random_linear(C, C, g), n_head, p, seed=T)


def fixture_block(model: GPT2, layer: int) -> tuple[Linear, Linear]:
    blk = model.weights.blocks[layer]
    as64 = lambda p: Linear(p.weight.double(), p.bias.double())  # noqa: E731
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
    runs = [attention_forward_train(x, c_attn, c_proj, 4, p_attn=0.2, p_resid=0.3,
                                    generator=torch.Generator().manual_seed(42)) for _ in range(2)]
    (out_a, acts_a), (out_b, acts_b) = runs
    assert torch.equal(out_a, out_b) and torch.equal(acts_a.att_keep, acts_b.att_keep)
    other, _ = attention_forward_train(x, c_attn, c_proj, 4, p_attn=0.2, p_resid=0.3,
                                       generator=torch.Generator().manual_seed(43))
    assert not torch.equal(other, out_a)
    kept = acts_a.att_keep.double().mean().item()
    assert 0.7 < kept < 0.9  # about 1 - p_attn


def test_backward_is_causal() -> None:
    g = torch.Generator().manual_seed(1)
    T, C = 10, 16
    x = torch.randn(1, T, C, dtype=torch.float64, generator=g)
    c_attn, c_proj = random_linear(C, 3 * C, g), random_linear(C, C, g)
    _, acts = attention_forward_train(x, c_attn, c_proj, 4)
    for t in range(T):
        grad_out = torch.zeros(1, T, C, dtype=torch.float64)
        grad_out[0, t] = torch.randn(C, dtype=torch.float64, generator=g)
        dx = attention_backward(grad_out, acts, c_attn, c_proj, 4).x
        assert torch.count_nonzero(dx[0, t + 1 :]) == 0  # exactly zero: nothing after t influenced output t
        assert torch.count_nonzero(dx[0, : t + 1].abs().sum(-1)) == t + 1


def test_p_zero_is_exactly_the_inference_forward(model: GPT2) -> None:
    blk = model.weights.blocks[0]
    x = torch.randn(2, 20, model.config.n_embd, generator=torch.Generator().manual_seed(3))
    out, acts = attention_forward_train(x, blk.c_attn, blk.attn_c_proj, model.config.n_head)
    assert acts.att_keep is None and acts.out_keep is None
    expected = causal_self_attention(x, blk, model.config.n_head, attention_mask(20, 0, None, x.device), None, 0)
    assert torch.equal(out, expected)


def test_dropout_probability_is_checked() -> None:
    x = torch.zeros(1, 2, 8, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="dropout probability must be in \\[0, 1\\), got 1.0"):
        attention_forward_train(x, random_linear(8, 24, g), random_linear(8, 8, g), 2, p_attn=1.0)
