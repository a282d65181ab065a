"""Native kernels: each routine against the torch reference, on every instruction set this CPU can run, and batch
invariance (a row's result does not depend on how many rows share the call) at the kernel and the model level."""

from __future__ import annotations

import pytest
import torch

from gpt2_engine import GPT2
from gpt2_engine.core.kernels import cpu, decode_kernels
from gpt2_engine.core.model import DECODE_ROWS, linear, lm_head

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


def test_kernels_reject_what_they_do_not_handle(native) -> None:
    with pytest.raises(RuntimeError, match="float32 tensors only"):
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


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K,N", SHAPES)
def test_int8_rows_matches_the_widened_reference_and_is_row_invariant(native, isa: str, K: int, N: int) -> None:
    """Weight-only int8: (x @ q) * s + b against x @ (q * s) + b, the torch path that widens the weights first."""
    from gpt2_engine.core.model import as_float32
    from gpt2_engine.core.quantize import quantize_linear
    from gpt2_engine.core.weights import Linear as Lin

    g = torch.Generator().manual_seed(K * N)
    lin = quantize_linear(Lin(torch.randn(K, N, generator=g) * 0.05, torch.randn(N, generator=g)))
    q, s = lin.weight.values, lin.weight.scales.view(-1)
    x = torch.randn(DECODE_ROWS, K, generator=g)
    full = native.int8_rows(x, q, s, lin.bias, isa == "avx512")
    widened = as_float32(lin.weight).double()
    ref = x.double() @ widened + lin.bias.double()
    bound = K * torch.finfo(torch.float32).eps * (x.abs().double() @ widened.abs()).max().item()
    assert (full.double() - ref).abs().max().item() <= bound
    for m in range(1, DECODE_ROWS + 1):
        assert torch.equal(native.int8_rows(x[:m], q, s, lin.bias, isa == "avx512"), full[:m]), m


@pytest.mark.parametrize("isa", ISAS)
def test_int8_head_matches_the_widened_reference_and_is_row_invariant(native, isa: str) -> None:
    from gpt2_engine.core.quantize import quantize_rows

    g = torch.Generator().manual_seed(3)
    q, s = quantize_rows(torch.randn(1001, 64, generator=g) * 0.1)
    x = torch.randn(DECODE_ROWS, 64, generator=g)
    full = native.int8_dot_rows(x, q, s.view(-1), isa == "avx512")
    widened = q.double() * s.double()
    ref = x.double() @ widened.t()
    assert (full.double() - ref).abs().max().item() <= 64 * torch.finfo(torch.float32).eps * (x.abs().double() @ widened.abs().t()).max().item()
    for m in (1, 2, 5, 16):
        assert torch.equal(native.int8_dot_rows(x[:m], q, s.view(-1), isa == "avx512"), full[:m])


def test_int8_model_decode_uses_the_native_kernels(small_dir) -> None:
    """An int8 model's decode-sized projections go through int8_rows (not the widening path), batch-invariantly."""
    from gpt2_engine import GPT2

    model = GPT2.from_pretrained(small_dir, quantize="int8")
    x = torch.randn(DECODE_ROWS, 1, 768, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = lm_head(x, model.weights.head)
        proj = linear(x, model.weights.blocks[0].c_fc)
        for rows in (1, 3, 16):
            assert torch.equal(lm_head(x[:rows], model.weights.head), full[:rows])
            assert torch.equal(linear(x[:rows], model.weights.blocks[0].c_fc), proj[:rows])
