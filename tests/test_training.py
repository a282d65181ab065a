"""The hand-written training step (train/step.py) against transformers' GPT2LMHeadModel under torch.autograd:
the same weights, batch and dropout masks; every parameter's gradient compared, as llm.c's test_gpt2.c does, with
the tensor and the worst element named on failure."""

from __future__ import annotations

import math
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from gpt2_engine.core.config import GPT2Config
from gpt2_engine.core.model import query_blocks
from gpt2_engine.core.weights import GPT2Weights, assemble, named_tensors
from gpt2_engine.train.step import Buffers, forward_loss, initial_weights, trainable_copy, zeros_like

TINY = GPT2Config(vocab_size=101, n_positions=320, n_embd=16, n_layer=2, n_head=4)


def hf_model(w: GPT2Weights, config: GPT2Config, dtype: torch.dtype, dropout: float):
    """transformers' GPT2LMHeadModel holding copies of `w` (eager attention, so that every dropout is F.dropout)."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    hf = HFConfig(vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
                  n_layer=config.n_layer, n_head=config.n_head, attn_pdrop=dropout, embd_pdrop=dropout,
                  resid_pdrop=dropout)
    hf._attn_implementation = "eager"
    model = GPT2LMHeadModel(hf).to(dtype).train()
    state = {"transformer." + k: v.clone() for k, v in named_tensors(w).items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(".attn.bias" in k or "masked_bias" in k for k in missing), (missing, unexpected)
    return model


@contextmanager
def fed_dropout(masks: list[torch.Tensor]):
    """Every F.dropout call inside (transformers' embedding, attention and residual dropouts, in the order the engine
    draws them) multiplies by the next of `masks` instead of drawing its own."""
    queue = list(masks)

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        return x * queue.pop(0)

    with mock.patch("torch.nn.functional.dropout", dropout):
        yield
    assert not queue, f"{len(queue)} dropout masks left unused"


def engine_masks(buf: Buffers) -> list[torch.Tensor]:
    """The masks the engine drew, in its order, as full tensors (the attention's from its causal blocks; the
    entries above the diagonal, which the engine never draws, meet weights that are 0 on both sides)."""
    if buf.embed_keep is None:
        return []
    masks = [buf.embed_keep]
    for a in buf.layers:
        B, nh, _, T = a.att_keep[-1].shape
        full = torch.zeros(B, nh, T, T, dtype=a.att_keep[0].dtype)
        for (i, j, _), keep in zip(query_blocks(T, T), a.att_keep):
            full[:, :, i:j, :j] = keep
        masks += [full, a.attn_keep, a.mlp_keep]
    return [m.clone() for m in masks]


def compare(w: GPT2Weights, config: GPT2Config, ids: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
            dropout: float, rel: float, loss_rel: float, head_rows: int = 512) -> None:
    B, T = ids.shape
    buf = Buffers.allocate(config, B, T, dropout, dtype, head_rows=head_rows)
    grads = zeros_like(w, config)
    loss = forward_loss(w, config, buf, ids, targets, grads=grads, generator=torch.Generator().manual_seed(7))

    model = hf_model(w, config, dtype, dropout)
    with fed_dropout(engine_masks(buf)):
        logits = model(ids).logits  # [B, T, V]
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-1, reduction="sum")
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= loss_rel * abs(ref_loss.item()), (loss, ref_loss.item())
    ref = {k.removeprefix("transformer."): p.grad for k, p in model.named_parameters()}
    for name, g in named_tensors(grads).items():
        r = ref[name]
        diff = (g - r).abs()
        scale = r.abs().max().item()
        worst = divmod(int(diff.argmax()), r.shape[-1]) if r.dim() == 2 else int(diff.argmax())
        assert diff.max().item() <= rel * scale, (f"{name}: max |diff| {diff.max().item():.3g} at {worst} "
                                                  f"> {rel} x max |grad| {scale:.3g}")


def random_batch(config: GPT2Config, B: int, T: int, seed: int, unscored: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (B, T + 1), generator=g)
    targets = ids[:, 1:].clone()
    if unscored:
        targets[-1, -unscored:] = -1
    return ids[:, :-1].contiguous(), targets


def tiny_weights(seed: int, dtype: torch.dtype) -> GPT2Weights:
    """GPT-2's initialisation with larger values, so that every path carries a gradient well above rounding."""
    w = initial_weights(TINY, torch.Generator().manual_seed(seed), dtype)
    g = torch.Generator().manual_seed(seed + 1)
    named = {k: t + 0.3 * torch.randn(t.shape, generator=g, dtype=dtype) for k, t in named_tensors(w).items()}
    return assemble(named, TINY)


@pytest.mark.parametrize("dropout", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("B, T, unscored", [(2, 7, 0), (3, 32, 5), (1, 1, 0), (2, 300, 7)])
def test_every_gradient_matches_autograd_in_float64(B: int, T: int, unscored: int, dropout: float) -> None:
    ids, targets = random_batch(TINY, B, T, seed=T, unscored=unscored)
    compare(tiny_weights(B, torch.float64), TINY, ids, targets, torch.float64, dropout, rel=1e-10, loss_rel=1e-12,
            head_rows=5)  # 5 rows a chunk: the head's row chunks, and a last short one, are exercised


@pytest.mark.parametrize("which", [pytest.param("small", marks=pytest.mark.slow), pytest.param("trained", marks=pytest.mark.trained)])
def test_gradients_match_autograd_in_float32_on_the_fixtures(which: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue("model" if which == "small" else "trained_model")
    config = model.config
    w = trainable_copy(model.weights, config)
    ids, targets = random_batch(config, 2, 24, seed=3)
    # the summed loss of 48 tokens: 1.16e-6 apart with torch's AVX2 kernels in the reference (make test-avx2), under
    # 1e-6 with its AVX-512 ones
    compare(w, config, ids, targets, torch.float32, 0.0, rel=1e-4, loss_rel=4e-6)


def test_initialisation_follows_gpt2() -> None:
    config = GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    named = named_tensors(initial_weights(config, torch.Generator().manual_seed(0)))
    assert torch.equal(named["h.0.ln_1.weight"], torch.ones(64)) and torch.equal(named["ln_f.bias"], torch.zeros(64))
    assert torch.equal(named["h.3.mlp.c_fc.bias"], torch.zeros(256))
    assert named["wte.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert named["h.2.attn.c_attn.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert named["h.5.mlp.c_proj.weight"].std().item() == pytest.approx(0.02 / math.sqrt(12), rel=0.05)
