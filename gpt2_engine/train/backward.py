"""GPT-2's layers in training mode: each a forward that keeps what its backward needs, and a hand-written backward.

llm.c's layout (train_gpt2.c), in torch: every function works on 2-D row-major views of buffers that the caller
allocated once for the run (train/step.py), writes its outputs with `out=`, and `+=`s into gradient buffers.
Nothing here allocates a tensor the size of an activation but the temporaries a single torch expression makes.
No autograd: the chain rule is written out, one line in each docstring. torch runs the matmuls and elementwise ops.

Notation as in model.py: B batch, T tokens, C channels, nh heads, hs = C // nh, N = B*T rows, V vocabulary.
Dropout is inverted dropout with masks drawn ahead (`keep`: 0 where dropped, 1 / (1 - p) where kept), so the same
multiply is the forward and the backward of dropout, and p = 0 (keep is None) is the inference forward.
"""

from __future__ import annotations

import math

import torch

from ..core.ops import gelu
from ..core.model import query_blocks, split_heads
from ..core.packed import PackedMatrix
from ..core.projection import HEAD_BLOCK, dequantize_columns, project
from ..core.weights import LayerNorm, Linear, QuantizedMatrix, float_matrix


def draw_keep(keep: torch.Tensor | None, p: float, generator: torch.Generator) -> None:
    """Refill a dropout mask in place: each entry 1 / (1 - p) with probability 1 - p, else 0 (None: no dropout)."""
    if keep is not None:
        keep.bernoulli_(1.0 - p, generator=generator).mul_(1.0 / (1.0 - p))


# --- layer norm ------------------------------------------------------------------------------------------------------

def layer_norm_forward(x: torch.Tensor, p: LayerNorm, eps: float, out: torch.Tensor, mean: torch.Tensor,
                       rstd: torch.Tensor) -> None:
    """x [N, C] -> out [N, C] = (x - mean) * rstd * w + b, keeping mean and rstd = 1 / sqrt(var + eps) [N].
    torch's fused layer norm, the kernel of model.layer_norm, which also hands back the two statistics."""
    y, m, r = torch.native_layer_norm(x, (x.shape[-1],), p.weight, p.bias, eps)
    out.copy_(y)
    mean.copy_(m.view(-1))
    rstd.copy_(r.view(-1))


def layer_norm_backward(d_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, p: LayerNorm,
                        grad: LayerNorm | None, d_x: torch.Tensor, xhat: torch.Tensor) -> None:
    """d_out [N, C] -> d_x [N, C] += dL/dx; grad.weight += sum_rows(d_out * xhat), grad.bias += sum_rows(d_out)
    (grad None: frozen, only d_x).

    With xhat = (x - mean) * rstd and g = d_out * w, the chain rule through the normalisation is
        dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)).
    `xhat` [N, C] is scratch.
    """
    torch.sub(x, mean[:, None], out=xhat).mul_(rstd[:, None])  # [N, C]
    if grad is not None:
        grad.weight.add_((d_out * xhat).sum(0))
        grad.bias.add_(d_out.sum(0))
    g = d_out * p.weight  # [N, C]
    C = x.shape[-1]
    g_mean = g.sum(-1, keepdim=True).div_(C)  # [N, 1]
    gx_mean = (g * xhat).sum(-1, keepdim=True).div_(C)  # [N, 1]
    d_x.add_(g.sub_(g_mean).sub_(xhat.mul_(gx_mean)).mul_(rstd[:, None]))


# --- Conv1D projections ----------------------------------------------------------------------------------------------

def linear_forward(x: torch.Tensor, p: Linear, out: torch.Tensor, accumulate: bool = False) -> None:
    """x [N, in] -> out [N, out] = x W + b (Conv1D: W is (in, out)); a quantized W (a frozen QLoRA base) through
    the engine's blockwise kernel, as inference runs it. `accumulate`: out += x W, the bias already in out."""
    if isinstance(p.weight, QuantizedMatrix):
        if accumulate:
            out.add_(project(x, p.weight, None))
        else:
            out.copy_(project(x, p.weight, p.bias))
        return
    w = float_matrix(p.weight)  # a frozen LoRA base that inference keeps in panels: the file's matrix beside them
    if accumulate:
        out.addmm_(x, w)  # beta = 1 inside the GEMM: no separate pass over out
    else:
        torch.addmm(p.bias, x, w, out=out)


def linear_backward(d_out: torch.Tensor, x: torch.Tensor, p: Linear, grad: Linear | None,
                    d_x: torch.Tensor | None, scratch: torch.Tensor | None = None, accumulate: bool = False) -> None:
    """d_out [N, out] -> d_x [N, in] = d_out W^T (written; added with `accumulate`); grad.weight += x^T d_out,
    grad.bias += sum_rows(d_out). grad None: a frozen layer, only d_x. A quantized W is widened to float32 into
    `scratch` (in * out floats) for the one GEMM: the dequantization reads the packed bytes once, and MKL's GEMM
    then runs at its float32 speed, where a GEMM on the packed format would have to re-expand every group per row."""
    if grad is not None:
        grad.weight.addmm_(x.t(), d_out)  # [in, out]
        grad.bias.add_(d_out.sum(0))
    if d_x is None:
        return
    w = p.weight
    if isinstance(w, QuantizedMatrix):
        w = dequantize_columns(w, 0, w.out_features, scratch)  # (in, out), maybe a strided view of the padded panels
    else:
        w = float_matrix(w)
    if accumulate:
        d_x.addmm_(d_out, w.t())
    else:
        torch.mm(d_out, w.t(), out=d_x)


# --- LoRA ------------------------------------------------------------------------------------------------------------

def lora_forward(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, keep: torch.Tensor | None,
                 xd: torch.Tensor, hs: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> None:
    """out [N, out] = bias + scale * (dropout(x) A) B, keeping hs = scale * dropout(x) A [N, r] (core/lora.py's
    term; A (in, r), B (r, out)); the base projection then accumulates x W onto it (linear_forward's
    `accumulate`). `keep` is the adapter's dropout mask on x [N, in] (None: no dropout); `xd` [N, in] is scratch."""
    xin = x if keep is None else torch.mul(x, keep, out=xd)
    torch.mm(xin, a, out=hs).mul_(scale)
    torch.addmm(bias, hs, b, out=out)


def lora_backward(d_out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                  keep: torch.Tensor | None, hs: torch.Tensor, grad_a: torch.Tensor, grad_b: torch.Tensor,
                  d_x: torch.Tensor, d_h: torch.Tensor, xd: torch.Tensor) -> None:
    """d_out [N, out] -> d_x [N, in] = the adapter's share (written; the base's d_out W^T is added after it);
    grads of A and B added. With h = xd A, xd = x * keep the adapter's input after dropout, hs = scale * h:
        grad_B += hs^T d_out;  d_h = scale * d_out B^T;  grad_A += xd^T d_h;  d_x = (d_h A^T) * keep
    `d_h` [N, r] and `xd` [N, in] are scratch."""
    grad_b.addmm_(hs.t(), d_out)  # [r, out]
    torch.mm(d_out, b.t(), out=d_h).mul_(scale)  # [N, r]
    xin = x if keep is None else torch.mul(x, keep, out=xd)
    grad_a.addmm_(xin.t(), d_h)  # [in, r]
    torch.mm(d_h, a.t(), out=d_x)
    if keep is not None:
        d_x.mul_(keep)


# --- tanh GELU -------------------------------------------------------------------------------------------------------

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def gelu_forward(x: torch.Tensor, out: torch.Tensor, exact: bool = False) -> None:
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's tanh form: model.gelu, into the step's buffer
    (`exact`: the erf form, a nanoGPT model's)."""
    gelu(x, out, exact)


def gelu_backward(d_out: torch.Tensor, x: torch.Tensor, d_x: torch.Tensor, exact: bool = False) -> None:
    """d_x = d_out * gelu'(x), written. With u = sqrt(2/pi) (x + a x^3) and t = tanh(u):
        gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 a x^2).
    Written out in torch ops that line is nine passes over [N, 4C] with temporaries, a tenth of a training step at
    T = 512, so the step runs it as torch's fused elementwise kernel for this derivative (one pass);
    gelu_backward_reference is the line itself, and the tests hold the two to rounding of each other. `exact`: the
    erf form's derivative, Phi(x) + x phi(x), by the same fused kernel."""
    torch.ops.aten.gelu_backward.grad_input(d_out, x, approximate="none" if exact else "tanh", grad_input=d_x)


def gelu_backward_reference(d_out: torch.Tensor, x: torch.Tensor, d_x: torch.Tensor) -> None:
    """gelu_backward written out in torch ops, term by term."""
    x2 = x * x
    t = torch.tanh(x2.mul(GELU_A).add_(1.0).mul_(x).mul_(GELU_C))  # tanh(u)
    # 0.5 x (1 - t^2) c (1 + 3a x^2), then + 0.5 (1 + t)
    x2.mul_(3.0 * GELU_A).add_(1.0).mul_(x).mul_(0.5 * GELU_C).mul_(1.0 - t * t)
    torch.mul(x2.add_(t.add_(1.0).mul_(0.5)), d_out, out=d_x)


# --- causal self-attention (seed 002, llm.c's attention layer) -----------------------------------------------------

def attention_buffers(B: int, n_head: int, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One [B, nh, j - i, j] tensor per causal block: where the attention weights of that block's rows live."""
    return tuple(torch.zeros(B, n_head, j - i, j, dtype=dtype) for i, j, _ in query_blocks(T, T))


def _block_view(flat: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous [shape] view at the start of a flat scratch buffer (sized for the largest block)."""
    return flat[: math.prod(shape)].view(shape)


def attention_forward(qkv: torch.Tensor, n_head: int, heads: torch.Tensor, att: tuple[torch.Tensor, ...],
                      keep: tuple[torch.Tensor, ...] | None, future: torch.Tensor, y: torch.Tensor,
                      dropped: torch.Tensor | None) -> None:
    """qkv [B, T, 3C] -> y [B, T, C], the heads merged; keeps q, k, v head-major in `heads` [3, B, nh, T, hs] and
    the softmax before dropout in `att`, block by block (model.query_blocks: rows [i, j) in att[b] [B, nh, j - i, j]).

        S = q k^T / sqrt(hs), S_ij = -inf for j > i;  A = softmax(S);  A' = A * keep;  y = merge_heads(A' v)

    The heads are copied out of qkv once: the blocks' batched matmuls on contiguous [hs]-rows run about 1.7x faster
    than on the strided views of qkv, which torch would copy block by block. `future` [T, T] is True above the
    diagonal; `dropped` (flat, only with dropout) is scratch.
    """
    B, T, C = y.shape
    hs = C // n_head
    heads.copy_(qkv.view(B, T, 3, n_head, hs).permute(2, 0, 3, 1, 4))
    q, k, v = heads  # 3 x [B, nh, T, hs], contiguous
    y_heads = y.view(B, T, n_head, hs)  # [B, T, nh, hs]
    for b, (i, j, _) in enumerate(query_blocks(T, T)):
        s = att[b]  # [B, nh, r, j]
        torch.matmul(q[:, :, i:j], k[:, :, :j].transpose(-2, -1), out=s)
        s.mul_(1.0 / math.sqrt(hs))
        s[..., i:j].masked_fill_(future[i:j, i:j], -math.inf)  # keys [0, i) are all before the block's rows
        # softmax in place, row by row: exp(s - max) / sum; a masked score's exp is exactly 0
        s.sub_(s.amax(-1, keepdim=True)).exp_()
        s.div_(s.sum(-1, keepdim=True))
        if keep is not None:
            s = torch.mul(s, keep[b], out=_block_view(dropped, *s.shape))  # A'
        y_heads[:, i:j].copy_((s @ v[:, :, :j]).transpose(1, 2))  # [B, r, nh, hs]


def attention_backward(d_y: torch.Tensor, heads: torch.Tensor, att: tuple[torch.Tensor, ...],
                       keep: tuple[torch.Tensor, ...] | None, n_head: int, d_qkv: torch.Tensor, d_att: torch.Tensor,
                       d_heads: torch.Tensor, d_yh: torch.Tensor, dropped: torch.Tensor | None) -> None:
    """d_y [B, T, C] -> d_qkv [B, T, 3C] (written), block by block; each line the chain rule through one forward
    line, last first:

        dA' = dY_h v^T;  dv = A'^T dY_h             y_h = A' v
        dA = dA' * keep                              A' = A * keep
        dS = A * (dA - rowsum(dA * A))               softmax; a masked entry has A = 0, so dS = 0 there
        dq = dS k / sqrt(hs);  dk = dS^T q / sqrt(hs)    S = q k^T / sqrt(hs)

    A block's rows give dq for those rows and add to dk and dv for keys [0, j): `d_heads` [3, B, nh, T, hs] gathers
    dq, dk, dv head-major, as `heads` holds q, k, v, and goes into d_qkv in one copy. `d_yh` [B, nh, T, hs] is d_y's
    heads, copied once; `d_att` and `dropped` (flat, the latter only with dropout) are scratch.
    """
    B, T, C = d_y.shape
    q, k, v = heads  # 3 x [B, nh, T, hs]
    dq, dk, dv = d_heads
    d_yh.copy_(split_heads(d_y, n_head))
    dk.zero_()
    dv.zero_()
    scale = 1.0 / math.sqrt(C // n_head)
    for b, (i, j, _) in enumerate(query_blocks(T, T)):
        a = att[b]  # [B, nh, r, j]
        a_used = a if keep is None else torch.mul(a, keep[b], out=_block_view(dropped, *a.shape))  # A'
        dv[:, :, :j].add_(a_used.transpose(-2, -1) @ d_yh[:, :, i:j])
        d_s = _block_view(d_att, *a.shape)
        torch.matmul(d_yh[:, :, i:j], v[:, :, :j].transpose(-2, -1), out=d_s)  # dA'
        if keep is not None:
            d_s.mul_(keep[b])  # dA
        row = torch.linalg.vecdot(d_s, a).unsqueeze(-1)  # [B, nh, r, 1]: rowsum(dA * A)
        d_s.sub_(row).mul_(a).mul_(scale)  # dS / sqrt(hs)
        torch.matmul(d_s, k[:, :, :j], out=dq[:, :, i:j])
        dk[:, :, :j].add_(d_s.transpose(-2, -1) @ q[:, :, i:j])
    d_qkv.view(B, T, 3, n_head, C // n_head).copy_(d_heads.permute(1, 3, 0, 2, 4))


# --- embeddings ------------------------------------------------------------------------------------------------------

def embedding_forward(ids: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor, out: torch.Tensor) -> None:
    """ids [B, T] -> out [B, T, C] = wte[ids] + wpe[0:T]."""
    T = ids.shape[1]
    torch.index_select(wte, 0, ids.reshape(-1), out=out.view(-1, out.shape[-1]))
    out.add_(wpe[:T])


def embedding_backward(d_out: torch.Tensor, ids: torch.Tensor, grad_wte: torch.Tensor, grad_wpe: torch.Tensor) -> None:
    """d_out [B, T, C]: grad_wte[ids[b, t]] += d_out[b, t] (a scatter-add: repeated tokens add up);
    grad_wpe[t] += sum_b d_out[b, t]."""
    T = ids.shape[1]
    grad_wte.index_add_(0, ids.reshape(-1), d_out.reshape(-1, d_out.shape[-1]))
    grad_wpe[:T].add_(d_out.sum(0))


# --- the tied head with cross-entropy, fused -------------------------------------------------------------------------


def head_cross_entropy(x: torch.Tensor, wte: torch.Tensor | QuantizedMatrix | PackedMatrix, targets: torch.Tensor,
                       logits: torch.Tensor, grad_scale: float, grad_wte: torch.Tensor | None,
                       d_x: torch.Tensor | None, scratch: torch.Tensor | None = None) -> float:
    """x [N, C] (after ln_f), targets [N] (-1: not scored) -> the summed cross-entropy of the scored rows.

    With d_x (the backward fused in, scaling the loss's gradient by `grad_scale`; grad_wte None: a frozen head):
        z = x wte^T;  P = softmax(z);  L = sum_i (logsumexp(z_i) - z_i[target_i])
        dz = grad_scale * (P - onehot(target)), 0 on unscored rows
        d_x = dz wte (written);  grad_wte += dz^T x      (the head is wte itself: GPT-2 ties them)
    The rows go through in chunks of R = logits.shape[1]: `logits` [V, R] is the one vocabulary-wide buffer there
    is. It holds z transposed, one column per row of x, because wte x^T runs a third faster in MKL's GEMM than
    x wte^T does at these shapes (a tall (V, C) operand, not a transposed wide one). A quantized head (QLoRA's
    frozen int8 head, (C, V)) runs the inference kernel forward and widens HEAD_BLOCK of the vocabulary at a time
    into `scratch` for d_x, so no float32 copy of the whole head ever exists. A packed head (a LoRA base loaded
    with packed exponents) is read as the wte it keeps beside its units.
    """
    if isinstance(wte, PackedMatrix):
        wte = wte.matrix()  # [V, C]: wte itself, no copy
    R = logits.shape[1]
    total = torch.zeros((), dtype=torch.float64)
    for r0 in range(0, x.shape[0], R):
        xc, tc = x[r0 : r0 + R], targets[r0 : r0 + R]  # [r, C], [r]
        z = logits[:, : xc.shape[0]]  # [V, r]
        if isinstance(wte, QuantizedMatrix):
            z.copy_(project(xc, wte, None).t())
        else:
            torch.mm(wte, xc.t(), out=z)
        scored = (tc >= 0).to(z.dtype)[None, :]  # [1, r]: 1 for a scored row, 0 for one that is not
        t = tc.clamp(min=0)[None, :]  # [1, r]
        target_logit = z.gather(0, t)  # [1, r]
        top = z.amax(0, keepdim=True)  # [1, r]
        z.sub_(top).exp_()  # exp(z - max), in (0, 1]
        sums = z.sum(0, keepdim=True)  # [1, r]
        nll = sums.log().add_(top).sub_(target_logit)  # [1, r]: logsumexp(z) - z[target]
        total += (nll * scored).sum(dtype=torch.float64)
        if d_x is None:
            continue
        z.mul_(scored.mul(grad_scale).div_(sums))  # grad_scale * P, zero on unscored rows
        z.scatter_add_(0, t, scored.mul(-grad_scale))  # - grad_scale * onehot(target)
        rows = d_x[r0 : r0 + xc.shape[0]]  # [r, C]
        if isinstance(wte, QuantizedMatrix):
            rows.zero_()
            for v0 in range(0, wte.out_features, HEAD_BLOCK):
                v1 = min(v0 + HEAD_BLOCK, wte.out_features)
                rows.addmm_(z[v0:v1].t(), dequantize_columns(wte, v0, v1, scratch).t())  # [r, C]
        else:
            torch.mm(z.t(), wte, out=rows)
        if grad_wte is not None:
            grad_wte.addmm_(z, xc)  # [V, C]
    return float(total)
