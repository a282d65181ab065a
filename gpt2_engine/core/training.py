"""One training step of the whole GPT-2, forward and backward, written by hand over buffers allocated once.

The layers' forward and backward functions are core/backward.py's; this module allocates the run's buffers for a
(batch, context) shape, as llm.c does, and runs the layers in order. Parameters and gradients are both GPT2Weights:
the gradient of each parameter sits in the same place of a second GPT2Weights, under the same names, and the tied
head's gradient lands in the gradient of wte together with the embedding's.

Per block (GPT-2 is pre-LN), with dropout masks k_att, k_a, k_m (None when p = 0):
    h1 = ln_1(x);  qkv = h1 W_attn + b;  y = attention(qkv, k_att);  x_mid = x + (y W_proj + b) * k_a
    h2 = ln_2(x_mid);  pre = h2 W_fc + b;  x_out = x_mid + (gelu(pre) W_mproj + b) * k_m
and the backward runs the same lines last to first, the residual gradient d_res flowing through both adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backward import (attention_backward, attention_buffers, attention_forward, causal_blocks, draw_keep,
                       embedding_backward, embedding_forward, gelu_backward, gelu_forward, head_cross_entropy,
                       layer_norm_backward, layer_norm_forward, linear_backward, linear_forward)
from .config import GPT2Config
from .weights import Block, GPT2Weights, assemble, expected_shapes, named_tensors

HEAD_ROWS = 1024  # rows the fused head + cross-entropy takes at a time: its logits buffer is [V, HEAD_ROWS]


def trainable_copy(w: GPT2Weights, config: GPT2Config, dtype: torch.dtype = torch.float32) -> GPT2Weights:
    """Owned, contiguous copies of every parameter in `dtype` (a checkpoint's tensors are read-only file mappings)."""
    return assemble({name: t.to(dtype, copy=True).contiguous() for name, t in named_tensors(w).items()}, config)


def zeros_like(w: GPT2Weights, config: GPT2Config) -> GPT2Weights:
    """A GPT2Weights of zeros shaped as `w`: the gradient buffers, or the optimizer's moments."""
    return assemble({name: torch.zeros_like(t) for name, t in named_tensors(w).items()}, config)


def initial_weights(config: GPT2Config, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> GPT2Weights:
    """GPT-2's initialisation: matrices and embeddings N(0, 0.02), biases 0, layer norms (1, 0); the projections
    that write into the residual stream (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 n_layer)), so that the
    stream's variance does not grow with depth (the GPT-2 paper, section 2.3)."""
    named: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".bias"):
            named[name] = torch.zeros(shape, dtype=dtype)
        elif is_layer_norm(name):
            named[name] = torch.ones(shape, dtype=dtype)
        else:
            std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
            named[name] = torch.randn(shape, generator=generator, dtype=dtype) * std
    return assemble(named, config)


def is_layer_norm(name: str) -> bool:
    return name.startswith("ln_f.") or ".ln_" in name


def decayed(name: str, decay_embeddings: bool = False) -> bool:
    """Whether AdamW's weight decay applies to the parameter `name`: the 2-D matrices (nanoGPT's rule), not biases
    or layer norms, and the embeddings wte and wpe only when asked."""
    if name in ("wte.weight", "wpe.weight"):
        return decay_embeddings
    return name.endswith(".weight") and not is_layer_norm(name)


@dataclass(frozen=True)
class LayerActivations:
    """What block i's forward keeps for its backward; [N, ...] tensors are row views of [B, T, ...] ones."""

    x: torch.Tensor  # [B, T, C] the block's input
    ln1: torch.Tensor  # [N, C]
    ln1_mean: torch.Tensor  # [N]
    ln1_rstd: torch.Tensor  # [N]
    qkv: torch.Tensor  # [B, T, 3C]
    att: tuple[torch.Tensor, ...]  # softmax before dropout, by causal block: [B, nh, j - i, j] (backward.causal_blocks)
    att_keep: tuple[torch.Tensor, ...] | None  # shaped as att
    y: torch.Tensor  # [B, T, C] heads merged, c_proj's input
    attn_keep: torch.Tensor | None  # [B, T, C] residual dropout of the attention's output
    x_mid: torch.Tensor  # [B, T, C] after the attention's residual add
    ln2: torch.Tensor  # [N, C]
    ln2_mean: torch.Tensor  # [N]
    ln2_rstd: torch.Tensor  # [N]
    pre: torch.Tensor  # [N, 4C] c_fc's output, gelu's input (gelu's output is recomputed in the backward)
    mlp_keep: torch.Tensor | None  # [B, T, C] residual dropout of the MLP's output


@dataclass(frozen=True)
class Buffers:
    """Every activation and scratch buffer of a step at one (batch, context) shape, allocated once for the run."""

    batch: int  # B
    context: int  # T
    dropout: float
    embed_keep: torch.Tensor | None  # [B, T, C]
    layers: tuple[LayerActivations, ...]
    x_final: torch.Tensor  # [B, T, C] the last block's output
    lnf: torch.Tensor  # [N, C]
    lnf_mean: torch.Tensor  # [N]
    lnf_rstd: torch.Tensor  # [N]
    # scratch, shared by all layers
    d_res: torch.Tensor  # [N, C] the residual stream's gradient
    d_ln: torch.Tensor  # [N, C] a layer norm's output gradient
    d_y: torch.Tensor  # [N, C]
    branch: torch.Tensor  # [N, C] a branch's output (forward) or its gradient after dropout (backward)
    xhat: torch.Tensor  # [N, C]
    act: torch.Tensor  # [N, 4C] gelu's output
    d_act: torch.Tensor  # [N, 4C]
    d_qkv: torch.Tensor  # [B, T, 3C]
    d_att: torch.Tensor  # flat, the largest causal block's [B, nh, r, j]
    dk: torch.Tensor  # [B, nh, T, hs]
    dv: torch.Tensor  # [B, nh, T, hs]
    dropped: torch.Tensor | None  # flat like d_att: a block's attention after dropout
    future: torch.Tensor  # [T, T] bool, True above the diagonal
    logits: torch.Tensor  # [V, min(N, HEAD_ROWS)]

    @classmethod
    def allocate(cls, config: GPT2Config, batch: int, context: int, dropout: float = 0.0,
                 dtype: torch.dtype = torch.float32, head_rows: int = HEAD_ROWS) -> Buffers:
        """Buffers for batches of `batch` windows of `context` tokens; dropout masks only when dropout > 0."""
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        B, T, C, nh, F = batch, context, config.n_embd, config.n_head, config.mlp_width
        N = B * T

        def new(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype)

        def mask(*shape: int) -> torch.Tensor | None:
            return new(*shape) if dropout > 0 else None

        block = max((j - i) * j for i, j in causal_blocks(T)) * B * nh  # the largest causal block's entries

        layers = []
        for _ in range(config.n_layer):
            layers.append(LayerActivations(
                x=new(B, T, C), ln1=new(N, C), ln1_mean=new(N), ln1_rstd=new(N), qkv=new(B, T, 3 * C),
                att=attention_buffers(B, nh, T, dtype), y=new(B, T, C), attn_keep=mask(B, T, C),
                att_keep=attention_buffers(B, nh, T, dtype) if dropout > 0 else None,
                x_mid=new(B, T, C), ln2=new(N, C), ln2_mean=new(N), ln2_rstd=new(N), pre=new(N, F),
                mlp_keep=mask(B, T, C)))
        return cls(B, T, dropout, mask(B, T, C), tuple(layers), new(B, T, C), new(N, C), new(N), new(N),
                   d_res=new(N, C), d_ln=new(N, C), d_y=new(N, C), branch=new(N, C), xhat=new(N, C),
                   act=new(N, F), d_act=new(N, F), d_qkv=new(B, T, 3 * C), d_att=new(block),
                   dk=new(B, nh, T, C // nh), dv=new(B, nh, T, C // nh), dropped=mask(block),
                   future=torch.ones(T, T, dtype=torch.bool).triu(1), logits=new(config.vocab_size, min(N, head_rows)))


def block_forward(x_out: torch.Tensor, a: LayerActivations, blk: Block, config: GPT2Config, buf: Buffers,
                  train: bool, generator: torch.Generator | None) -> None:
    """a.x [B, T, C] -> x_out [B, T, C], keeping the block's activations in `a`."""
    eps, n, C = config.layer_norm_epsilon, buf.batch * buf.context, config.n_embd
    layer_norm_forward(a.x.view(n, C), blk.ln_1, eps, a.ln1, a.ln1_mean, a.ln1_rstd)
    linear_forward(a.ln1, blk.c_attn, a.qkv.view(n, 3 * C))
    att_keep = a.att_keep if train else None
    for keep in att_keep or ():
        draw_keep(keep, buf.dropout, generator)
    attention_forward(a.qkv, config.n_head, a.att, att_keep, buf.future, a.y, buf.dropped)
    linear_forward(a.y.view(n, C), blk.attn_c_proj, buf.branch)
    _residual_add(a.x.view(n, C), buf.branch, a.attn_keep if train else None, buf.dropout, generator, a.x_mid.view(n, C))
    layer_norm_forward(a.x_mid.view(n, C), blk.ln_2, eps, a.ln2, a.ln2_mean, a.ln2_rstd)
    linear_forward(a.ln2, blk.c_fc, a.pre)
    gelu_forward(a.pre, buf.act)
    linear_forward(buf.act, blk.mlp_c_proj, buf.branch)
    _residual_add(a.x_mid.view(n, C), buf.branch, a.mlp_keep if train else None, buf.dropout, generator, x_out.view(n, C))


def _residual_add(x: torch.Tensor, branch: torch.Tensor, keep: torch.Tensor | None, p: float,
                  generator: torch.Generator | None, out: torch.Tensor) -> None:
    """out = x + branch * keep (residual dropout on the branch, a fresh mask drawn into `keep`)."""
    if keep is not None:
        draw_keep(keep, p, generator)
        branch.mul_(keep.view_as(branch))
    torch.add(x, branch, out=out)


def block_backward(a: LayerActivations, blk: Block, grad: Block, config: GPT2Config, buf: Buffers) -> None:
    """buf.d_res = dL/d x_out [N, C] -> dL/d a.x [N, C] in place, adding the block's parameter gradients to `grad`."""
    n, C = buf.batch * buf.context, config.n_embd
    # x_out = x_mid + mlp(ln_2(x_mid)) * k_m: d_res reaches x_mid directly and through the MLP
    d_branch = buf.d_res if a.mlp_keep is None else torch.mul(buf.d_res, a.mlp_keep.view(n, C), out=buf.branch)
    gelu_forward(a.pre, buf.act)  # recomputed: cheaper than keeping [N, 4C] per layer
    linear_backward(d_branch, buf.act, blk.mlp_c_proj, grad.mlp_c_proj, buf.d_act)
    gelu_backward(buf.d_act, a.pre, buf.d_act)
    linear_backward(buf.d_act, a.ln2, blk.c_fc, grad.c_fc, buf.d_ln)
    layer_norm_backward(buf.d_ln, a.x_mid.view(n, C), a.ln2_mean, a.ln2_rstd, blk.ln_2, grad.ln_2,
                        buf.d_res, buf.xhat)
    # x_mid = x + attn(ln_1(x)) * k_a
    d_branch = buf.d_res if a.attn_keep is None else torch.mul(buf.d_res, a.attn_keep.view(n, C), out=buf.branch)
    linear_backward(d_branch, a.y.view(n, C), blk.attn_c_proj, grad.attn_c_proj, buf.d_y)
    attention_backward(buf.d_y.view(buf.batch, buf.context, C), a.qkv, a.att, a.att_keep, config.n_head, buf.d_qkv,
                       buf.d_att, buf.dk, buf.dv, buf.dropped)
    linear_backward(buf.d_qkv.view(n, 3 * C), a.ln1, blk.c_attn, grad.c_attn, buf.d_ln)
    layer_norm_backward(buf.d_ln, a.x.view(n, C), a.ln1_mean, a.ln1_rstd, blk.ln_1, grad.ln_1,
                        buf.d_res, buf.xhat)


def forward_loss(w: GPT2Weights, config: GPT2Config, buf: Buffers, ids: torch.Tensor, targets: torch.Tensor, *,
                 grads: GPT2Weights | None = None, grad_scale: float = 1.0,
                 generator: torch.Generator | None = None) -> float:
    """The summed cross-entropy of targets [B, T] (-1: not scored) given ids [B, T].

    With `grads`, a training step: dropout on (masks drawn from `generator`), and the backward runs too, adding
    grad_scale * dL/dp for every parameter p into `grads` (zero them first; accumulation is just not zeroing).
    Without, an evaluation: no dropout, no backward.
    """
    B, T = ids.shape
    if (B, T) != (buf.batch, buf.context) or targets.shape != ids.shape:
        raise ValueError(f"batch shape {list(ids.shape)} / targets {list(targets.shape)} do not match the buffers' "
                         f"[{buf.batch}, {buf.context}]")
    train = grads is not None
    if train and buf.dropout > 0 and generator is None:
        raise ValueError("dropout needs a torch.Generator to draw its masks from")
    n, C = B * T, config.n_embd
    x0 = buf.layers[0].x
    embedding_forward(ids, w.wte, w.wpe, x0)
    if train and buf.embed_keep is not None:
        draw_keep(buf.embed_keep, buf.dropout, generator)
        x0.mul_(buf.embed_keep)
    outs = [a.x for a in buf.layers[1:]] + [buf.x_final]
    for a, blk, x_out in zip(buf.layers, w.blocks, outs):
        block_forward(x_out, a, blk, config, buf, train, generator)
    layer_norm_forward(buf.x_final.view(n, C), w.ln_f, config.layer_norm_epsilon, buf.lnf, buf.lnf_mean, buf.lnf_rstd)
    flat_targets = targets.reshape(-1)
    if not train:
        return head_cross_entropy(buf.lnf, w.wte, flat_targets, buf.logits, grad_scale, None, None)
    loss = head_cross_entropy(buf.lnf, w.wte, flat_targets, buf.logits, grad_scale, grads.wte, buf.d_ln)

    # backward: ln_f, the blocks last to first, the embeddings
    buf.d_res.zero_()
    layer_norm_backward(buf.d_ln, buf.x_final.view(n, C), buf.lnf_mean, buf.lnf_rstd, w.ln_f, grads.ln_f, buf.d_res,
                        buf.xhat)
    for a, blk, g in zip(reversed(buf.layers), reversed(w.blocks), reversed(grads.blocks)):
        block_backward(a, blk, g, config, buf)
    d_x0 = buf.d_res if buf.embed_keep is None else buf.d_res.mul_(buf.embed_keep.view(n, C))
    embedding_backward(d_x0.view(B, T, C), ids, grads.wte, grads.wpe)
    return loss


def zero_(w: GPT2Weights) -> None:
    """Set every tensor of a gradient GPT2Weights to zero."""
    for t in named_tensors(w).values():
        t.zero_()

