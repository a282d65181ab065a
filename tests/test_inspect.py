"""Inspection: hook points on the engine's own forward (run_with_cache / run_with_hooks), checked against
transformers' hidden states and eager attention weights, and the analyses built on them (logit lens, direct logit
attribution, gradient attribution, head detectors), on the full-size random fixture and the trained checkpoint."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from conftest import engine, reference

from gpt2_engine import GPT2
from gpt2_engine.core.errors import GPT2EngineError
from gpt2_engine.interp.hooks import hook_names
from gpt2_engine.core.model import forward
from gpt2_engine.core.projection import as_float32
from gpt2_engine.inspect import attribution, direct_logit_attribution, head_scores, lens_logits, logit_lens

PROMPT = "Return a new file object, and close the file when it is done. If the file is"


def ids_of(model: GPT2, text: str = PROMPT) -> torch.Tensor:
    return torch.tensor([model.tokenizer.encode(text)])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error relative to the tensor's scale."""
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=["small", "trained"])
def pair(request, small_dir: Path, trained_dir: Path):
    """(engine, transformers with eager attention) on the full-size fixture and on the trained checkpoint."""
    directory = small_dir if request.param == "small" else trained_dir
    return engine(directory), reference(directory, attn_implementation="eager")


def test_cache_equals_transformers_hidden_states_and_attentions(pair) -> None:
    model, hf = pair
    ids = torch.cat([ids_of(model), ids_of(model, PROMPT[::-1])[:, : ids_of(model).shape[1]]])  # [2, T]
    logits, cache = model.run_with_cache(ids)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True, output_attentions=True)
    L = model.config.n_layer
    assert relative_error(cache["blocks.0.hook_resid_pre"], out.hidden_states[0]) < 1e-6
    for i in range(L - 1):
        assert relative_error(cache[f"blocks.{i}.hook_resid_post"], out.hidden_states[i + 1]) < 1e-5, i
    # transformers' last hidden state already has ln_f applied: it is the engine's ln_final output
    assert relative_error(cache["ln_final.hook_normalized"], out.hidden_states[L]) < 1e-5
    for i in range(L):
        assert relative_error(cache[f"blocks.{i}.attn.hook_pattern"], out.attentions[i]) < 1e-5, i
    assert relative_error(logits, out.logits) < 1e-5


# 5 rows: the native decode kernels; 300: blocked attention
@pytest.mark.parametrize("length", [5, pytest.param(300, marks=pytest.mark.slow)])
def test_cached_logits_are_the_plain_forward_bits(model: GPT2, length: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
    plain = model(ids)
    logits, cache = model.run_with_cache(ids)
    assert torch.equal(logits, plain)
    assert list(cache) == hook_names(model.config)  # every hook point, in forward order
    assert torch.equal(lens_logits(cache, model.config.n_layer), plain)  # the logit lens' last layer is the model
    only, small = model.run_with_cache(ids, ["blocks.3.attn.hook_pattern", "ln_final.hook_scale"])
    assert torch.equal(only, plain) and list(small) == ["blocks.3.attn.hook_pattern", "ln_final.hook_scale"]
    assert torch.equal(small["blocks.3.attn.hook_pattern"], cache["blocks.3.attn.hook_pattern"])


def test_hook_points_have_transformerlens_shapes(trained_model: GPT2) -> None:
    cfg = trained_model.config
    B, T, C, nh, hs = 2, 7, cfg.n_embd, cfg.n_head, cfg.head_size
    _, cache = trained_model.run_with_cache(torch.randint(0, 5000, (B, T), generator=torch.Generator().manual_seed(0)))
    expected = {"hook_embed": [B, T, C], "hook_pos_embed": [B, T, C], "ln_final.hook_scale": [B, T, 1],
                "ln_final.hook_normalized": [B, T, C]}
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        expected |= {p + n: [B, T, C] for n in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out",
                                                 "hook_mlp_out", "ln1.hook_normalized", "ln2.hook_normalized")}
        expected |= {p + f"attn.hook_{n}": [B, T, nh, hs] for n in "qkvz"}
        expected |= {p + "attn.hook_attn_scores": [B, nh, T, T], p + "attn.hook_pattern": [B, nh, T, T],
                     p + "mlp.hook_pre": [B, T, 4 * C], p + "mlp.hook_post": [B, T, 4 * C],
                     p + "ln1.hook_scale": [B, T, 1], p + "ln2.hook_scale": [B, T, 1]}
    assert {name: list(t.shape) for name, t in cache.items()} == expected
    # the pieces fit together as the model's equations say
    p = "blocks.1."
    assert torch.allclose(cache[p + "hook_resid_mid"], cache[p + "hook_resid_pre"] + cache[p + "hook_attn_out"])
    assert torch.allclose(cache[p + "attn.hook_pattern"].sum(-1), torch.ones(B, nh, T))
    x = cache[p + "hook_resid_pre"]
    assert torch.allclose(cache[p + "ln1.hook_scale"], (x.var(-1, keepdim=True, unbiased=False) + 1e-5).sqrt())


def test_zeroing_a_heads_z_equals_removing_the_head_by_hand(trained_model: GPT2) -> None:
    model, layer, head = trained_model, 2, 1
    hs = model.config.head_size
    ids = ids_of(model)

    def ablate(z: torch.Tensor, name: str) -> torch.Tensor:
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    patched = model.run_with_hooks(ids, {f"blocks.{layer}.attn.hook_z": ablate})
    # by hand: the head's rows of c_proj set to zero, the rest of the checkpoint unchanged
    blk = model.weights.blocks[layer]
    w_o = as_float32(blk.attn_c_proj.weight).clone()  # the (C, C) matrix, whichever layout this CPU keeps
    w_o[head * hs : (head + 1) * hs] = 0.0
    blocks = list(model.weights.blocks)
    blocks[layer] = dataclasses.replace(blk, attn_c_proj=dataclasses.replace(blk.attn_c_proj, weight=w_o))
    by_hand = forward(dataclasses.replace(model.weights, blocks=tuple(blocks)), model.config, ids)
    torch.testing.assert_close(patched, by_hand, rtol=0, atol=1e-5)
    assert (patched - model(ids)).abs().max() > 1e-2  # the head mattered


def test_patching_the_clean_residual_restores_the_clean_logits(trained_model: GPT2) -> None:
    model = trained_model
    clean_ids = ids_of(model)
    corrupt_ids = clean_ids.clone()
    corrupt_ids[0, 3] = model.tokenizer.encode(" dog")[0]
    clean, cache = model.run_with_cache(clean_ids)
    assert (model(corrupt_ids) - clean).abs().max() > 0.1
    for name in ("blocks.2.hook_resid_pre", f"blocks.{model.config.n_layer - 1}.hook_resid_post"):
        restored = model.run_with_hooks(corrupt_ids, {name: lambda x, n: cache[n]})
        assert torch.equal(restored, clean), name
    # a look-only hook changes nothing
    seen = []
    assert torch.equal(model.run_with_hooks(clean_ids, {"blocks.0.hook_mlp_out": lambda x, n: seen.append(n)}), clean)
    assert seen == ["blocks.0.hook_mlp_out"]


def test_left_padded_rows_equal_their_prompts_alone(trained_model: GPT2) -> None:
    model = trained_model
    prompts = [model.tokenizer.encode(PROMPT), model.tokenizer.encode("Close the file.")]
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[model.tokenizer.eot_id] * (T - len(p)) + p for p in prompts])  # [2, T], left-padded
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    logits, cache = model.run_with_cache(ids, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        pad = T - len(prompt)
        alone_logits, alone = model.run_with_cache(torch.tensor([prompt]))
        assert relative_error(logits[row, pad:], alone_logits[0]) < 1e-5
        assert torch.equal(cache["hook_pos_embed"][row, pad:], alone["hook_pos_embed"][0])  # positions count from 0
        for name in ("blocks.0.hook_resid_post", "blocks.3.hook_resid_post", "blocks.1.attn.hook_z", "ln_final.hook_scale"):
            # the residual stream reaches ~300 here, so the bound is relative to each tensor's scale
            assert relative_error(cache[name][row, pad:], alone[name][0]) < 1e-5, name
        # alone, the earlier layers attend in the fused kernel and the padded rows in the explicit form: the
        # patterns then differ by up to 2.1e-6 absolute (measured), within the same relative bound as the rest
        assert relative_error(cache["blocks.2.attn.hook_pattern"][row, :, pad:, pad:],
                              alone["blocks.2.attn.hook_pattern"][0]) < 1e-5
        assert cache["blocks.2.attn.hook_pattern"][row, :, pad:, :pad].abs().sum() == 0  # nothing attends to padding


@pytest.mark.parametrize("fixture", ["model", pytest.param("trained_model", marks=pytest.mark.trained)])
def test_direct_logit_attribution_adds_up(fixture: str, request) -> None:
    model = request.getfixturevalue(fixture)
    logits, cache = model.run_with_cache(ids_of(model))
    top, second = logits[0, -1].topk(2).indices.tolist()
    for other in (None, second):
        dla = direct_logit_attribution(cache, top, other)
        assert dla.values.shape == (1, logits.shape[1], 2 + model.config.n_layer * (model.config.n_head + 3))
        scale = dla.values.abs().sum(-1).max()
        assert (dla.values.sum(-1) - (dla.logit - dla.ln_f_bias_term)).abs().max() <= 1e-6 * scale + 1e-5
        expected = logits[0, :, top] - (logits[0, :, second] if other is not None else 0)
        assert torch.equal(dla.logit[0], expected)


def test_logit_lens_uses_each_layers_own_statistics(trained_model: GPT2) -> None:
    model = trained_model
    logits, cache = model.run_with_cache(ids_of(model))
    lens = logit_lens(cache, k=3, token=int(logits[0, -1].argmax()))
    L = model.config.n_layer
    assert lens.labels == ["embed"] + [f"block {i}" for i in range(L)] and lens.top_ids.shape[:2] == (L + 1, 1)
    probs = torch.softmax(logits, -1)
    assert torch.equal(lens.top_ids[L], probs.topk(3).indices) and torch.equal(lens.top_probs[L], probs.topk(3).values)
    assert lens.token_probs[L, 0, -1] == probs[0, -1].max()
    # the middle layer's own scale, not the final one's (TransformerLens issue #1076)
    x = cache["blocks.2.hook_resid_pre"]
    ln = (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True, unbiased=False) + 1e-5).sqrt()
    own = (ln * model.weights.ln_f.weight + model.weights.ln_f.bias) @ model.weights.wte.t()
    torch.testing.assert_close(lens_logits(cache, 2), own, rtol=0, atol=1e-4)


def test_gradient_attribution_equals_transformers_autograd(trained_model: GPT2, trained_hf_model) -> None:
    model, ids = trained_model, ids_of(trained_model)[0]
    target = int(model(ids[None])[0, -1].argmax())
    ours = attribution(model, ids, target, "grad_x_input")
    emb = trained_hf_model.transformer.wte.weight[ids].detach().clone().requires_grad_(True)  # [T, C]
    logits = trained_hf_model(inputs_embeds=emb[None]).logits[0, -1].double()
    logp = logits[target] - torch.logsumexp(logits, -1)
    (grad,) = torch.autograd.grad(logp, emb)
    expected = (grad * emb).sum(-1).detach()
    assert relative_error(ours.values, expected.float()) < 1e-5  # 5e-7 measured; float32 head GEMV gave 3e-4
    assert math.isclose(ours.f_input, float(logp.detach()), abs_tol=1e-5)


@pytest.mark.parametrize("text", [PROMPT, "The quick brown fox jumps over", "If the value is None, raise an error"])
def test_integrated_gradients_are_complete(trained_model: GPT2, text: str) -> None:
    ids = ids_of(trained_model, text)[0]
    target = int(trained_model(ids[None])[0, -1].argmax())
    ig = attribution(trained_model, ids, target, "integrated_gradients", steps=32)
    gap = ig.f_input - ig.f_baseline
    assert abs(float(ig.values.sum()) - gap) <= max(0.01 * abs(gap), 1e-3), (ig.steps, ig.completeness_error, gap)
    assert ig.steps >= 32 and ig.values.shape == ids.shape


def test_head_scores_read_the_probe(trained_model: GPT2) -> None:
    scores = {kind: head_scores(trained_model, kind, run_length=10, batch=2) for kind in
              ("previous_token", "duplicate_token", "induction")}
    assert all(s.shape == (4, 4) and (s >= 0).all() and (s <= 1).all() for s in scores.values())
    # the same numbers by hand, from the cache of the same probe
    from gpt2_engine.inspect.analysis import probe

    ids = probe(trained_model, run_length=10, batch=2)
    _, cache = trained_model.run_with_cache(ids)
    p = cache["blocks.1.attn.hook_pattern"]  # [2, nh, 21, 21]
    assert torch.allclose(scores["induction"][1], torch.stack([p[:, :, t, t - 9] for t in range(11, 21)]).mean((0, 1)))
    assert torch.allclose(scores["previous_token"][1], torch.stack([p[:, :, t, t - 1] for t in range(1, 21)]).mean((0, 1)))
    with pytest.raises(GPT2EngineError, match="kind: expected one of previous_token, duplicate_token, induction"):
        head_scores(trained_model, "copying")


def test_bad_hooks_and_names_are_refused(trained_model: GPT2) -> None:
    ids = ids_of(trained_model)
    with pytest.raises(GPT2EngineError, match="unknown hook point 'blocks.0.attn.hook_patern'"):
        trained_model.run_with_cache(ids, ["blocks.0.attn.hook_patern"])
    with pytest.raises(GPT2EngineError, match="unknown hook point 'blocks.9.hook_resid_pre'"):
        trained_model.run_with_hooks(ids, {"blocks.9.hook_resid_pre": lambda x, n: x})
    with pytest.raises(GPT2EngineError, match="^hook on blocks.0.hook_resid_pre: expected a function "
                                              r"fn\(activation, name\), got str$"):
        trained_model.run_with_hooks(ids, {"blocks.0.hook_resid_pre": "x"})
    with pytest.raises(GPT2EngineError, match=r"hook on blocks.0.hook_resid_pre: expected a tensor of shape \[1, \d+, 256\]"):
        trained_model.run_with_hooks(ids, {"blocks.0.hook_resid_pre": lambda x, n: x[:, :-1]})
    with pytest.raises(GPT2EngineError, match=r"hook on blocks.0.hook_resid_pre: expected a floating-point tensor, "
                                              "got torch.int64"):
        trained_model.run_with_hooks(ids, {"blocks.0.hook_resid_pre": lambda x, n: x.long()})
    with pytest.raises(GPT2EngineError, match="attention_mask: expected shape"):
        trained_model.run_with_cache(ids, attention_mask=torch.ones(1, 3))
    two = ids.repeat(2, 1)[:, :3]  # [2, 3]
    for mask, message in [([[1, 1, 1], [1, 0, 1]], r"row 1 is \[1, 0, 1\]; expected left padding"),
                          ([[0, 0, 0], [1, 1, 1]], r"row 0 is \[0, 0, 0\]; expected left padding"),
                          ([[1, 1, 0], [1, 1, 1]], r"row 0 is \[1, 1, 0\]"),
                          ([[1, 1, float("nan")], [1, 1, 1]], "expected only 0s and 1s"),
                          ([[1, 1, 2], [1, 1, 1]], "expected only 0s and 1s")]:
        with pytest.raises(GPT2EngineError, match="^attention_mask: " + message):
            trained_model.run_with_cache(two, attention_mask=torch.tensor(mask))
    with pytest.raises(GPT2EngineError, match="attention_mask: expected a dense tensor of 0s and 1s, got list"):
        trained_model.run_with_cache(two, attention_mask=[[1, 1, 1], [1, 1, 1]])
    with pytest.raises(KeyError, match="is not in this cache"):
        trained_model.run_with_cache(ids, ["hook_embed"])[1]["hook_pos_embed"]
    with pytest.raises(GPT2EngineError, match="method: expected 'grad_x_input' or 'integrated_gradients'"):
        attribution(trained_model, ids[0], 0, "saliency")
