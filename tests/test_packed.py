"""Packed exponents (core/packed.py, kernels/packed.cpp, core/packing.py): the format against its torch reference, the
native packer against that, the kernels against the plain layouts' kernels bit for bit (every instruction set this
CPU has, 1 and 2 threads, a row alone and among others, tiles with escapes everywhere, every matrix of both
fixtures), and a packed model's logits and tokens against the plain model's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, cli
from safetensors import safe_open

from gpt2_engine import GPT2
from gpt2_engine.core.config import DECODE_ROWS, GPT2Config
from gpt2_engine.core.errors import GPT2EngineError
from gpt2_engine.core.kernels import cpu, decode_kernels
from gpt2_engine.core.packed import (
    PROJECTION_BAND,
    SIDE_HEAD,
    TABLE,
    PackedMatrix,
    exponent_counts_reference,
    exponent_table,
    pack_reference,
    unpack_reference,
)
from gpt2_engine.core import packing
from gpt2_engine.core.packing import LayoutError, measure, pack, packed_reads_faster, step_shapes
from gpt2_engine.core.pages import file_pages, huge_pages_available
from gpt2_engine.core.projection import packed_dense
from gpt2_engine.formats.hf import find_weights_file

# the packed decoders' instruction sets this CPU runs: AVX-512 with VBMI, and AVX2 everywhere (an AVX2-only CPU skips
# the AVX-512 cases, which then did not run)
ISAS = [isa for isa, have in (("avx2", cpu().avx2), ("avx512", cpu().avx512 and cpu().avx512_vbmi)) if have]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def native():
    module = decode_kernels()
    assert module is not None, "the native kernels did not build (see the warning above)"
    return module


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits, to compare values exactly (-0.0 and 0.0 apart, NaNs by payload)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def weights(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """GPT-2-like weights: normal with std 0.05 (their exponents spread over about 20 values)."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def with_escapes(shape: tuple[int, int], dtype: torch.dtype, band: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weights() with another exponent (values near 1e-30) at the edges of every tile (a projection's: the first and
    last column of its first and last row; a head's row: the first and last column of its first and last unit) and
    at both sides of the middle of a unit (where AVX2 decodes a unit's halves), and the table of weights() without
    them: packed with that table, each tile has those six escapes at least."""
    w = weights(shape, dtype, seed)
    table = exponent_table(exponent_counts_reference(w))
    R, C = shape
    width = 64 if band > 1 else C
    tiny = torch.tensor(1.25e-30).to(dtype)
    for r0 in range(0, R, band):
        for c0 in range(0, C, width):
            edges = ((0, 0), (0, width - 1), (band - 1, 0), (band - 1, width - 1), (band // 2, 31), (band // 2, 32)) \
                if band > 1 else ((0, 0), (0, 63), (0, 64), (0, width - 1), (0, 31), (0, 32))
            for r, c in edges:
                w[r0 + r, c0 + c] = -tiny if (r + c) % 2 else tiny
    return w, table


def tile_escapes(p: PackedMatrix) -> torch.Tensor:
    """How many escapes each tile has."""
    tiles = int(p.side[TABLE])
    starts = p.side[SIDE_HEAD : SIDE_HEAD + tiles + 1]
    return starts[1:] - starts[:-1]


# ---- the format ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("band,shape", [(PROJECTION_BAND, (256, 192)), (1, (7, 384))], ids=["projection", "head"])
def test_the_reference_holds_every_value_exactly(dtype: torch.dtype, band: int, shape: tuple[int, int]) -> None:
    """Any float32 or bfloat16 bits come back from pack_reference and unpack_reference unchanged: zeros of both
    signs, subnormals, the largest and smallest normals, infinities, and 254 exponents at once (most of them then
    escaped, each to its tile's side list)."""
    R, C = shape
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1.1754944e-38, 3.4028235e38, -3.4028235e38, float("inf"),
                            float("-inf"), 1.0, -2.5, 0.1])
    powers = torch.tensor([2.0 ** k for k in range(-126, 128)]) * torch.where(torch.arange(254) % 3 == 0, -1.5, 1.0)
    values = torch.cat([special, powers, torch.randn(R * C) * 0.05])[: R * C]
    w = values[torch.randperm(R * C, generator=torch.Generator().manual_seed(1))].view(R, C).to(dtype)
    p = pack_reference(w, band)
    assert p.units.shape == (R * C // 128, 448 if dtype == torch.float32 else 192)
    assert torch.equal(bits_of(unpack_reference(p)), bits_of(w))
    exponents = (bits_of(w).to(torch.int32) << (16 if dtype == torch.bfloat16 else 0) >> 23) & 0xFF
    table = exponent_table(exponent_counts_reference(w))
    assert p.escapes == int((~torch.isin(exponents, table)).sum()) > 200


def test_the_table_is_the_most_frequent_exponents_ties_to_the_smaller() -> None:
    counts = torch.zeros(256, dtype=torch.long)
    counts[[120, 121, 122, 7, 200]] = torch.tensor([5, 9, 5, 1, 0])
    assert exponent_table(counts).tolist() == [121, 120, 122, 7]  # 200 never occurs: its code stays unused
    counts[:] = 1
    assert exponent_table(counts).tolist() == list(range(15))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("band,shape", [(PROJECTION_BAND, (768, 2304)), (PROJECTION_BAND, (3072, 768)),
                                        (1, (1001, 768)), (1, (50, 128))], ids=str)
@pytest.mark.parametrize("table", ["own", "two exponents"])
def test_the_native_packer_writes_the_reference_bytes(native, dtype: torch.dtype, band: int, shape: tuple[int, int],
                                                      table: str) -> None:
    """packed.pack (kernels/packed.cpp) writes pack_reference's units and side list, with the matrix's own table and
    with one of two exponents (most weights escaped); unpack_packed gives the matrix back, in its dtype or widened."""
    w = weights(shape, dtype, shape[0] + band)
    exponents = None if table == "own" else exponent_table(exponent_counts_reference(w))[:2]
    ref, got = pack_reference(w, band, exponents), pack(w, band, exponents=exponents)
    assert torch.equal(ref.units, got.units) and torch.equal(ref.side, got.side)
    assert torch.equal(native.exponent_counts(w), exponent_counts_reference(w))
    R, C = shape
    assert torch.equal(bits_of(native.unpack_packed(got.units, got.side, R, C, band, got.bits, False)), bits_of(w))
    assert torch.equal(native.unpack_packed(got.units, got.side, R, C, band, got.bits, True), w.float())
    assert torch.equal(bits_of(got.dense()), bits_of(w))  # the torch reference's
    assert torch.equal(bits_of(packed_dense(got)), bits_of(w))
    assert torch.equal(packed_dense(got, torch.float32), w.float())


# ---- the kernels against the plain layouts' ----------------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("K,N", [(768, 2304), (3072, 768), (256, 64)])
@pytest.mark.parametrize("escapes", ["own table", "in every tile", "at every tile's edges"])
def test_a_packed_projection_gives_the_plain_bits(native, threads: int, isa: str, dtype: torch.dtype, K: int, N: int,
                                                  escapes: str) -> None:
    """conv1d_packed is conv1d_rows on the plain matrix, to the bit, for 1 to DECODE_ROWS rows, a row alone or
    among the others; with the matrix's own table, with a table of one exponent (escapes in every tile, many a
    row), and with escapes at every tile's corners (the lanes at both ends of a unit, the first and last unit)."""
    w, table = with_escapes((K, N), dtype, PROJECTION_BAND, K) if escapes == "at every tile's edges" \
        else (weights((K, N), dtype, K), None)
    if escapes == "in every tile":
        table = exponent_table(exponent_counts_reference(w))[:1]
    p = pack(w, PROJECTION_BAND, exponents=table)
    if escapes != "own table":
        assert bool((tile_escapes(p) >= 6).all())
    g = torch.Generator().manual_seed(N)
    x, b = torch.randn(DECODE_ROWS, K, generator=g), torch.randn(N, generator=g)
    avx512 = isa == "avx512"
    full = native.conv1d_packed(x, p.units, p.side, b, p.bits, avx512)  # [16, N]
    assert torch.equal(full, native.conv1d_rows(x, w, b, avx512))
    for m in range(1, DECODE_ROWS + 1):
        assert torch.equal(native.conv1d_packed(x[:m], p.units, p.side, b, p.bits, avx512), full[:m]), m
        assert torch.equal(native.conv1d_packed(x[m - 1 : m], p.units, p.side, b, p.bits, avx512)[0], full[m - 1]), m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("V,C", [(1001, 768), (53, 128)])
@pytest.mark.parametrize("escapes", ["own table", "in every row", "at every row's edges"])
def test_a_packed_head_gives_the_plain_bits(native, threads: int, isa: str, dtype: torch.dtype, V: int, C: int,
                                            escapes: str) -> None:
    """dot_packed is dot_rows on the plain wte, to the bit (the same lanes, the same reduction of them), for 1 to
    DECODE_ROWS rows, alone or among others, including vocabulary rows past the last whole block."""
    w, table = with_escapes((V, C), dtype, 1, V) if escapes == "at every row's edges" \
        else (weights((V, C), dtype, V), None)
    if escapes == "in every row":
        table = exponent_table(exponent_counts_reference(w))[:1]
    p = pack(w, 1, exponents=table)
    if escapes != "own table":
        assert bool((tile_escapes(p) >= 6).all())
    x = torch.randn(DECODE_ROWS, C, generator=torch.Generator().manual_seed(C))
    avx512 = isa == "avx512"
    full = native.dot_packed(x, p.units, p.side, V, p.bits, avx512)  # [16, V]
    assert torch.equal(full, native.dot_rows(x, w, avx512))
    for m in range(1, DECODE_ROWS + 1):
        assert torch.equal(native.dot_packed(x[:m], p.units, p.side, V, p.bits, avx512), full[:m]), m
        assert torch.equal(native.dot_packed(x[m - 1 : m], p.units, p.side, V, p.bits, avx512)[0], full[m - 1]), m


def fixture_matrices(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")) or name.endswith("wte.weight"):
                yield name, f.get_tensor(name)


@pytest.mark.parametrize("which", ["small", pytest.param("trained", marks=pytest.mark.trained)])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_every_matrix_of_the_fixtures_gives_the_plain_bits(native, request, threads: int, which: str,
                                                           dtype: torch.dtype) -> None:
    """Every projection and the head of the full-size and the trained fixture, packed, give the plain kernels' bits at
    one, two and five rows, on every instruction set, at 1 and 2 threads."""
    directory = request.getfixturevalue(f"{which}_dir")
    g = torch.Generator().manual_seed(0)
    for name, t in fixture_matrices(directory):
        w = t.to(dtype).contiguous()
        head = name.endswith("wte.weight")
        p = pack(w, 1 if head else PROJECTION_BAND)
        assert torch.equal(bits_of(packed_dense(p)), bits_of(w)), name
        for isa in ISAS:
            for m in (1, 2, 5):
                if head:
                    x = torch.randn(m, w.shape[1], generator=g)
                    got, want = native.dot_packed(x, p.units, p.side, p.rows, p.bits, isa == "avx512"), \
                        native.dot_rows(x, w, isa == "avx512")
                else:
                    x, b = torch.randn(m, w.shape[0], generator=g), torch.randn(w.shape[1], generator=g)
                    got, want = native.conv1d_packed(x, p.units, p.side, b, p.bits, isa == "avx512"), \
                        native.conv1d_rows(x, w, b, isa == "avx512")
                assert torch.equal(got, want), (name, isa, m)


def test_kernels_reject_what_they_do_not_handle(native) -> None:
    w = weights((256, 64), torch.bfloat16, 0)
    p = pack(w, PROJECTION_BAND)
    x, b = torch.zeros(1, 256), torch.zeros(64)
    with pytest.raises(RuntimeError, match="bits must be 28 .float32. or 12 .bfloat16."):
        native.conv1d_packed(x, p.units, p.side, b, 16, False)
    with pytest.raises(RuntimeError, match="units must be contiguous uint8 of 128 blocks of 448 bytes"):
        native.conv1d_packed(x, p.units, p.side, b, 28, False)  # bfloat16 units told float32
    with pytest.raises(RuntimeError, match="the side list must be int32 with a table, 8 tiles"):
        native.conv1d_packed(torch.zeros(1, 256), p.units, p.side[:10], b, 12, False)
    with pytest.raises(RuntimeError, match="K must be whole bands of 32 rows in each of 8 pieces"):
        native.conv1d_packed(torch.zeros(1, 128), p.units, p.side, b, 12, False)
    with pytest.raises(RuntimeError, match=r"dot_packed: a \(256, 192\) matrix is not whole tiles of 1 rows"):
        native.dot_packed(torch.zeros(1, 192), p.units, p.side, 256, 12, False)  # a head's rows: whole 128 columns
    with pytest.raises(ValueError, match=r"pack: a \(7, 100\) matrix is not whole tiles of 1 rows by 128-column "
                                         "blocks"):
        pack(weights((7, 100), torch.float32, 0), 1)


# ---- a packed model ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", [pytest.param("trained", marks=pytest.mark.trained),
                                   pytest.param("small", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packed_model_gives_the_plain_models_logits_and_tokens(request, threads: int, which: str, dtype: str) -> None:
    """GPT2.from_pretrained(weight_layout="packed") against "plain" on the same checkpoint: the same logits bits for a
    prompt through the GEMMs (40 tokens) and through the decode kernels (5 tokens), the same greedy tokens and
    logprobs alone and in a batch of three, every projection and the head packed, at 0.875x / 0.75x the bytes."""
    directory = request.getfixturevalue(f"{which}_dir")
    plain = GPT2.from_pretrained(directory, dtype=dtype, weight_layout="plain")
    packed = GPT2.from_pretrained(directory, dtype=dtype, weight_layout="packed")
    assert plain.packing is None and packed.packing is not None
    w = packed.weights
    assert isinstance(w.head, PackedMatrix) and all(isinstance(getattr(b, n).weight, PackedMatrix) for b in w.blocks
                                                    for n in ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj"))
    ratio = packed.packing.packed_bytes / packed.packing.plain_bytes
    assert packed.packing.matrices == 4 * plain.config.n_layer + 1
    # the units' 28 / 12 bits, and the side list: a head's tiles are its rows (a tile start each: 4 bytes a row of C)
    assert (0.875 < ratio < 0.88) if dtype == "float32" else (0.75 < ratio < 0.76), ratio
    g = torch.Generator().manual_seed(3)
    for T in (40, 5):
        ids = torch.randint(0, plain.config.vocab_size, (2, T), generator=g)
        assert torch.equal(plain(ids), packed(ids)), T
    prompts = [[464, 2068, 7586], [15496, 11], [40, 716, 257, 3290, 290]]
    for model_prompts in ([prompts[0]], prompts):
        a = plain.complete(model_prompts, max_new_tokens=12, temperature=0, ignore_eos=True)
        b = packed.complete(model_prompts, max_new_tokens=12, temperature=0, ignore_eos=True)
        assert [(c.token_ids, c.logprobs) for c in a] == [(c.token_ids, c.logprobs) for c in b]


PROJECTIONS = ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packed_model_holds_the_plain_models_weights(trained_dir: Path, dtype: str) -> None:
    """Every parameter of a packed model, decoded, is the plain model's to the bit."""
    assert_same_weights(GPT2.from_pretrained(trained_dir, dtype=dtype, weight_layout="packed").weights,
                        GPT2.from_pretrained(trained_dir, dtype=dtype, weight_layout="plain").weights)


def test_packed_units_lie_in_one_mapping_and_float32_stays_in_the_file(small_dir: Path) -> None:
    """pack_weights writes every matrix's units into one mapping (on huge pages where the system has them). Float32's
    plain matrices stay in the checkpoint's mapping beside the units, for GEMMs, and the embedding reads wte's rows
    from the file (wte_pages); bfloat16 projections keep no plain matrix (GEMMs decode the units), its head keeps wte,
    which the embedding reads."""
    path = find_weights_file(small_dir)
    for dtype in ("float32", "bfloat16"):
        w = GPT2.from_pretrained(small_dir, dtype=dtype, weight_layout="packed").weights
        matrices = [getattr(b, n).weight for b in w.blocks for n in PROJECTIONS]
        assert isinstance(w.head, PackedMatrix) and w.head.plain is w.wte
        if huge_pages_available():
            assert len({m.units.untyped_storage().data_ptr() for m in [*matrices, w.head]}) == 1
        if dtype == "float32":
            assert all(file_pages(m.plain, path) is not None for m in matrices) and file_pages(w.wte, path) is not None
            assert w.wte_pages is not None
        else:
            assert all(m.plain is None for m in matrices) and w.wte_pages is None


def test_a_lora_adapter_trains_on_a_packed_base_as_on_the_plain_one(trained_dir: Path) -> None:
    """finetune(lora=...) on a packed float32 base (its frozen head read as the wte kept beside the units) gives the
    plain base's losses and, after training, its logits to the bit."""
    texts = ["The quick brown fox jumps over the lazy dog. " * 20]
    results = {}
    for layout in ("plain", "packed"):
        model = GPT2.from_pretrained(trained_dir, weight_layout=layout)
        history = model.finetune(texts, lora=4, steps=2, context=32, batch_size=1, lr=1e-2).history
        losses = [(r["event"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in history]  # no timings
        results[layout] = losses, model(torch.tensor([[464, 2068, 7586, 21831]]))
    assert results["plain"][0] == results["packed"][0] and any(loss for _, loss, _, _ in results["plain"][0])
    assert torch.equal(results["plain"][1], results["packed"][1])


def test_weight_layouts_that_cannot_be_used_are_errors(trained_dir: Path) -> None:
    with pytest.raises(LayoutError, match="weight_layout: expected one of auto, plain, packed, got 'panels'"):
        GPT2.from_pretrained(trained_dir, weight_layout="panels")
    with pytest.raises(LayoutError, match="weight_layout 'packed' is read by the native CPU runner's kernels; the "
                                          "torch runner .device='cpu'. keeps plain matrices"):
        GPT2.from_pretrained(trained_dir, runner="torch", weight_layout="packed")
    with pytest.raises(LayoutError, match="weight_layout 'packed': it packs float32 weights read in place from a "
                                          "safetensors file, or bfloat16 ones; not quantized or converted"):
        GPT2.from_pretrained(trained_dir, quantize="int8", weight_layout="packed")
    assert issubclass(LayoutError, GPT2EngineError)
    code, err = cli("generate", "hi", "-n", "1", "--weights", str(trained_dir), "--quantize", "int4",
                    "--weight-layout", "packed")
    assert code == 2 and "weight_layout 'packed': it packs float32 weights" in err


def test_generate_reports_the_packed_size(trained_dir: Path) -> None:
    """gpt2 generate --weight-layout packed says on its stats line how large the packed weights are."""
    code, err = cli("generate", "hi", "-n", "2", "--weights", str(trained_dir), "--weight-layout", "packed")
    model = GPT2.from_pretrained(trained_dir, weight_layout="packed")
    assert code == 0 and f"s ({model.packing.packed_bytes / 1e6:.0f} MB packed) | prompt" in err, err


def test_the_layout_measurement_times_both_layouts() -> None:
    """measure() runs both layouts' kernels over a decode step's own matrices (its speed is not asserted: timings
    belong to the benchmarks)."""
    plain, packed = measure(torch.bfloat16, GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=1000), rounds=2)
    assert len(plain) == len(packed) == 2 and all(t > 0 for t in plain + packed)


def test_the_layout_measurement_reads_the_models_own_projections_and_head() -> None:
    """GPT-2 small's projections in their order and the head's rows, in the step's own proportions, cut to about
    packing.test_bytes(); a small model's whole step; only what the loader packs."""
    C, V = 768, 50257
    block = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]
    for dtype in (torch.float32, torch.bfloat16):
        scale = min(1.0, packing.test_bytes() / ((V * C + 12 * 12 * C * C) * dtype.itemsize))
        shapes, head_rows = step_shapes(GPT2Config(), dtype)
        assert shapes == block * max(1, round(12 * scale)) and head_rows == int(V * scale)
        head_share = head_rows * C / (head_rows * C + sum(k * n for k, n in shapes))
        assert abs(head_share - V / (V + 12 * 12 * C)) < 0.05  # the head's share of a step's bytes: 0.30
    small = GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=1000)
    assert step_shapes(small, torch.float32) == ([(256, 768), (256, 256), (256, 1024), (1024, 256)] * 2, 1000)
    # n_embd 64: only the MLP's (256, 64) projection has whole bands of 32 rows in each of the 8 pieces, and a head
    # row of 64 is not whole blocks of 128 columns
    assert step_shapes(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=1000), torch.float32) == (
        [(256, 64)] * 2, 0)


def test_a_model_with_nothing_to_pack_measures_nothing_and_stays_plain() -> None:
    """n_embd 96: no projection has whole bands in each piece and no head row whole blocks, so nothing is timed and
    "auto" keeps the plain layout."""
    config = GPT2Config(n_embd=96, n_layer=1, n_head=2, vocab_size=100)
    assert step_shapes(config, torch.float32) == ([], 0)
    assert measure(torch.float32, config, rounds=1) == ([], [])
    assert packed_reads_faster(torch.float32, config) is False
