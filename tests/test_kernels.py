"""Native kernels: each routine against the torch reference, on every instruction set this CPU can run, and batch
invariance (a row's result does not depend on how many rows share the call) at the kernel and the model level."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2_engine import GPT2
from gpt2_engine.core.config import DECODE_ROWS
from gpt2_engine.core.kernels import cpu, decode_kernels
from gpt2_engine.core.model import linear, lm_head
from gpt2_engine.core.weights import PanelMatrix

ISAS = [isa for isa, have in (("avx2", cpu().avx2), ("avx512", cpu().avx512)) if have]


@pytest.fixture(scope="module")
def native():
    module = decode_kernels()
    assert module is not None, "the native decode kernels did not build (see the warning above)"
    return module


def test_cpu_facts_are_read() -> None:
    assert cpu().model != "unknown CPU" and cpu().avx2, "every machine of this project has AVX2+FMA"
    assert cpu().best_isa in ISAS


# (K, N): GPT-2 small's projections, the tiny test shape, and a width that is no multiple of the vector blocks
SHAPES = [(768, 2304), (3072, 768), (64, 192), (100, 37)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K,N", SHAPES)
def test_conv1d_rows_matches_torch_and_is_row_invariant(native, isa: str, K: int, N: int) -> None:
    g = torch.Generator().manual_seed(K + N)
    w, b, x = torch.randn(K, N, generator=g) * 0.05, torch.randn(N, generator=g), torch.randn(DECODE_ROWS, K, generator=g)
    full = native.conv1d_rows(x, w, b, isa == "avx512")  # [16, N]
    ref = torch.addmm(b.double(), x.double(), w.double())
    # float32 accumulation over K terms: bounded by K * eps * sum |x w| (a few 1e-6 here)
    bound = K * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double()).max().item()
    assert (full.double() - ref).abs().max().item() <= bound
    for m in range(1, DECODE_ROWS + 1):
        assert torch.equal(native.conv1d_rows(x[:m], w, b, isa == "avx512"), full[:m]), m
        assert torch.equal(native.conv1d_rows(x[m - 1 : m], w, b, isa == "avx512")[0], full[m - 1]), m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("offset", [1, 4, 15])
def test_conv1d_rows_gives_the_same_bits_for_weights_off_a_cache_line(native, isa: str, offset: int) -> None:
    """Weights used in place from a memory-mapped file can start anywhere past a 4-byte boundary; from 3 rows the
    AVX-512 passes then realign their tiles, with masked tiles at both ends of each thread's columns. Every element is
    still the same chains in k order: the bits of the same weights at an aligned address, at every row count."""
    g = torch.Generator().manual_seed(offset)
    for K, N in ((96, 2304), (64, 192)):  # many tiles a thread; one tile a thread (only the masked ones)
        aligned = torch.randn(K, N, generator=g)
        shifted = torch.empty(K * N + 16)[offset : offset + K * N].view(K, N)
        shifted.copy_(aligned)
        assert shifted.data_ptr() % 64 == 4 * offset % 64 and aligned.data_ptr() % 64 == 0
        b, x = torch.randn(N, generator=g), torch.randn(DECODE_ROWS, K, generator=g)
        for m in (1, 2, 3, 4, 8, 13, DECODE_ROWS):
            assert torch.equal(native.conv1d_rows(x[:m], shifted, b, isa == "avx512"),
                               native.conv1d_rows(x[:m], aligned, b, isa == "avx512")), (N, m)


@pytest.mark.parametrize("isa", ISAS)
def test_conv1d_rows_with_fewer_weight_rows_than_pieces_or_none(native, isa: str) -> None:
    """K is cut into up to 8 pieces (decode.cpp's KPIECES): with K = 5 each row is a piece, and with K = 0 the
    result is the bias alone."""
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(4, 5, generator=g), torch.randn(5, 70, generator=g), torch.randn(70, generator=g)
    full = native.conv1d_rows(x, w, b, isa == "avx512")
    assert (full.double() - torch.addmm(b.double(), x.double(), w.double())).abs().max().item() <= 1e-5
    assert torch.equal(native.conv1d_rows(x[1:2], w, b, isa == "avx512")[0], full[1])
    for dtype in (torch.float32, torch.bfloat16):
        empty = native.conv1d_rows(torch.zeros(3, 0), torch.zeros(0, 70, dtype=dtype), b, isa == "avx512")
        assert torch.equal(empty, b.expand(3, 70))


@pytest.mark.parametrize("isa", ISAS)
def test_conv1d_rows_adds_the_pieces_in_order_then_the_bias(native, isa: str) -> None:
    """With K = 8 each weight row is a piece (KPIECES) whose partial sum is one rounded product, so the result must be
    those products added in piece order, then the bias, each addition rounded to float32: bit for bit, in the
    vectorized columns and the odd ones past them, with 15 rows x 333 columns split between the threads mid-row."""
    g = torch.Generator().manual_seed(8)
    M, K, N = 15, 8, 333
    x, w, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randn(N, generator=g)
    products = x[:, :, None] * w[None]  # [M, K, N]
    total = products[:, 0]
    for p in range(1, K):
        total = total + products[:, p]
    assert torch.equal(native.conv1d_rows(x, w, b, isa == "avx512"), total + b)


def test_conv1d_rows_is_the_same_on_both_instruction_sets(native) -> None:
    if len(ISAS) < 2:
        pytest.skip("this CPU has AVX2 only; the AVX-512 path is checked on machines that have it")
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(768, 2304, generator=g), torch.randn(2304, generator=g), torch.randn(5, 768, generator=g)
    assert torch.equal(native.conv1d_rows(x, w, b, True), native.conv1d_rows(x, w, b, False))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("V,C", [(50257, 768), (1001, 64), (7, 100)])
def test_dot_rows_matches_torch_and_is_row_invariant(native, isa: str, V: int, C: int) -> None:
    g = torch.Generator().manual_seed(V)
    w, x = torch.randn(V, C, generator=g) * 0.1, torch.randn(DECODE_ROWS, C, generator=g)
    full = native.dot_rows(x, w, isa == "avx512")  # [16, V]
    ref = x.double() @ w.double().t()
    bound = C * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().t()).max().item()
    assert (full.double() - ref).abs().max().item() <= bound
    for m in (1, 2, 3, 4, 5, 8, 13, 16):
        assert torch.equal(native.dot_rows(x[:m], w, isa == "avx512"), full[:m]), m
    assert torch.equal(native.dot_rows(x[7:8], w, isa == "avx512")[0], full[7])


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_weights_give_the_bits_of_their_float32_widening(native, isa: str) -> None:
    """bf16 -> float32 is exact and the reduction order is the same, so a bf16 weight gives exactly the result of
    its widened float32 copy (projection with a scalar tail, and head), half the bytes read."""
    g = torch.Generator().manual_seed(5)
    w, b, x = torch.randn(768, 2320, generator=g).bfloat16(), torch.randn(2320, generator=g), torch.randn(5, 768, generator=g)
    avx512 = isa == "avx512"
    assert torch.equal(native.conv1d_rows(x, w, b, avx512), native.conv1d_rows(x, w.float(), b, avx512))
    head = torch.randn(1001, 100, generator=g).bfloat16()
    xh = torch.randn(5, 100, generator=g)
    assert torch.equal(native.dot_rows(xh, head, avx512), native.dot_rows(xh, head.float(), avx512))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("K,N", [(768, 2304), (3072, 768), (256, 64)])
def test_a_weight_in_panels_gives_the_bits_of_the_plain_weight(native, isa: str, dtype: torch.dtype, K: int,
                                                               N: int) -> None:
    """Panels (weights.PanelMatrix) change only the order in which conv1d_rows reads the weight: the same chains
    in the same order, so the same bits as the plain (K, N) weight (and as its float32 widening), at every row
    count."""
    g = torch.Generator().manual_seed(K + N)
    w, b, x = torch.randn(K, N, generator=g).to(dtype), torch.randn(N, generator=g), torch.randn(8, K, generator=g)
    panels = PanelMatrix.of(w, dtype)
    assert panels.panels.shape == (K // 32, N // 64, 32, 64)
    assert torch.equal(panels.dense(), w)
    assert torch.equal(native.unpack_panels(panels.panels), w.float())  # prefill's float32 matrix
    for m in range(1, 9):
        got = native.conv1d_rows(x[:m], panels.panels, b, isa == "avx512")
        assert torch.equal(got, native.conv1d_rows(x[:m], w, b, isa == "avx512")), m
        # and bfloat16's are those of its float32 widening: its kernels widen 16 weights into even and odd columns
        # and put the accumulators back in column order (decode.cpp's BF16::load16_split)
        assert torch.equal(got, native.conv1d_rows(x[:m], w.float(), b, isa == "avx512")), m


def test_kernels_reject_what_they_do_not_handle(native) -> None:
    with pytest.raises(RuntimeError, match=r"panels must be \[K / 32, N / 64, 32, 64\] with K a multiple of 256"):
        native.conv1d_rows(torch.zeros(1, 128), torch.zeros(4, 1, 32, 64), torch.zeros(64), False)
    with pytest.raises(RuntimeError, match="shapes do not chain"):
        native.conv1d_rows(torch.zeros(1, 512), torch.zeros(8, 1, 32, 64), torch.zeros(128), False)
    with pytest.raises(RuntimeError, match=r"unpack_panels: expected contiguous bfloat16 or float32 panels"):
        native.unpack_panels(torch.zeros(8, 1, 16, 64))
    with pytest.raises(RuntimeError, match="float32 x and b, float32 or bfloat16 w only"):
        native.conv1d_rows(torch.zeros(1, 4, dtype=torch.float64), torch.zeros(4, 4), torch.zeros(4), False)
    with pytest.raises(RuntimeError, match="shapes do not chain"):
        native.conv1d_rows(torch.zeros(1, 4), torch.zeros(5, 4), torch.zeros(4), False)


def test_model_projections_are_batch_invariant(model: GPT2) -> None:
    """linear() and lm_head(): a row gives the same bits alone and among 2 to 16 rows (it did not before: ~3e-6)."""
    g = torch.Generator().manual_seed(1)
    blk = model.weights.blocks[3]
    x = torch.randn(DECODE_ROWS, 1, 768, generator=g)  # [B, 1, C]: one decode step of 16 sequences
    with torch.inference_mode():
        proj, fc, head = linear(x, blk.c_attn), linear(x, blk.c_fc), lm_head(x, model.weights.head)
        for rows in range(1, DECODE_ROWS + 1):
            assert torch.equal(linear(x[:rows], blk.c_attn), proj[:rows])
            assert torch.equal(linear(x[:rows], blk.c_fc), fc[:rows])
            assert torch.equal(lm_head(x[:rows], model.weights.head), head[:rows])
            assert torch.equal(lm_head(x[rows - 1 : rows], model.weights.head), head[rows - 1 : rows])


# The quantized kernel's bodies: AVX-512 VNNI where the CPU has it, and the AVX2 one everywhere.
QUANT_PATHS = [vnni for vnni, have in ((True, cpu().avx512_vnni), (False, cpu().avx2)) if have]
# (K, N): GPT-2 small's projections, a small head (N no multiple of 16), and the tiny test shape
QUANT_SHAPES = [(768, 2304), (3072, 768), (64, 1001), (64, 37)]


@pytest.mark.parametrize("vnni", QUANT_PATHS, ids=lambda v: "vnni" if v else "avx2")
@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("K,N", QUANT_SHAPES)
def test_packed_rows_equals_the_torch_reference_bit_for_bit(native, vnni: bool, bits: int, K: int, N: int) -> None:
    """The kernel and projection.quantized_reference do the same arithmetic: identical bits, on each path, for 1 to
    16 rows and for a prefill-sized input (the same kernel serves every row count; 6 bits read directly below 4
    rows and widened to 8 bits from 4 up)."""
    from gpt2_engine.core.projection import quantized_reference
    from gpt2_engine.core.quantize import quantize_matrix

    g = torch.Generator().manual_seed(K + N + bits)
    m = quantize_matrix(torch.randn(K, N, generator=g) * 0.05, bits)
    b, x = torch.randn(N, generator=g), torch.randn(40, K, generator=g)
    x[3, :32] = 0  # a group of zeros: scale 0, no division by it
    full = native.packed_rows(x, m.packed, m.scales, b, N, bits, vnni)  # [40, N]
    assert torch.equal(full, quantized_reference(x, m, b))
    for rows in (1, 2, 3, 4, 5, 8, 13, 16):
        assert torch.equal(native.packed_rows(x[:rows], m.packed, m.scales, b, N, bits, vnni), full[:rows]), rows
    assert torch.equal(native.packed_rows(x[7:8], m.packed, m.scales, b, N, bits, vnni)[0], full[7])
    no_bias = native.packed_rows(x[:2], m.packed, m.scales, torch.empty(0), N, bits, vnni)
    assert torch.equal(no_bias, quantized_reference(x[:2], m, None))


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_packed_rows_error_is_the_activation_rounding(native, bits: int) -> None:
    """Against the float product with the dequantized weight, the only difference is rounding each activation to
    its group's int8 step s (|error| <= s / 2): bounded by sum over k of s_group(k) / 2 * |w[k, n]|, plus float32
    rounding of the sum."""
    from gpt2_engine.core.projection import quantize_activations
    from gpt2_engine.core.quantize import dequantize, quantize_matrix

    g = torch.Generator().manual_seed(bits)
    K, N = 768, 512
    m = quantize_matrix(torch.randn(K, N, generator=g) * 0.05, bits)
    w, x, b = dequantize(m).double(), torch.randn(6, K, generator=g), torch.zeros(N)
    got = native.packed_rows(x, m.packed, m.scales, b, N, bits, cpu().avx512_vnni).double()
    _, scales = quantize_activations(x)  # [6, K / 32]
    step = scales.double().repeat_interleave(32, dim=1)  # [6, K]
    bound = (step / 2) @ w.abs() + 1e-5 * (x.double().abs() @ w.abs())
    err = (got - x.double() @ w).abs()
    assert (err <= bound).all() and err.max() > 0


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_dequantize_panels_is_what_the_kernel_multiplies(native, bits: int) -> None:
    """dequantize_panels (the backward's weight) equals quantize.dequantize, column range by column range."""
    from gpt2_engine.core.projection import dequantize_columns
    from gpt2_engine.core.quantize import dequantize, quantize_matrix

    m = quantize_matrix(torch.randn(96, 70, generator=torch.Generator().manual_seed(bits)), bits)
    full = dequantize(m)
    for first, end in ((0, 70), (16, 33), (64, 70)):
        assert torch.equal(dequantize_columns(m, first, end), full[:, first:end]), (first, end)


def test_packed_rows_rejects_what_it_does_not_handle(native) -> None:
    from gpt2_engine.core.quantize import quantize_matrix

    m = quantize_matrix(torch.randn(64, 32), 4)
    with pytest.raises(RuntimeError, match="bits must be 8, 6 or 4"):
        native.packed_rows(torch.zeros(1, 64), m.packed, m.scales, torch.zeros(32), 32, 2, False)
    with pytest.raises(RuntimeError, match="do not match"):
        native.packed_rows(torch.zeros(1, 64), m.packed, m.scales, torch.zeros(32), 32, 8, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.packed_rows(torch.zeros(1, 48), m.packed, m.scales, torch.zeros(32), 32, 4, False)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_model_projections_are_batch_invariant(small_dir, fmt: str) -> None:
    """A quantized model's projections and head run on packed_rows: a row's result is the same bits alone, among
    up to 16 rows, and inside a prefill."""
    model = GPT2.from_pretrained(small_dir, quantize=fmt)
    x = torch.randn(40, 1, 768, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        head, fc = lm_head(x, model.weights.head), linear(x, model.weights.blocks[0].c_fc)
        for rows in (1, 3, 16):
            assert torch.equal(lm_head(x[:rows], model.weights.head), head[:rows])
            assert torch.equal(linear(x[:rows], model.weights.blocks[0].c_fc), fc[:rows])


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_torch_fallback_gives_the_native_bits(small_dir, monkeypatch, fmt: str) -> None:
    """Where the kernels cannot be built, projection.py runs quantized_reference: the same arithmetic, so the same
    logits to the bit (only slower); float32 falls back to torch's matmuls (equal to rounding)."""
    import gpt2_engine.core.projection as projection

    quantized, fp32 = GPT2.from_pretrained(small_dir, quantize=fmt), GPT2.from_pretrained(small_dir)
    ids = torch.tensor([[464, 2068, 7586, 21831, 18045]])
    native_q, native_f = quantized(ids), fp32(ids)
    monkeypatch.setattr(projection, "decode_kernels", lambda: None)
    assert torch.equal(quantized(ids), native_q)
    assert (fp32(ids) - native_f).abs().max() <= 1e-5 * native_f.abs().max()  # measured 1.8e-6 of it


@pytest.mark.parametrize("isa", ISAS)
def test_decode_attention_matches_torch_and_ignores_the_other_rows(native, isa: str) -> None:
    """One decode step over several cache slots at different lengths: each row's key and value land at its
    position, and its output equals softmax(q k^T / sqrt(hs)) v over its own slot's keys (to float32 rounding),
    the same bits alone or among others."""
    g = torch.Generator().manual_seed(4)
    slots_n, nh, L, hs = 5, 12, 40, 64
    k, v = torch.randn(slots_n, nh, L, hs, generator=g), torch.randn(slots_n, nh, L, hs, generator=g)
    q, kn, vn = (torch.randn(4, nh, hs, generator=g) for _ in range(3))
    slots, starts = torch.tensor([3, 0, 4, 1]), torch.tensor([39, 0, 16, 32])
    out = native.decode_attention(q, kn, vn, k, v, slots, starts, isa == "avx512")  # [4, nh, hs]
    for r in range(4):
        s, n = int(slots[r]), int(starts[r]) + 1
        assert torch.equal(k[s, :, n - 1], kn[r]) and torch.equal(v[s, :, n - 1], vn[r])
        ref = torch.softmax(q[r, :, None].double() @ k[s, :, :n].double().transpose(-1, -2) / 8, -1) @ v[s, :, :n].double()
        assert (out[r].double() - ref[:, 0]).abs().max() < 1e-5
        alone = native.decode_attention(q[r : r + 1], kn[r : r + 1], vn[r : r + 1], k, v, slots[r : r + 1],
                                        starts[r : r + 1], isa == "avx512")
        assert torch.equal(alone[0], out[r])
    with pytest.raises(RuntimeError, match="out of range"):
        native.decode_attention(q[:1], kn[:1], vn[:1], k, v, torch.tensor([5]), torch.tensor([3]), isa == "avx512")


@pytest.mark.skipif(not cpu().avx512, reason="this CPU has no AVX-512: prompts run in torch's fused attention kernel here, which the parity tests cover")
@pytest.mark.parametrize("B,T,S", [(1, 1, 1), (2, 17, 17), (1, 37, 50), (1, 130, 130), (1, 16, 300)])
def test_prefill_attention_matches_causal_softmax(native, B: int, T: int, S: int) -> None:
    """A prompt's causal attention, T queries at the last T of S positions, read straight from strided views (q
    from the fused Q/K/V projection's output, k and v from a cache longer than S): each query's output equals
    softmax(q k^T / 8) v over the keys up to its own position, in float64, to float32 rounding (~1e-7 measured; torch's
    fused kernel is as far from it), and the result comes back with the heads merged."""
    g = torch.Generator().manual_seed(T + S)
    qkv = torch.randn(B, T, 3 * 768, generator=g)
    q = qkv[..., :768].view(B, T, 12, 64).transpose(1, 2)  # [B, nh, T, hs], rows 2304 floats apart
    cache = torch.randn(2, B, 12, S + 9, 64, generator=g)
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]  # [B, nh, S, hs]
    out = native.prefill_attention(q, k, v)
    assert out.shape == (B, T, 12, 64) and out.is_contiguous()
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    scores = (q.double() @ k.double().transpose(-1, -2) / 8).masked_fill(~mask, -torch.inf)
    ref = (torch.softmax(scores, -1) @ v.double()).transpose(1, 2)  # [B, T, nh, hs]
    assert (out.double() - ref).abs().max() < 2e-6
    if S == T:  # torch's fused kernel: what the model ran before
        fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        assert (out - fused).abs().max() < 2e-6


@pytest.mark.skipif(not cpu().avx512, reason="this CPU has no AVX-512, so the prompt attention kernel is never called here")
def test_prefill_attention_rejects_what_it_does_not_handle(native) -> None:
    q = torch.zeros(1, 2, 4, 64)
    with pytest.raises(RuntimeError, match="S >= T"):
        native.prefill_attention(q, torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64))
    with pytest.raises(RuntimeError, match=r"\[B, nh, T, 64\]"):
        native.prefill_attention(torch.zeros(1, 2, 4, 32), torch.zeros(1, 2, 4, 32), torch.zeros(1, 2, 4, 32))
    with pytest.raises(RuntimeError, match="float32"):
        native.prefill_attention(q.double(), q.double(), q.double())
    with pytest.raises(RuntimeError, match="hs must be contiguous"):
        t = torch.zeros(1, 2, 64, 4).transpose(2, 3)
        native.prefill_attention(t, t, t)


def test_gelu_is_the_tanh_form_and_the_decode_steps(native) -> None:
    """model.gelu on a prompt's activations: GPT-2's tanh form 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), against
    the latter in float64 (the former cancels in float64 too where tanh(u) is near -1): within 2e-6 relative where
    the value passes 1e-3 (1e-6 measured), and 1e-9 absolute below (9e-10 measured; torch's float32 kernel is
    4e-7 absolute off the same reference, this one 5e-7). Elementwise, so any slice has the bits the same values get
    alone (a decode step's rows)."""
    import math

    from gpt2_engine.core.ops import gelu

    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 3072, generator=g) * 4
    x[0, :4] = torch.tensor([0.0, -30.0, 30.0, 1e-30])
    y = gelu(x)
    xd = x.double()
    ref = xd / (1 + torch.exp(-2 * math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3)))
    err, big = (y.double() - ref).abs(), ref.abs() > 1e-3
    assert (err[big] <= 2e-6 * ref.abs()[big]).all() and (err[~big] <= 1e-9).all()
    assert y[0, 0] == 0 and y[0, 2] == 30.0 and -1e-30 < y[0, 1] <= 0
    assert torch.equal(gelu(x[7:8, 5:77]), y[7:8, 5:77])
    assert torch.equal(native.gelu(x[:, ::2]), y[:, ::2])  # strided input: copied first
    out = torch.empty_like(x)  # the training step's buffer
    gelu(x, out)
    assert torch.equal(out, y)
    with pytest.raises(RuntimeError, match="out must be a contiguous float32 tensor of x's shape"):
        native.gelu(x, torch.empty(3))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(),
                    reason="the loaded libgomp is read from /proc/self/maps, which only Linux has")
def test_kernels_share_torchs_openmp_runtime(native) -> None:
    """The kernels are built with OpenMP (without it at::parallel_for is a serial loop) and bind to the one libgomp
    torch loaded, so that there is one thread pool, not two competing for the cores."""
    assert b"GOMP_parallel" in Path(native.__file__).read_bytes()  # parallel_for's regions call into libgomp
    # in a fresh process: this one may hold other packages' own libgomp copies (sentencepiece's wheel bundles one)
    code = ("import torch; from pathlib import Path; from gpt2_engine.core.kernels import decode_kernels; "
            "decode_kernels(); print(sorted({l.split()[-1] for l in Path('/proc/self/maps').read_text().splitlines() "
            "if 'libgomp' in l}))")
    gomp = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert len(gomp) == 1 and Path(gomp[0]).parent.resolve() == (Path(torch.__file__).parent / "lib").resolve(), gomp


def test_kernels_give_the_same_bits_on_any_number_of_threads(native) -> None:
    """Each output element is computed by one thread in a fixed order, so 1 and 2 threads agree to the bit."""
    from gpt2_engine.core.quantize import quantize_matrix

    g = torch.Generator().manual_seed(11)
    x, w, b = torch.randn(5, 768, generator=g), torch.randn(768, 2304, generator=g) * 0.05, torch.randn(2304, generator=g)
    head = torch.randn(1001, 768, generator=g)
    m = quantize_matrix(w, 4)
    kc, vc = torch.randn(3, 12, 40, 64, generator=g), torch.randn(3, 12, 40, 64, generator=g)
    q, kn, vn = (torch.randn(3, 12, 64, generator=g) for _ in range(3))
    slots, starts = torch.tensor([2, 0, 1]), torch.tensor([39, 5, 20])

    def run() -> list[torch.Tensor]:
        k, v = kc.clone(), vc.clone()
        out = [native.conv1d_rows(x, w, b, cpu().avx512), native.dot_rows(x, head, cpu().avx512),
               native.packed_rows(x, m.packed, m.scales, b, 2304, 4, cpu().avx512_vnni),
               native.decode_attention(q, kn, vn, k, v, slots, starts, cpu().avx512), native.gelu(w)]
        if cpu().avx512:
            out.append(native.prefill_attention(kc[:, :, :33], kc, vc))  # [3, 12, 33 of 40, 64]: S > T
        return out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
