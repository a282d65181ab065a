"""Float32 and bfloat16 weights with packed exponents: the same values in 28 and 12 bits a weight.

Why: at batch 1 a decode step reads every weight once, so float32 and bfloat16 decoding are bound by the bytes the
weights take (docs/benchmarks.md). A weight's 8-bit exponent carries little information: over GPT-2 small's matrices
its entropy is about 2.7 bits, and a matrix's 15 most frequent exponents cover about 99.99% of its weights. So each
weight keeps its sign and mantissa and a 4-bit code for its exponent: codes 0..14 name an exponent of the matrix's
table, code 15 says the weight's value is in the matrix's side list (an escape). The kernels (kernels/packed.cpp)
decode a row of 64 weights in registers back to the exact float32 bits and feed decode.cpp's chains, so a packed
matrix gives the plain matrix's results to the bit, reading 0.875x (float32) or 0.75x (bfloat16) of its bytes.

The format. The matrix (R, C) is cut into tiles of `band` rows by `width` columns, in row-major order of tiles; a
tile's rows come in order, and each row's `width` columns as units of 64 weights. A projection (K, N) has band 32 and
width 64, the order of weights.PanelMatrix's panels (a pass of the kernel reads one tile, a band of a panel); a head
wte (V, C) has band 1 and width C, row by row. Two consecutive units make a block, so that every wide load starts on
a 64-byte line:

    [sm a: 64][sm b: 64][codes a: 32][codes b: 32]                          bfloat16: 192 bytes
    [sm a: 64][sm b: 64][codes a: 32][codes b: 32][lo a: 128][lo b: 128]    float32: 448 bytes

sm byte j: column j's sign << 7 | the top 7 bits of its mantissa (float32 bits 22..16).
codes byte j: column j's exponent code | column j + 32's << 4.
lo: columns' float32 bits 15..0, as little-endian 16-bit words (float32 only; a bfloat16 weight has none).
A weight's float32 bits are then sign << 31 | table[code] << 23 | sm & 0x7F << 16 | lo.

The side list (int32): [0:16] the table, exponent e << 23 for each code (0 for code 15 and for codes left unused);
[16] the number of tiles S; [17 : 18 + S] the index of each tile's first escape (S + 1 entries, the last the escape
count E); then E pairs (at, float32 bits of the weight), in tile order, with at = unit within the tile * 64 + column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

UNIT = 64  # weights of one row per unit
CODES = 16  # 4-bit codes: 15 exponents and the escape
ESCAPE = CODES - 1
TABLE = CODES  # side[:TABLE]: the exponents' bits
SIDE_HEAD = TABLE + 1  # the table and the tile count
PROJECTION_BAND = 32  # rows of a projection's tile: weights.PanelMatrix.ROWS, decode.cpp's PANEL_ROWS
PROJECTION_PIECES = 8  # decode.cpp's KPIECES: each piece of K must be whole bands, as in panels

def block_bytes(dtype: torch.dtype) -> int:
    """Bytes of a block of two units."""
    return 2 * (UNIT + UNIT // 2 + (2 * UNIT if dtype == torch.float32 else 0))


@dataclass(frozen=True)
class PackedMatrix:
    """A float32 or bfloat16 matrix (R, C) with packed exponents (the module docstring gives the format): a
    projection (K, N) in panels' order (band 32, width 64), or the head wte (V, C) row by row (band 1, width C).

    `plain`: the same matrix as a (R, C) tensor of `dtype`, where it costs no memory of the process's own or is kept
    anyway (float32: the memory-mapped checkpoint's, its pages released until read; bfloat16: wte, which the
    embedding reads): what GEMMs (prefill, scoring) read. None where there is none (a bfloat16 projection: GEMMs
    decode the units, kernels/packed.cpp's unpack_packed)."""

    BAND: ClassVar[int] = PROJECTION_BAND

    units: torch.Tensor  # uint8 [blocks, block_bytes(dtype)]
    side: torch.Tensor  # int32 [SIDE_HEAD + tiles + 1 + 2 * escapes]
    dtype: torch.dtype  # float32 or bfloat16: what the units decode to
    rows: int  # R: K of a projection, V of a head
    cols: int  # C: N of a projection, C of a head
    band: int  # rows of a tile: BAND (a projection) or 1 (a head, whose tiles are whole rows)
    plain: torch.Tensor | None = None

    @classmethod
    def fits(cls, shape: torch.Size | tuple[int, ...], head: bool = False) -> bool:
        """Whether a (R, C) matrix can be packed: as a projection (K whole bands in each of the kernel's pieces, N
        whole 64-column tiles, as weights.PanelMatrix.fits), or as a head (C whole blocks of 128 columns)."""
        R, C = shape
        if head:
            return R > 0 and C > 0 and C % (2 * UNIT) == 0
        return R > 0 and R % (PROJECTION_PIECES * cls.BAND) == 0 and C > 0 and C % UNIT == 0

    @property
    def width(self) -> int:
        """Columns of a tile: 64 for a projection, the whole row for a head."""
        return UNIT if self.band > 1 else self.cols

    @property
    def bits(self) -> int:
        """Bits a weight takes: 28 (float32) or 12 (bfloat16); what the kernels are told (kernels/block.cpp)."""
        return 28 if self.dtype == torch.float32 else 12

    @property
    def in_features(self) -> int:  # K, as a projection
        return self.rows

    @property
    def out_features(self) -> int:  # N, as a projection
        return self.cols

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        """Bytes the packed form takes (units and side list)."""
        return self.units.numel() + self.side.numel() * 4

    @property
    def escapes(self) -> int:
        tiles = int(self.side[TABLE])
        return int(self.side[SIDE_HEAD + tiles])

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (R, C) matrix in a tensor of its own, in `dtype` (None: the packed one's), by unpack_reference
        (projection.py decodes natively where the kernels are built: kernels/packed.cpp's unpack_packed)."""
        out = unpack_reference(self)
        return out if dtype is None or out.dtype == dtype else out.to(dtype)

    def matrix(self) -> torch.Tensor:
        """The (R, C) matrix in the packed dtype: `plain` where kept (no copy), else dense()."""
        return self.plain if self.plain is not None else self.dense()


def check_shape(R: int, C: int, band: int) -> None:
    """That a (R, C) matrix is whole tiles of `band` rows (1: a head, whose rows are whole blocks)."""
    ok = C % (2 * UNIT) == 0 if band == 1 else band % 2 == 0 and R % band == 0 and C % UNIT == 0
    if not ok or R <= 0 or C <= 0:
        raise ValueError(f"pack: a ({R}, {C}) matrix is not whole tiles of {band} rows by "
                         f"{'128-column blocks' if band == 1 else '64 columns'}")


def exponent_table(counts: torch.Tensor) -> torch.Tensor:
    """The 15 exponents coded by 0..14, from a count of each exponent [256]: the most frequent first, ties to the
    smaller exponent (a stable sort), those that never occur left out (their codes stay unused)."""
    order = torch.sort(-counts.long(), stable=True).indices[:ESCAPE]
    return order[counts[order] > 0].to(torch.int32)


def float_bits(w: torch.Tensor) -> torch.Tensor:
    """The float32 bits of a float32 or bfloat16 tensor's values, as int32 (bfloat16 is a float32's top half)."""
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16).to(torch.int32) << 16
    if w.dtype == torch.float32:
        return w.view(torch.int32)
    raise ValueError(f"packed weights are float32 or bfloat16, got {w.dtype}")


def exponent_counts_reference(w: torch.Tensor) -> torch.Tensor:
    """How many of the weights have each exponent [256] (int64)."""
    return torch.bincount(((float_bits(w) >> 23) & 0xFF).reshape(-1), minlength=256)


def pack_reference(w: torch.Tensor, band: int, exponents: torch.Tensor | None = None) -> PackedMatrix:
    """A contiguous float32 or bfloat16 (R, C) matrix packed in torch (the format's reference; packing.pack is the
    native packer, held to this one). band: PROJECTION_BAND or 1 (a head). exponents: the table (at most 15; None:
    exponent_table of the matrix's own counts), which tests shorten to force escapes."""
    R, C = w.shape
    check_shape(R, C, band)
    width = UNIT if band > 1 else C
    table = exponent_table(exponent_counts_reference(w)) if exponents is None else exponents.to(torch.int32)
    if table.numel() > ESCAPE:
        raise ValueError(f"pack: at most {ESCAPE} exponents, got {table.numel()}")
    bits = float_bits(w).reshape(R // band, band, C // width, width // UNIT, UNIT).permute(0, 2, 1, 3, 4)
    bits = bits.reshape(-1, UNIT)  # [units, 64] in the format's order
    code_of = torch.full((256,), ESCAPE, dtype=torch.int32)
    code_of[table.long()] = torch.arange(table.numel(), dtype=torch.int32)
    codes = code_of[((bits >> 23) & 0xFF).long()]  # [units, 64]
    sm = (((bits >> 24) & 0x80) | ((bits >> 16) & 0x7F)).to(torch.uint8)  # [units, 64]
    nibbles = (codes[:, : UNIT // 2] | (codes[:, UNIT // 2 :] << 4)).to(torch.uint8)  # [units, 32]
    parts = [sm.view(-1, 2 * UNIT), nibbles.view(-1, UNIT)]  # per block: both units' sm, then both units' codes
    if w.dtype == torch.float32:
        low = ((bits << 16) >> 16).to(torch.int16)  # bits 15..0, sign-extended so that the conversion is exact
        parts.append(low.view(torch.uint8).view(-1, 4 * UNIT))  # little-endian words
    units = torch.cat(parts, dim=1).contiguous()  # [blocks, block_bytes]
    per_tile = band * width // UNIT  # units of a tile
    tiles = bits.shape[0] // per_tile
    unit, col = (codes == ESCAPE).nonzero(as_tuple=True)  # in unit order, so in tile order
    tile = unit // per_tile
    starts = torch.zeros(tiles + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.bincount(tile, minlength=tiles), 0)
    pairs = torch.stack([((unit % per_tile) * UNIT + col).to(torch.int32), bits[unit, col]], dim=1)  # [E, 2]
    head = torch.zeros(SIDE_HEAD, dtype=torch.int32)
    head[: table.numel()] = table << 23
    head[TABLE] = tiles
    side = torch.cat([head, starts, pairs.reshape(-1)])
    return PackedMatrix(units, side, w.dtype, R, C, band)


def unpack_reference(p: PackedMatrix) -> torch.Tensor:
    """The (R, C) matrix a PackedMatrix holds, decoded in torch from the format alone (the kernels' reference)."""
    R, C, band, width = p.rows, p.cols, p.band, p.width
    per_tile = band * width // UNIT
    blocks = p.units.view(-1, block_bytes(p.dtype))
    sm = blocks[:, : 2 * UNIT].reshape(-1, UNIT).to(torch.int32)  # [units, 64]
    nibbles = blocks[:, 2 * UNIT : 3 * UNIT].reshape(-1, UNIT // 2).to(torch.int32)  # [units, 32]
    codes = torch.cat([nibbles & 0xF, nibbles >> 4], dim=1)  # [units, 64]
    table = p.side[:TABLE]
    bits = ((sm & 0x80) << 24) | table[codes.long()] | ((sm & 0x7F) << 16)
    if p.dtype == torch.float32:
        lo = blocks[:, 3 * UNIT :].reshape(-1, 2 * UNIT).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        bits = bits | lo
    tiles = int(p.side[TABLE])
    starts = p.side[SIDE_HEAD : SIDE_HEAD + tiles + 1]
    pairs = p.side[SIDE_HEAD + tiles + 1 :].view(-1, 2)
    tile = torch.repeat_interleave(torch.arange(tiles), (starts[1:] - starts[:-1]).long())  # each escape's tile
    bits[tile * per_tile + pairs[:, 0] // UNIT, pairs[:, 0] % UNIT] = pairs[:, 1]
    matrix = bits.view(R // band, C // width, band, width // UNIT, UNIT).permute(0, 2, 1, 3, 4).reshape(R, C)
    if p.dtype == torch.bfloat16:
        return (matrix >> 16).to(torch.int16).view(torch.bfloat16)
    return matrix.contiguous().view(torch.float32)


def packed_bytes(shapes: list[tuple[int, int]], dtype: torch.dtype) -> int:
    """Room for the units of matrices of these shapes, each on its own 64-byte line: what an arena for them needs."""
    return sum(-(-math.prod(s) // (2 * UNIT) * block_bytes(dtype) // 64) * 64 for s in shapes)
