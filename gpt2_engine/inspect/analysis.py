"""What the activations say: logit lens, direct logit attribution, gradient attribution and head detectors.

Everything here reads an ActivationCache from `model.run_with_cache` or runs the engine's own forward (core/model.py)
through a tap: there is no second implementation of GPT-2 in this package. Notation as in model.py: B batch, T tokens,
C channels, nh heads, hs head size, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..api import GPT2
from ..core.errors import GPT2EngineError
from ..interp.hooks import ActivationCache, Recorder
from ..core.ops import embed
from ..core.model import logits, residual_stream
from ..core.projection import as_float32, head_rows
from ..core.weights import GPT2Weights, LayerNorm

HeadKind = Literal["previous_token", "duplicate_token", "induction"]
HEAD_KINDS: tuple[HeadKind, ...] = ("previous_token", "duplicate_token", "induction")


def residual(cache: ActivationCache, layer: int) -> torch.Tensor:
    """[B, T, C]: the residual stream entering block `layer` (0: the embeddings; L: after the last block)."""
    n_layer = cache.model.config.n_layer
    if not 0 <= layer <= n_layer:
        raise GPT2EngineError(f"layer: expected 0..{n_layer}, got {layer}")
    return cache[f"blocks.{layer}.hook_resid_pre"] if layer < n_layer else cache[f"blocks.{n_layer - 1}.hook_resid_post"]


def lens_logits(cache: ActivationCache, layer: int) -> torch.Tensor:
    """[B, T, V]: the residual stream entering block `layer`, through ln_f with that residual's own mean and scale
    (not the final layer's: that was TransformerLens's logit-lens bug #1076), then the tied unembedding. This is the
    engine's own `logits()`, so at layer L it is the model's logits to the bit."""
    model = cache.model
    with torch.inference_mode():
        return logits(model.weights, model.config, residual(cache, layer))


@dataclass(frozen=True)
class LogitLens:
    """Top-k next-token predictions read from the residual stream before block 0 ("embed") and after each block."""

    labels: list[str]  # L + 1: "embed", "block 0", ..., "block L-1"
    top_ids: torch.Tensor  # [L + 1, B, T, k]
    top_probs: torch.Tensor  # [L + 1, B, T, k]
    token_probs: torch.Tensor | None  # [L + 1, B, T]: the probability of `token` at each layer, if one was given


def logit_lens(cache: ActivationCache, k: int = 5, token: int | None = None) -> LogitLens:
    """The logit lens over every layer of the cache (needs blocks.*.hook_resid_pre and the last hook_resid_post):
    the top k tokens and their probabilities, and the probability of `token` if given."""
    n_layer = cache.model.config.n_layer
    if token is not None:
        unembedding(cache.model, token)  # range check
    ids, probs, token_probs = [], [], []
    for layer in range(n_layer + 1):
        p = torch.softmax(lens_logits(cache, layer), dim=-1)  # [B, T, V]
        top = p.topk(k, dim=-1)
        ids.append(top.indices)
        probs.append(top.values)
        if token is not None:
            token_probs.append(p[..., token])
    return LogitLens(["embed"] + [f"block {i}" for i in range(n_layer)], torch.stack(ids), torch.stack(probs),
                     torch.stack(token_probs) if token is not None else None)


@dataclass(frozen=True)
class LogitAttribution:
    """The final residual stream split into components, each one's direct effect on a token's logit."""

    labels: list[str]  # K components: embed, pos_embed, then per layer L{i}H{h}..., L{i} attn bias, L{i} mlp, L{i} mlp bias
    values: torch.Tensor  # [B, T, K]; they sum to logit - ln_f_bias_term
    logit: torch.Tensor  # [B, T]: the model's logit of the token (minus the other token's)
    ln_f_bias_term: torch.Tensor  # [B, T]: ln_f.bias . unembedding, the part no component writes

    def by_layer_head(self, n_layer: int, n_head: int) -> torch.Tensor:
        """[B, T, L, nh + 1]: each head's component and, in the last column, the layer's MLP output (with its bias)."""
        out = []
        for i in range(n_layer):
            heads = [self.labels.index(f"L{i}H{h}") for h in range(n_head)]
            mlp = self.values[..., self.labels.index(f"L{i} mlp")] + self.values[..., self.labels.index(f"L{i} mlp bias")]
            out.append(torch.cat([self.values[..., heads], mlp[..., None]], dim=-1))
        return torch.stack(out, dim=-2)


def unembedding(model: GPT2, token: int) -> torch.Tensor:
    """[C]: token's row of the tied head (widened when quantized)."""
    if not 0 <= token < model.config.vocab_size:
        raise GPT2EngineError(f"token: id {token} is outside the vocabulary [0, {model.config.vocab_size})")
    return head_rows(model.weights.head, slice(token, token + 1))[0]


@torch.inference_mode()
def direct_logit_attribution(cache: ActivationCache, token: int, other: int | None = None) -> LogitAttribution:
    """Split the final residual stream into embeddings, each head's output (its slice of z through its rows of
    c_proj), each attention and MLP bias and each MLP output; project each on token's unembedding (minus other's),
    through ln_f as the model applies it: centred, divided by the cached ln_final.hook_scale, times ln_f.weight.

    ln_f is affine given its scale, so the components add up exactly: their sum is the logit minus the
    ln_f.bias . unembedding term, to float32 rounding.
    """
    model = cache.model
    cfg, w = model.config, model.weights
    u = unembedding(model, token) - (unembedding(model, other) if other is not None else 0.0)  # [C]
    d = u * w.ln_f.weight  # [C]
    d = d - d.mean()  # centring the component is the same as centring the direction: c . (d - mean d)
    scale = cache["ln_final.hook_scale"][..., 0]  # [B, T]
    labels, values = ["embed", "pos_embed"], [cache["hook_embed"] @ d, cache["hook_pos_embed"] @ d]  # [B, T] each
    nh, hs = cfg.n_head, cfg.head_size
    for i, blk in enumerate(w.blocks):
        w_o = as_float32(blk.attn_c_proj.weight).view(nh, hs, cfg.n_embd)  # [nh, hs, C]: head h's rows of c_proj
        per_head = torch.einsum("btnh,nh->btn", cache[f"blocks.{i}.attn.hook_z"], w_o @ d)  # [B, T, nh]
        labels += [f"L{i}H{h}" for h in range(nh)] + [f"L{i} attn bias", f"L{i} mlp", f"L{i} mlp bias"]
        mlp_bias = blk.mlp_c_proj.bias @ d
        values += [*per_head.unbind(-1), (blk.attn_c_proj.bias @ d).expand_as(scale),
                   cache[f"blocks.{i}.hook_mlp_out"] @ d - mlp_bias, mlp_bias.expand_as(scale)]
    stacked = torch.stack(values, dim=-1) / scale[..., None]  # [B, T, K]
    final = lens_logits(cache, cfg.n_layer)  # [B, T, V]: the model's logits
    logit = final[..., token] - (final[..., other] if other is not None else 0.0)
    return LogitAttribution(labels, stacked, logit, (w.ln_f.bias @ u).expand_as(logit))


@dataclass(frozen=True)
class Attribution:
    """Saliency of each prompt token for log p(target | prompt)."""

    method: str
    values: torch.Tensor  # [T]
    f_input: float  # log p(target) at the prompt
    f_baseline: float  # log p(target) at the baseline (token embeddings zero); integrated gradients only, else nan
    steps: int  # quadrature points used (integrated gradients), else 0

    @property
    def completeness_error(self) -> float:
        """|sum of attributions - (f_input - f_baseline)|: how far integrated gradients are from exact."""
        return abs(float(self.values.sum()) - (self.f_input - self.f_baseline))


IG_TOLERANCE = 0.01  # of |f(input) - f(baseline)|, with a floor of IG_FLOOR nats
IG_FLOOR = 1e-3
IG_MAX_STEPS = 1024
PATH_ROWS = 4096  # token rows per batched pass along the path, which bounds the memory autograd keeps


def float64_head(w: GPT2Weights) -> GPT2Weights:
    """The weights with ln_f and the head in float64, for the gradient of a log-probability. Its gradient with respect
    to the final residual is wte[target] - sum_v p_v wte[v], a sum over 50,257 rows that nearly cancels; float32
    GEMV accumulates it with ~1e-3 relative error on the trained checkpoint (transformers' full-sequence GEMM happens
    to do better), where everything before the head is good to ~1e-6."""
    return dataclasses.replace(w, ln_f=LayerNorm(w.ln_f.weight.double(), w.ln_f.bias.double()),
                               head=head_rows(w.head).double())


def target_logprob(model: GPT2, ids: torch.Tensor, embeddings: torch.Tensor, target: int,
                   head: GPT2Weights) -> torch.Tensor:
    """[N]: log p(target) after the last token, for N copies of the prompt ids [T] with token embeddings [N, T, C]
    in place of wte[ids] (positions as usual), through the engine's forward with autograd on; `head` is
    float64_head(model.weights): ln_f and the head run in float64 on the final residual stream."""
    replace = Recorder(hooks={"hook_embed": lambda x, name: embeddings})
    batch = ids.expand(embeddings.shape[0], -1)  # [N, T]
    x = residual_stream(model.weights, model.config, batch, tap=replace)[:, -1]  # [N, C]
    last = logits(head, model.config, x.double())  # [N, V] float64
    return (last[:, target] - torch.logsumexp(last, dim=-1)).float()


def path_gradient(model: GPT2, ids: torch.Tensor, emb: torch.Tensor, target: int, steps: int,
                  head: GPT2Weights) -> torch.Tensor:
    """[T, C]: the mean over alpha in [0, 1] of d log p(target) / d embeddings at alpha * emb, by Gauss-Legendre
    quadrature with `steps` nodes (exact for polynomials of degree 2 * steps - 1), in batches of PATH_ROWS rows."""
    nodes, weights = np.polynomial.legendre.leggauss(steps)  # on [-1, 1]
    alphas = torch.tensor((nodes + 1) / 2, dtype=torch.float32)  # [steps] in (0, 1)
    weights = torch.tensor(weights / 2, dtype=torch.float32)  # [steps], summing to 1
    total = torch.zeros_like(emb)  # [T, C]
    chunk = max(1, PATH_ROWS // emb.shape[0])
    for i in range(0, steps, chunk):
        path = (alphas[i : i + chunk, None, None] * emb).requires_grad_(True)  # [n, T, C]
        (grad,) = torch.autograd.grad(target_logprob(model, ids, path, target, head).sum(), path)
        total += (weights[i : i + chunk, None, None] * grad).sum(0)
    return total


def attribution(model: GPT2, ids: torch.Tensor | list[int], target: int,
                method: Literal["grad_x_input", "integrated_gradients"] = "grad_x_input", steps: int = 32) -> Attribution:
    """Per-token attribution of log p(target | ids) with respect to the input token embeddings.

    grad_x_input: the gradient times the embedding, summed over channels. integrated_gradients: the path integral of
    the gradient from a baseline of zero token embeddings (the positions stay), times (embedding - baseline), so that
    the attributions sum to f(input) - f(baseline) (completeness). The path is not smooth everywhere: on the trained
    checkpoint f(alpha) has steps a few hundredths of alpha wide, where LayerNorm's scale passes from the positional to
    the token embedding, and 32 midpoint points missed completeness by 4%. So the integral is Gauss-Legendre
    quadrature, and `steps` is doubled (up to IG_MAX_STEPS) until completeness holds within IG_TOLERANCE; the result
    says how many points it took and how far it is.
    """
    ids = torch.as_tensor(ids).reshape(-1)  # [T]
    model.check_ids(ids[None])
    unembedding(model, target)  # range check
    if method not in ("grad_x_input", "integrated_gradients"):
        raise GPT2EngineError(f"method: expected 'grad_x_input' or 'integrated_gradients', got {method!r}")
    if not 1 <= steps <= IG_MAX_STEPS:  # each step is a forward and a backward pass of the prompt
        raise GPT2EngineError(f"steps: expected an integer in [1, {IG_MAX_STEPS}], got {steps}")
    emb = embed(model.weights, ids)  # [T, C]
    head = float64_head(model.weights)
    with torch.inference_mode(False), torch.enable_grad():
        if method == "grad_x_input":
            x = emb.clone()[None].requires_grad_(True)  # [1, T, C]
            f = target_logprob(model, ids, x, target, head)
            (grad,) = torch.autograd.grad(f.sum(), x)
            return Attribution(method, (grad[0] * emb).sum(-1).detach(), float(f.detach()), float("nan"), 0)
        with torch.no_grad():
            f_input, f_baseline = target_logprob(model, ids, torch.stack([emb, torch.zeros_like(emb)]), target, head).tolist()
        tolerance = max(IG_TOLERANCE * abs(f_input - f_baseline), IG_FLOOR)
        while True:
            values = (path_gradient(model, ids, emb, target, steps, head) * emb).sum(-1)  # [T]
            result = Attribution(method, values.detach(), f_input, f_baseline, steps)
            if result.completeness_error <= tolerance or steps >= IG_MAX_STEPS:
                return result
            steps = min(2 * steps, IG_MAX_STEPS)


def probe(model: GPT2, *, vocab: list[int] | None = None, run_length: int = 50, batch: int = 4,
          seed: int = 0) -> torch.Tensor:
    """[batch, 1 + 2n]: <|endoftext|>, then a run of n distinct random tokens, then the same run again."""
    n = min(run_length, (model.config.n_positions - 1) // 2)
    pool = torch.as_tensor(vocab) if vocab is not None else torch.arange(model.tokenizer.eot_id)
    if pool.numel() < n:
        raise GPT2EngineError(f"vocab: need at least {n} distinct tokens for runs of {n}, got {pool.numel()}")
    g = torch.Generator().manual_seed(seed)
    runs = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:n]] for _ in range(batch)])  # [batch, n]
    bos = torch.full((batch, 1), model.tokenizer.eot_id)
    return torch.cat([bos, runs, runs], dim=1)


def head_scores(model: GPT2, kind: HeadKind, *, vocab: list[int] | None = None, run_length: int = 50,
                batch: int = 4, seed: int = 0) -> torch.Tensor:
    """[L, nh]: the mean attention of each head to where a head of `kind` would look, on `probe` sequences.

    previous_token: from every token to the one before it. duplicate_token: from each token of the second run to the
    same token in the first. induction: from each token of the second run to the token after its first occurrence.
    `vocab` is the pool of token ids the runs are drawn from (default: every token but <|endoftext|>).
    """
    if kind not in HEAD_KINDS:
        raise GPT2EngineError(f"kind: expected one of {', '.join(HEAD_KINDS)}, got {kind!r}")
    ids = probe(model, vocab=vocab, run_length=run_length, batch=batch, seed=seed)  # [batch, 1 + 2n]
    n = (ids.shape[1] - 1) // 2
    _, cache = model.run_with_cache(ids, lambda name: name.endswith("attn.hook_pattern"))
    if kind == "previous_token":
        queries = torch.arange(1, 2 * n + 1)
        keys = queries - 1
    else:
        queries = torch.arange(n + 1, 2 * n + 1)  # the second run
        keys = queries - n + (1 if kind == "induction" else 0)
    scores = [cache[f"blocks.{i}.attn.hook_pattern"][:, :, queries, keys].mean(dim=(0, 2)) for i in range(model.config.n_layer)]
    return torch.stack(scores)  # [L, nh]
