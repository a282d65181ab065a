"""One training step of the whole GPT-2, forward and backward, written by hand over buffers allocated once.

The layers' forward and backward functions are train/backward.py's; this module allocates the run's buffers for a
(batch, context) shape, as llm.c does, and runs the layers in order. Parameters and gradients are both GPT2Weights:
the gradient of each parameter sits in the same place of a second GPT2Weights, under the same names, and the tied
head's gradient lands in the gradient of wte together with the embedding's.

Per block (GPT-2 is pre-LN), with dropout masks k_att, k_a, k_m (None when p = 0):
    h1 = ln_1(x);  qkv = h1 W_attn + b;  y = attention(qkv, k_att);  x_mid = x + (y W_proj + b) * k_a
    h2 = ln_2(x_mid);  pre = h2 W_fc + b;  x_out = x_mid + (gelu(pre) W_mproj + b) * k_m
and the backward runs the same lines last to first, the residual gradient d_res flowing through both adds.

LoRA (core/lora.py): an adapted projection adds s (dropout(x) A) B to its output, its adapter's dropout mask drawn
right there, as PEFT's layer does. The base is then frozen: its gradient GPT2Weights holds None for every base
tensor (weights, biases, layer norms, embeddings), those backward steps pass the input gradient through and add
nothing, and only the adapters' A and B get gradients. A frozen base may be quantized (QLoRA): the forward runs the
inference kernels and the backward widens one matrix at a time into a scratch buffer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from ..core.config import GPT2Config
from ..core.lora import TARGETS, LoraSettings, module_name
from ..core.ops import embed
from ..core.model import query_blocks
from ..core.projection import HEAD_BLOCK
from ..core.weights import Block, GPT2Weights, Linear, LoraStack, assemble, expected_shapes, named_tensors
from .backward import (
    attention_backward,
    attention_buffers,
    attention_forward,
    draw_keep,
    embedding_backward,
    embedding_forward,
    gelu_backward,
    gelu_forward,
    head_cross_entropy,
    layer_norm_backward,
    layer_norm_forward,
    linear_backward,
    linear_forward,
    lora_backward,
    lora_forward,
)

HEAD_ROWS = 1024  # rows the fused head + cross-entropy takes at a time: its logits buffer is [V, HEAD_ROWS]
# ... with a quantized base (QLoRA, where memory is the point): [V, 128] is 26 MB rather than 206 MB, and so is the
# quantized head's kernel output, a fresh [rows, V] each chunk
LEAN_HEAD_ROWS = 128


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


def adapter_gradients(w: GPT2Weights, config: GPT2Config, settings: LoraSettings) -> tuple[GPT2Weights, dict[str, torch.Tensor]]:
    """For LoRA training on `w` (an adapter attached, core/lora.trainable): the gradient GPT2Weights (None for
    every frozen base tensor, zeroed A and B on each adapted projection) and those gradients by the adapter's names."""
    named: dict[str, torch.Tensor] = {}
    blocks = []
    for i, blk in enumerate(w.blocks):
        parts: dict = {"ln_1": None, "ln_2": None}
        for target, field in TARGETS.items():
            stack = getattr(blk, field).lora
            if target in settings.targets:
                ga, gb = torch.zeros_like(stack.a[0]), torch.zeros_like(stack.b[0])
                named[module_name(i, target) + ".lora_A"], named[module_name(i, target) + ".lora_B"] = ga, gb
                parts[field] = Linear(None, None, LoraStack(ga[None], gb[None], stack.scale))
            else:
                parts[field] = Linear(None, None)
        blocks.append(Block(**parts))
    return GPT2Weights(wte=None, wpe=None, blocks=tuple(blocks), ln_f=None, head=None), named


@dataclass(frozen=True)
class AdapterActivations:
    """What an adapted projection's LoRA term keeps for its backward."""

    keep: torch.Tensor | None  # [N, in] the adapter's dropout mask on its input (None: no dropout)
    h: torch.Tensor  # [N, r] scale * dropout(x) A


@dataclass(frozen=True)
class LayerActivations:
    """What block i's forward keeps for its backward; [N, ...] tensors are row views of [B, T, ...] ones."""

    x: torch.Tensor  # [B, T, C] the block's input
    ln1: torch.Tensor  # [N, C]
    ln1_mean: torch.Tensor  # [N]
    ln1_rstd: torch.Tensor  # [N]
    heads: torch.Tensor  # [3, B, nh, T, hs] q, k, v head-major (c_attn's output, rearranged)
    att: tuple[torch.Tensor, ...]  # softmax before dropout, by causal block: [B, nh, j - i, j] (model.query_blocks)
    att_keep: tuple[torch.Tensor, ...] | None  # shaped as att
    y: torch.Tensor  # [B, T, C] heads merged, c_proj's input
    attn_keep: torch.Tensor | None  # [B, T, C] residual dropout of the attention's output
    x_mid: torch.Tensor  # [B, T, C] after the attention's residual add
    ln2: torch.Tensor  # [N, C]
    ln2_mean: torch.Tensor  # [N]
    ln2_rstd: torch.Tensor  # [N]
    pre: torch.Tensor  # [N, 4C] c_fc's output, gelu's input (gelu's output is recomputed in the backward)
    mlp_keep: torch.Tensor | None  # [B, T, C] residual dropout of the MLP's output
    adapters: dict[str, AdapterActivations]  # by Block field, for the adapted projections (LoRA)


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
    qkv: torch.Tensor  # [B, T, 3C] c_attn's output, before attention_forward rearranges it into a layer's heads
    d_qkv: torch.Tensor  # [B, T, 3C]
    d_att: torch.Tensor  # flat, the largest causal block's [B, nh, r, j]
    d_heads: torch.Tensor  # [3, B, nh, T, hs] dq, dk, dv
    d_yh: torch.Tensor  # [B, nh, T, hs] d_y's heads
    dropped: torch.Tensor | None  # flat like d_att: a block's attention after dropout
    future: torch.Tensor  # [T, T] bool, True above the diagonal
    logits: torch.Tensor  # [V, min(N, HEAD_ROWS)]
    lora_dropout: float = 0.0
    d_h: torch.Tensor | None = None  # [N, r] an adapter's gradient at h (LoRA)
    xd: torch.Tensor | None = None  # [N, 4C] an adapter's input after dropout (LoRA)
    dequant: torch.Tensor | None = None  # flat: the largest quantized matrix (or head chunk) widened (QLoRA)
    recompute_out: torch.Tensor | None = None  # [B, T, C] where a recomputed block writes its (unused) output

    @property
    def recompute(self) -> bool:
        """Whether the blocks share one set of activations (only each block's input kept) and the backward runs
        each block's forward again before its backward."""
        return self.recompute_out is not None

    @classmethod
    def allocate(cls, config: GPT2Config, batch: int, context: int, dropout: float = 0.0,
                 dtype: torch.dtype = torch.float32, head_rows: int = HEAD_ROWS, lora: LoraSettings | None = None,
                 quantized: bool = False, recompute: bool = False) -> Buffers:
        """Buffers for batches of `batch` windows of `context` tokens; dropout masks only when dropout > 0; the
        adapters' activations with `lora`; the widening buffer for a `quantized` frozen base. `recompute`: keep
        only each block's input [B, T, C] and one block's activations, shared by all (activation checkpointing:
        about n_layer times less activation memory for one more forward pass a step)."""
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if quantized:
            head_rows = min(head_rows, LEAN_HEAD_ROWS)
        B, T, C, nh, F = batch, context, config.n_embd, config.n_head, config.mlp_width
        N = B * T

        def new(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype)

        def mask(*shape: int) -> torch.Tensor | None:
            return new(*shape) if dropout > 0 else None

        block = max((j - i) * j for i, j, _ in query_blocks(T, T)) * B * nh  # the largest causal block's entries
        fan_in = {"c_attn": C, "attn.c_proj": C, "c_fc": C, "mlp.c_proj": F}

        def adapters() -> dict[str, AdapterActivations]:
            if lora is None:
                return {}
            keep = (lambda k: new(N, k)) if lora.dropout > 0 else (lambda k: None)
            return {TARGETS[t]: AdapterActivations(keep(fan_in[t]), new(N, lora.r)) for t in lora.targets}

        def layer() -> LayerActivations:
            return LayerActivations(
                x=new(B, T, C), ln1=new(N, C), ln1_mean=new(N), ln1_rstd=new(N), heads=new(3, B, nh, T, C // nh),
                att=attention_buffers(B, nh, T, dtype), y=new(B, T, C), attn_keep=mask(B, T, C),
                att_keep=attention_buffers(B, nh, T, dtype) if dropout > 0 else None,
                x_mid=new(B, T, C), ln2=new(N, C), ln2_mean=new(N), ln2_rstd=new(N), pre=new(N, F),
                mlp_keep=mask(B, T, C), adapters=adapters())

        if recompute:  # one block's activations, shared; each block's own input
            shared = layer()
            layers = [shared] + [replace(shared, x=new(B, T, C)) for _ in range(config.n_layer - 1)]
        else:
            layers = [layer() for _ in range(config.n_layer)]
        return cls(B, T, dropout, mask(B, T, C), tuple(layers), new(B, T, C), new(N, C), new(N), new(N),
                   d_res=new(N, C), d_ln=new(N, C), d_y=new(N, C), branch=new(N, C), xhat=new(N, C),
                   act=new(N, F), d_act=new(N, F), qkv=new(B, T, 3 * C), d_qkv=new(B, T, 3 * C),
                   d_att=new(block), d_heads=new(3, B, nh, T, C // nh), d_yh=new(B, nh, T, C // nh), dropped=mask(block),
                   future=torch.ones(T, T, dtype=torch.bool).triu(1), logits=new(config.vocab_size, min(N, head_rows)),
                   lora_dropout=lora.dropout if lora else 0.0, d_h=new(N, lora.r) if lora else None,
                   xd=new(N, F) if lora else None,
                   dequant=new(max(C * 4 * C, C * (HEAD_BLOCK + 16))) if quantized else None,
                   recompute_out=new(B, T, C) if recompute else None)


    @classmethod
    def nbytes(cls, config: GPT2Config, batch: int, context: int, dropout: float = 0.0, **kwargs) -> int:
        """The bytes allocate(config, batch, context, dropout, **kwargs) would take: its tensors made on the meta
        device (shapes only, nothing allocated), each counted once."""
        with torch.device("meta"):
            buffers = cls.allocate(config, batch, context, dropout, **kwargs)
        return sum(t.nbytes for t in {id(t): t for t in _tensors(buffers)}.values())


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor in a tree of dataclasses, tuples and dicts (Buffers' shape)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list, dict)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(item)
    elif is_dataclass(obj):
        for f in fields(obj):
            yield from _tensors(getattr(obj, f.name))


def block_forward(x_out: torch.Tensor, a: LayerActivations, blk: Block, config: GPT2Config, buf: Buffers,
                  train: bool, generator: torch.Generator | None) -> None:
    """a.x [B, T, C] -> x_out [B, T, C], keeping the block's activations in `a`."""
    eps, n, C = config.layer_norm_epsilon, buf.batch * buf.context, config.n_embd
    layer_norm_forward(a.x.view(n, C), blk.ln_1, eps, a.ln1, a.ln1_mean, a.ln1_rstd)
    _project(a, "c_attn", blk.c_attn, a.ln1, buf.qkv.view(n, 3 * C), buf, train, generator)
    att_keep = a.att_keep if train else None
    for keep in att_keep or ():
        draw_keep(keep, buf.dropout, generator)
    attention_forward(buf.qkv, config.n_head, a.heads, a.att, att_keep, buf.future, a.y, buf.dropped)
    _project(a, "attn_c_proj", blk.attn_c_proj, a.y.view(n, C), buf.branch, buf, train, generator)
    _residual_add(a.x.view(n, C), buf.branch, a.attn_keep if train else None, buf.dropout, generator, a.x_mid.view(n, C))
    layer_norm_forward(a.x_mid.view(n, C), blk.ln_2, eps, a.ln2, a.ln2_mean, a.ln2_rstd)
    _project(a, "c_fc", blk.c_fc, a.ln2, a.pre, buf, train, generator)
    gelu_forward(a.pre, buf.act, config.exact_gelu)
    _project(a, "mlp_c_proj", blk.mlp_c_proj, buf.act, buf.branch, buf, train, generator)
    _residual_add(a.x_mid.view(n, C), buf.branch, a.mlp_keep if train else None, buf.dropout, generator, x_out.view(n, C))


def _project(a: LayerActivations, field: str, p: Linear, x: torch.Tensor, out: torch.Tensor, buf: Buffers,
             train: bool, generator: torch.Generator | None) -> None:
    """out = x W + b for projection `field`, plus its adapter's term if it has one (a fresh dropout mask drawn
    first, where PEFT's layer draws it). The term and the bias are written first and the base GEMM accumulates
    onto them: one pass over `out` fewer than adding the term afterwards."""
    if p.lora is None:
        linear_forward(x, p, out)
        return
    act = a.adapters[field]
    keep = act.keep if train else None
    if keep is not None:
        draw_keep(keep, buf.lora_dropout, generator)
    lora_forward(x, p.lora.a[0], p.lora.b[0], float(p.lora.scale[0]), keep, buf.xd[:, : x.shape[1]], act.h, p.bias,
                 out)
    linear_forward(x, p, out, accumulate=True)


def _project_backward(a: LayerActivations, field: str, p: Linear, grad: Linear, d_out: torch.Tensor,
                      x: torch.Tensor, d_x: torch.Tensor, buf: Buffers) -> None:
    """d_x = dL/dx of projection `field` (written), its gradients added: the adapter's first (it writes d_x), then
    the base's d_out W^T accumulated onto it."""
    if p.lora is None or grad.lora is None:
        linear_backward(d_out, x, p, _own(grad), d_x, buf.dequant)
        return
    act = a.adapters[field]
    lora_backward(d_out, x, p.lora.a[0], p.lora.b[0], float(p.lora.scale[0]), act.keep, act.h, grad.lora.a[0],
                  grad.lora.b[0], d_x, buf.d_h, buf.xd[:, : x.shape[1]])
    linear_backward(d_out, x, p, _own(grad), d_x, buf.dequant, accumulate=True)


def _own(grad: Linear | None) -> Linear | None:
    """A projection's own gradient, None where it is frozen (LoRA: only its adapter's gradient is there)."""
    return None if grad is None or grad.weight is None else grad


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
    gelu_forward(a.pre, buf.act, config.exact_gelu)  # recomputed: cheaper than keeping [N, 4C] per layer
    _project_backward(a, "mlp_c_proj", blk.mlp_c_proj, grad.mlp_c_proj, d_branch, buf.act, buf.d_act, buf)
    gelu_backward(buf.d_act, a.pre, buf.d_act, config.exact_gelu)
    _project_backward(a, "c_fc", blk.c_fc, grad.c_fc, buf.d_act, a.ln2, buf.d_ln, buf)
    layer_norm_backward(buf.d_ln, a.x_mid.view(n, C), a.ln2_mean, a.ln2_rstd, blk.ln_2, grad.ln_2,
                        buf.d_res, buf.xhat)
    # x_mid = x + attn(ln_1(x)) * k_a
    d_branch = buf.d_res if a.attn_keep is None else torch.mul(buf.d_res, a.attn_keep.view(n, C), out=buf.branch)
    _project_backward(a, "attn_c_proj", blk.attn_c_proj, grad.attn_c_proj, d_branch, a.y.view(n, C), buf.d_y, buf)
    attention_backward(buf.d_y.view(buf.batch, buf.context, C), a.heads, a.att, a.att_keep, config.n_head, buf.d_qkv,
                       buf.d_att, buf.d_heads, buf.d_yh, buf.dropped)
    _project_backward(a, "c_attn", blk.c_attn, grad.c_attn, buf.d_qkv.view(n, 3 * C), a.ln1, buf.d_ln, buf)
    layer_norm_backward(buf.d_ln, a.x.view(n, C), a.ln1_mean, a.ln1_rstd, blk.ln_1, grad.ln_1,
                        buf.d_res, buf.xhat)


def forward_loss(w: GPT2Weights, config: GPT2Config, buf: Buffers, ids: torch.Tensor, targets: torch.Tensor, *,
                 grads: GPT2Weights | None = None, grad_scale: float = 1.0,
                 generator: torch.Generator | None = None) -> float:
    """The summed cross-entropy of targets [B, T] (-1: not scored) given ids [B, T].

    With `grads`, a training step: dropout on (masks drawn from `generator`), and the backward runs too, adding
    grad_scale * dL/dp for every parameter p into `grads` (zero them first; accumulation is just not zeroing);
    None in `grads` marks a frozen tensor (LoRA: adapter_gradients). Without, an evaluation: no dropout, no backward.
    """
    train = grads is not None
    _check_step(buf, ids, targets, train, generator)
    n, C = ids.numel(), config.n_embd
    _embed_forward(w, buf, ids, train, generator)
    states = _blocks_forward(w, config, buf, train, generator)
    layer_norm_forward(buf.x_final.view(n, C), w.ln_f, config.layer_norm_epsilon, buf.lnf, buf.lnf_mean, buf.lnf_rstd)
    flat_targets = targets.reshape(-1)
    if not train:
        return head_cross_entropy(buf.lnf, w.head, flat_targets, buf.logits, grad_scale, None, None, buf.dequant)
    loss = head_cross_entropy(buf.lnf, w.head, flat_targets, buf.logits, grad_scale, grads.wte, buf.d_ln, buf.dequant)
    _backward(w, config, buf, ids, grads, generator, states)
    return loss


def _check_step(buf: Buffers, ids: torch.Tensor, targets: torch.Tensor, train: bool,
                generator: torch.Generator | None) -> None:
    """Raise ValueError unless ids and targets are the buffers' [B, T] and a training step with dropout has a
    generator to draw its masks from."""
    if tuple(ids.shape) != (buf.batch, buf.context) or targets.shape != ids.shape:
        raise ValueError(f"batch shape {list(ids.shape)} / targets {list(targets.shape)} do not match the buffers' "
                         f"[{buf.batch}, {buf.context}]")
    if train and buf.dropout > 0 and generator is None:
        raise ValueError("dropout needs a torch.Generator to draw its masks from")


def _embed_forward(w: GPT2Weights, buf: Buffers, ids: torch.Tensor, train: bool,
                   generator: torch.Generator | None) -> None:
    """ids [B, T] -> the first block's input buf.layers[0].x [B, T, C], embedding dropout applied in training."""
    x0 = buf.layers[0].x
    if w.wte_pages is None:
        embedding_forward(ids, w.wte, w.wpe, x0)
    else:  # a quantized base reads wte from the file: model.embed drops the pages each lookup maps
        torch.add(embed(w, ids), w.wpe[: ids.shape[1]], out=x0)
    if train and buf.embed_keep is not None:
        draw_keep(buf.embed_keep, buf.dropout, generator)
        x0.mul_(buf.embed_keep)


def _blocks_forward(w: GPT2Weights, config: GPT2Config, buf: Buffers, train: bool,
                    generator: torch.Generator | None) -> list[torch.Tensor]:
    """buf.layers[0].x [B, T, C] -> buf.x_final [B, T, C] through every block, keeping their activations; returns
    the generator's state before each block where a recomputing backward will draw its masks again."""
    outs = [a.x for a in buf.layers[1:]] + [buf.x_final]
    # with recompute, each block's backward first runs its forward again, drawing the same dropout masks from the
    # generator state it had the first time; the generator ends where the forward left it, so the run's masks are
    # the same with or without recompute, and so are the gradients, bit for bit
    states = []
    for a, blk, x_out in zip(buf.layers, w.blocks, outs):
        if train and buf.recompute and generator is not None:
            states.append(generator.get_state())
        block_forward(x_out, a, blk, config, buf, train, generator)
    return states


def _backward(w: GPT2Weights, config: GPT2Config, buf: Buffers, ids: torch.Tensor, grads: GPT2Weights,
              generator: torch.Generator | None, states: list[torch.Tensor]) -> None:
    """From the head's gradient at ln_f's output (buf.d_ln [N, C]): ln_f, the blocks last to first (each run forward
    again first with recompute, but the last, whose activations are still there), the embeddings."""
    B, T = ids.shape
    n, C = B * T, config.n_embd
    buf.d_res.zero_()
    layer_norm_backward(buf.d_ln, buf.x_final.view(n, C), buf.lnf_mean, buf.lnf_rstd, w.ln_f, grads.ln_f, buf.d_res,
                        buf.xhat)
    after = generator.get_state() if states else None
    for i in reversed(range(config.n_layer)):
        a, blk = buf.layers[i], w.blocks[i]
        if buf.recompute and i < config.n_layer - 1:
            if states:
                generator.set_state(states[i])
            block_forward(buf.recompute_out, a, blk, config, buf, True, generator)
        block_backward(a, blk, grads.blocks[i], config, buf)
    if after is not None:
        generator.set_state(after)
    if grads.wte is not None:
        d_x0 = buf.d_res if buf.embed_keep is None else buf.d_res.mul_(buf.embed_keep.view(n, C))
        embedding_backward(d_x0.view(B, T, C), ids, grads.wte, grads.wpe)


def zero_(w: GPT2Weights) -> None:
    """Set every tensor of a gradient GPT2Weights to zero."""
    for t in named_tensors(w).values():
        t.zero_()

