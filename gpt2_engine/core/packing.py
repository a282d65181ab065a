"""A loaded model's float matrices with packed exponents (core/packed.py's format): where that pays, measured at
load, and the pass that packs them.

The packed layout reads fewer bytes (0.875x in float32, 0.75x in bfloat16) but decodes every weight in registers;
it pays where the CPU decodes faster than it reads the plain matrix. That depends on the cores and the memory, so
GPT2.from_pretrained measures it once per process and model shape (packed_reads_faster: the one-row kernels over the
model's own projections and head, up to twice the size of the last-level cache, in this CPU's plain layout and
packed, alternated) unless told which layout to take (`weight_layout`, the `--weight-layout` flag). Either layout
gives the same logits, to the bit.
"""

from __future__ import annotations

import functools
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import GPT2Config
from .errors import GPT2EngineError
from .kernels import cpu, decode_kernels
from .packed import (
    PROJECTION_BAND,
    SIDE_HEAD,
    PackedMatrix,
    block_bytes,
    check_shape,
    exponent_table,
    pack_reference,
    packed_bytes,
)
from .pages import FilePages, HugeArena, huge_pages_available, huge_region, release_heap
from .weights import Allocator, GPT2Weights, expected_shapes

LAYOUTS = ("auto", "plain", "packed")  # weight_layout's values: measured, as loaded (panels where chosen), packed
# Packed is chosen where it reads the test matrices at least this much faster than the plain layout: where the two are
# about even the plain layout stays, which needs no decoding and no packing at load.
MARGIN = 1.03
LLC = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
TEST_BYTES = (64 << 20, 256 << 20)  # the plain test matrices: twice the last-level cache, within these bounds
ROUNDS = 5


class LayoutError(GPT2EngineError):
    """A weight layout that does not exist, or cannot be used here."""


@dataclass(frozen=True)
class Packing:
    """What packing a model made: how many matrices, their bytes packed and as plain matrices, their escapes."""

    matrices: int
    packed_bytes: int
    plain_bytes: int
    escapes: int

    def summary(self) -> str:
        return (f"packed exponents: {self.matrices} matrices in {self.packed_bytes / 1e6:.1f} MB, "
                f"{self.packed_bytes / self.plain_bytes:.3f}x their {self.plain_bytes / 1e6:.1f} MB, "
                f"{self.escapes:,} escaped weights")


def packable(dtype: torch.dtype) -> str | None:
    """Why the packed layout cannot be used here for `dtype` weights, or None where it can."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it packs float32 and bfloat16 weights, not {dtype}"
    if not cpu().packed_decode:
        return "this CPU has no packed decoder (AVX2, or AVX-512 with VBMI)"
    if decode_kernels() is None:
        return "the native kernels are not built"
    return None


def check_layout(weight_layout: str) -> None:
    """That `weight_layout` names a layout (a LayoutError otherwise)."""
    if weight_layout not in LAYOUTS:
        raise LayoutError(f"weight_layout: expected one of {', '.join(LAYOUTS)}, got {weight_layout!r}")


def use_packed(weight_layout: str, dtype: torch.dtype, weights_packable: bool, config: GPT2Config) -> bool:
    """Whether to pack: "packed" where it can be (else a LayoutError saying why), "plain" never, "auto" where
    packable and measured faster (packed_reads_faster). weights_packable: the load allows it (float32 read in place
    from a safetensors file, or bfloat16; not quantized)."""
    check_layout(weight_layout)
    if weight_layout == "plain":
        return False
    why = packable(dtype) or (None if weights_packable else
                              "it packs float32 weights read in place from a safetensors file, or bfloat16 ones; "
                              "not quantized or converted checkpoints")
    if weight_layout == "packed" and why:
        raise LayoutError(f"weight_layout 'packed': {why}")
    return why is None and (weight_layout == "packed" or packed_reads_faster(dtype, config))


def pack(w: torch.Tensor, band: int, alloc: Allocator | None = None, plain: torch.Tensor | None = None,
         exponents: torch.Tensor | None = None) -> PackedMatrix:
    """A contiguous float32 or bfloat16 (R, C) matrix packed by the native kernels (kernels/packed.cpp's
    pack_exponents, the bytes of packed.pack_reference), its units written where alloc(shape, dtype) says (None: a
    new tensor); `plain` kept beside them. Without the native kernels, pack_reference. exponents: the table (None:
    the matrix's 15 most frequent)."""
    R, C = w.shape
    native = decode_kernels()
    if native is None:
        packed = pack_reference(w, band, exponents)
        return replace(packed, plain=plain)
    check_shape(R, C, band)
    table = exponent_table(native.exponent_counts(w)) if exponents is None else exponents.to(torch.int32)
    shape = (R * C // 128, block_bytes(w.dtype))
    units = torch.empty(shape, dtype=torch.uint8) if alloc is None else alloc(shape, torch.uint8)
    side = native.pack_exponents(w, band, table, units)
    return PackedMatrix(units, side, w.dtype, R, C, band, plain)


def test_bytes() -> int:
    """The plain test matrices' size: twice the last-level cache (sysfs; 32 MB where unknown), within TEST_BYTES. Where
    more than that stays fast (a virtual machine's host cache: this project's Zen 5 EPYC reads 64-128 MB at 80-100
    GB/s and 256 MB at 15-20), the test is less bound by memory than a model's step, which favours the plain layout:
    packed reads fewer bytes but decodes them."""
    try:
        text = LLC.read_text().strip()
        size = int(text[:-1]) << (10 if text.endswith("K") else 20 if text.endswith("M") else 0)
    except (OSError, ValueError):
        size = 32 << 20
    return min(max(2 * size, TEST_BYTES[0]), TEST_BYTES[1])


def step_shapes(config: GPT2Config, dtype: torch.dtype) -> tuple[list[tuple[int, int]], int]:
    """What measure() reads: a decode step's own mix, the projections of `config`'s blocks and the head's rows in the
    step's own proportions, the whole step or, where it is larger than test_bytes(), cut to about that (at least one
    block). Returns (the blocks' projections in order, the head's row count: 0 where it cannot be packed); only
    matrices that the loader would pack. A step's mix, not one tall matrix: a single stream per thread does not read as a step's 49
    matrices of a few MB do, and on an AMX Xeon it chose the layout that decodes slower (docs/benchmarks.md)."""
    item, C, V = dtype.itemsize, config.n_embd, config.vocab_size
    block = [s for name, s in expected_shapes(config).items()
             if name.startswith("h.0.") and len(s) == 2 and PackedMatrix.fits(s)]
    per_block = sum(k * n for k, n in block) * item
    head = V * C * item if PackedMatrix.fits((V, C), head=True) else 0
    if not head and not block:
        return [], 0
    scale = min(1.0, test_bytes() / (head + config.n_layer * per_block))
    blocks = min(config.n_layer, max(1, round(config.n_layer * scale))) if block else 0
    return block * blocks, int(V * scale) if head else 0


def measure(dtype: torch.dtype, config: GPT2Config, rounds: int = ROUNDS) -> tuple[list[float], list[float]]:
    """Seconds per pass of one row through step_shapes(config) (each projection, then the head), in this CPU's plain
    layout (panels where kernels.CPU.panels) and packed, alternated for `rounds` rounds: (plain times, packed times);
    empty where no matrix of `config` can be packed. The matrices are zeros (a zero's exponent is its table's only
    one), each layout's in one mapping on huge pages: the kernels' work and bytes do not depend on the values,
    and zeros need no packing."""
    native = decode_kernels()
    shapes, head_rows = step_shapes(config, dtype)
    if not shapes and not head_rows:
        return [], []
    C, unit = config.n_embd, block_bytes(dtype)
    bits = 28 if dtype == torch.float32 else 12
    avx512 = cpu().avx512
    head = [(head_rows, C)] if head_rows else []
    plain = zeros(sum(r * c for r, c in shapes + head) * dtype.itemsize).view(dtype)
    units = zeros(sum(r * c for r, c in shapes + head) // 128 * unit).view(-1, unit)
    plain_calls, packed_calls = [], []
    at = ut = 0
    for K, N in shapes:
        w = plain[at : at + K * N].view(K, N)
        weight = w.view(K // PROJECTION_BAND, N // 64, PROJECTION_BAND, 64) if cpu().panels else w  # zeros either way
        u = units[ut : ut + K * N // 128]
        at, ut = at + K * N, ut + K * N // 128
        side = zero_side(K // PROJECTION_BAND * (N // 64))
        x, b = torch.randn(1, K), torch.zeros(N)
        plain_calls.append(functools.partial(native.conv1d_rows, x, weight, b, avx512))
        packed_calls.append(functools.partial(native.conv1d_packed, x, u, side, b, bits, avx512))
    if head_rows:
        x = torch.randn(1, C)
        plain_calls.append(functools.partial(native.dot_rows, x, plain[at:].view(head_rows, C), avx512))
        packed_calls.append(functools.partial(native.dot_packed, x, units[ut:], zero_side(head_rows), head_rows, bits,
                                              avx512))

    def timed(calls: list[Callable[[], torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        for call in calls:
            call()
        return time.perf_counter() - t0

    timed(plain_calls), timed(packed_calls)  # warm: the code, the thread pool
    times = [(timed(plain_calls), timed(packed_calls)) for _ in range(rounds)]
    return [t for t, _ in times], [t for _, t in times]


def zeros(nbytes: int) -> torch.Tensor:
    """nbytes of zeros on huge pages, each page written once (a page only read would map the shared zero page)."""
    raw = huge_region(nbytes)
    raw[:: mmap.PAGESIZE].zero_()
    return raw


def zero_side(tiles: int) -> torch.Tensor:
    """The side list of a matrix of zeros in `tiles` tiles: code 0 is exponent 0, no escapes."""
    side = torch.zeros(SIDE_HEAD + tiles + 1, dtype=torch.int32)
    side[SIDE_HEAD - 1] = tiles
    return side


@functools.cache
def packed_reads_faster(dtype: torch.dtype, config: GPT2Config) -> bool:
    """Whether this CPU runs `config`'s packed matrices at least MARGIN faster than the plain ones, each layout's best
    round of measure() against the other's (other work on the cores only ever slows a round); measured once per
    process, dtype and config (about 0.2 s for GPT-2 small)."""
    plain, packed = measure(dtype, config)
    return bool(plain) and min(plain) >= MARGIN * min(packed)


def arena_bytes(config: GPT2Config, dtype: torch.dtype) -> int:
    """Room for the packed units of every projection and the head of `config` that fit: what pack_weights writes."""
    shapes = [s for name, s in expected_shapes(config).items()
              if name.startswith("h.") and len(s) == 2 and PackedMatrix.fits(s)]
    head = (config.vocab_size, config.n_embd)
    return packed_bytes(shapes + ([head] if PackedMatrix.fits(head, head=True) else []), dtype)


def pack_weights(w: GPT2Weights, config: GPT2Config, mapping: FilePages | None = None) -> tuple[GPT2Weights, Packing]:
    """`w` with its float32 or bfloat16 projections (those that fit) and its head packed, the units on huge pages where
    the system has them (one mapping, pages.HugeArena), and what that made.

    mapping: the checkpoint file's mapping, where float32 matrices are read in place. Each then stays there beside
    its units as `plain` for GEMMs (as weights.PanelMatrix.plain), its pages released once packed; wte's pages go to
    the embedding, which reads its rows from the file (GPT2Weights.wte_pages, as a quantized model's). A matrix not in
    the file (bfloat16, converted at load) is emptied once packed (Tensor.set_): `w` is not to be used after, and the
    load's peak grows by one matrix, not by all of them. wte stays: the embedding reads it, and GEMMs."""
    dtype = w.wte.dtype
    arena = HugeArena(arena_bytes(config, dtype)) if huge_pages_available() else None
    alloc = None if arena is None else arena.take
    count = packed_total = plain_total = escapes = 0

    def packed(m: torch.Tensor, band: int, keep: bool) -> PackedMatrix:
        nonlocal count, packed_total, plain_total, escapes
        pages = None if mapping is None else mapping.within(m)
        p = pack(m, band, alloc, plain=m if pages is not None or keep else None)
        count, packed_total, escapes = count + 1, packed_total + p.nbytes, escapes + p.escapes
        plain_total += m.numel() * m.element_size()
        if pages is not None:
            pages.release(m)
        elif not keep:
            m.set_()  # the converted matrix: its memory goes now
            release_heap()
        return p

    blocks = []
    for blk in w.blocks:
        parts = {}
        for name in ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj"):
            lin = getattr(blk, name)
            m = lin.weight
            if isinstance(m, torch.Tensor) and m.dtype == dtype and m.is_contiguous() and PackedMatrix.fits(m.shape):
                parts[name] = replace(lin, weight=packed(m, PROJECTION_BAND, keep=False))
        blocks.append(replace(blk, **parts))
    head, wte_pages = w.head, w.wte_pages
    if head is w.wte and w.wte.is_contiguous() and PackedMatrix.fits(w.wte.shape, head=True):
        head = packed(w.wte, 1, keep=True)
        if mapping is not None and (pages := mapping.within(w.wte)) is not None:
            wte_pages = pages
    return (replace(w, blocks=tuple(blocks), head=head, wte_pages=wte_pages),
            Packing(count, packed_total, plain_total, escapes))
