// Float32 and bfloat16 weights with packed exponents (core/packed.py writes them; its docstring is the format): the
// matmuls of decode.cpp on weights that take 28 and 12 bits a weight, decoded in registers back to their exact
// float32 bits and fed to the same chains of fused multiply-adds in the same order, so the results are decode.cpp's
// bits on the plain matrix, from 0.875x (float32) or 0.75x (bfloat16) of its bytes.
//
//   conv1d_packed:  y[M, N] = x[M, K] @ W[K, N] + b[N]   (a projection: decode.cpp's conv1d_rows)
//   dot_packed:     y[M, V] = x[M, C] @ W[V, C]^T        (the tied head: decode.cpp's dot_rows)
//   unpack_packed:  W as a dense float32 or bfloat16 tensor (for GEMMs: prefill, scoring)
//   exponent_counts, pack_exponents: the packer (core/packed.py's pack; pack_reference is its reference)
//
// Why the decoding is shaped as it is. A unit is one row's 64 weights: 64 bytes of sign and top mantissa bits (sm),
// 32 bytes of 4-bit exponent codes, and for float32 128 bytes of the mantissas' low 16 bits. On AVX-512 (with VBMI)
// 16 weights are three instructions: one byte permutation puts each weight's sm byte (and its low bytes) into its
// 32-bit lane, one 16-entry dword lookup (vpermd) turns the codes into exponent bits, one ternary logic op keeps the
// sign and mantissa bits and adds the exponent. AVX2 has no 16-entry dword lookup: two byte lookups (pshufb) give
// the exponent's top 7 bits and its lowest, which join the sm bytes as the bfloat16's high and low bytes, and byte
// and word unpacks widen them. Escaped weights (code 15) are patched into their lane from the side list, tile by
// tile, and only in tiles that have any. Which columns a lane holds is the plain kernels' (AVX-512: 16 columns in
// order, AVX2: 8), so the head's lane-wise chains and final reductions are theirs too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <vector>

// decode.cpp: the projections' pieces of K, added in order (the same for every weight format)
using PieceColumns = std::function<void(const float* x, float* y, int64_t M, int64_t ka, int64_t kz, int64_t c0,
                                        int64_t c1)>;
using PieceTail = std::function<void(const float* x, float* y, int64_t M, int64_t ka, int64_t kz)>;
void by_pieces_into(const float* x, int64_t M, int64_t K, int64_t N, const float* b, const PieceColumns& columns,
                    const PieceTail& tail, float* y);

namespace {

constexpr int64_t UNIT = 64;        // weights of one row in a unit
constexpr int64_t BAND = 32;        // rows of a projection's tile: decode.cpp's PANEL_ROWS
constexpr int32_t ESCAPE = 15;      // the code of an escaped weight
constexpr int64_t SIDE_HEAD = 17;   // the side list's table (16) and tile count
constexpr int MR = 4;               // rows of x sharing each decoded weight row (decode.cpp's MR)
constexpr int64_t VB = 8;           // vocabulary rows per parallel work item of the head
constexpr int64_t HEAD_AHEAD = 8;   // the head's second prefetch, blocks of vocabulary rows ahead (decode.cpp's)
// At one row (from the first group of rows) the AVX-512 projections ask for the lines this far ahead of the tile's
// stream into L2: with the decoding between its loads, the hardware prefetchers alone left the stream short of the
// memory's rate (bfloat16 projections at one row 1.2x faster with it, 2 to 32 KB ahead tried; docs/benchmarks.md).
// AVX2's measured the same with and without.
constexpr int64_t TILE_AHEAD = 12288;

template <bool F32>
constexpr int64_t BLOCK = F32 ? 448 : 192;  // bytes of a block of two units

// A packed matrix as the kernels read it: the units, and the side list's table, tile starts and escapes.
struct Packed {
  const uint8_t* units;
  const int32_t* table;    // [16]: code -> exponent << 23
  int64_t tiles;
  const int32_t* start;    // [tiles + 1]: each tile's first escape
  const int32_t* escapes;  // [E][2]: (unit in the tile * 64 + column, float32 bits)
};

// Rows in groups of MR, then the 1 to 3 left over (decode.cpp's for_rows).
template <typename Body>
void for_rows(int64_t M, Body body) {
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) body(std::integral_constant<int, MR>{}, m0);
  switch (M - m0) {
    case 3: body(std::integral_constant<int, 3>{}, m0); break;
    case 2: body(std::integral_constant<int, 2>{}, m0); break;
    case 1: body(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

// The escapes of one tile, in unit order, as a cursor: `next` is the unit of the next one (-1: none left).
struct Escapes {
  const int32_t* at = nullptr;  // pairs (unit * 64 + column, bits), in that order
  int64_t left = 0;
  int32_t next = -1;
  Escapes() = default;
  Escapes(const Packed& w, int64_t tile)
      : at(w.escapes + 2 * w.start[tile]), left(w.start[tile + 1] - w.start[tile]), next(left ? at[0] >> 6 : -1) {}
  bool any() const { return left > 0; }
  // calls patch(column, bits) for each escape of `unit` below column `limit` (units asked for in order, and a
  // unit's columns in order: all below 32, then the rest)
  template <typename Patch>
  void apply(int32_t unit, Patch patch, int32_t limit = UNIT) {
    while (next == unit && (at[0] & 63) < limit) {
      patch(at[0] & 63, at[1]);
      at += 2;
      next = --left ? at[0] >> 6 : -1;
    }
  }
};

// ---- AVX-512 (F, BW, VBMI): a unit as 4 zmm of 16 columns in order ---------------------------------------------

#define T512 "avx512f,avx512bw,avx512vbmi,fma"

struct Dec512 {
  __m512i table;     // vpermd's 16 entries: code -> exponent << 23
  __m512i keep;      // the bits of the permuted bytes that are the weight's: sign, mantissa (and its low 16 bits)
  __m512i place[4];  // byte permutations: lane i of group g <- sm[16 g + i] as bytes 2 and 3 (and its low bytes as 0, 1)
};

template <bool F32>
__attribute__((target(T512))) Dec512 dec512(const int32_t* table) {
  Dec512 d;
  d.table = _mm512_loadu_si512(table);
  d.keep = _mm512_set1_epi32(F32 ? static_cast<int>(0x807FFFFFu) : static_cast<int>(0x807F0000u));
  for (int g = 0; g < 4; ++g) {
    alignas(64) uint8_t idx[64];
    for (int i = 0; i < 16; ++i) {
      const int low = 64 + 2 * (16 * (g % 2) + i);  // in the second source: the low halves of 32 columns
      idx[4 * i + 0] = static_cast<uint8_t>(F32 ? low : 0);
      idx[4 * i + 1] = static_cast<uint8_t>(F32 ? low + 1 : 0);
      idx[4 * i + 2] = idx[4 * i + 3] = static_cast<uint8_t>(16 * g + i);
    }
    d.place[g] = _mm512_load_si512(idx);
  }
  return d;
}

// Unit j (0 or 1) of the block at b: columns 16 g .. 16 g + 15 in w[g], as float32 lanes.
template <bool F32>
__attribute__((target(T512))) inline void decode512(const uint8_t* b, int j, const Dec512& d, __m512 w[4]) {
  const __m512i sm = _mm512_loadu_si512(b + 64 * j);
  const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128 + 32 * j)));
  const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 144 + 32 * j)));
  // vpermd reads the low 4 bits of each lane: columns 0..15 and 16..31 are the low nibbles, 32..63 the high ones
  const __m512i codes[4] = {c0, c1, _mm512_srli_epi32(c0, 4), _mm512_srli_epi32(c1, 4)};
  for (int g = 0; g < 4; ++g) {
    __m512i p;
    if constexpr (F32)
      p = _mm512_permutex2var_epi8(sm, d.place[g], _mm512_loadu_si512(b + 192 + 128 * j + 64 * (g / 2)));
    else
      p = _mm512_permutexvar_epi8(d.place[g], sm);
    const __m512i e = _mm512_permutexvar_epi32(codes[g], d.table);
    w[g] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(p, d.keep, e, 0xEA));  // (p & keep) | e
  }
}

// An escaped weight into its lane (a switch, so that w stays in registers).
__attribute__((target(T512))) inline void patch512(__m512 w[4], int32_t col, int32_t bits) {
  const __mmask16 lane = static_cast<__mmask16>(1u << (col & 15));
  const __m512 v = _mm512_castsi512_ps(_mm512_set1_epi32(bits));
  switch (col >> 4) {
    case 0: w[0] = _mm512_mask_mov_ps(w[0], lane, v); break;
    case 1: w[1] = _mm512_mask_mov_ps(w[1], lane, v); break;
    case 2: w[2] = _mm512_mask_mov_ps(w[2], lane, v); break;
    default: w[3] = _mm512_mask_mov_ps(w[3], lane, v); break;
  }
}

// ---- AVX2: half a unit (32 columns) as 4 ymm of 8 columns in order ----------------------------------------------

struct Dec256 {
  __m256i high;  // pshufb table: code -> exponent >> 1 (a bfloat16's high byte, less its sign)
  __m256i low;   // pshufb table: code -> (exponent & 1) << 7 (its low byte, less the mantissa)
};

__attribute__((target("avx2"))) Dec256 dec256(const int32_t* table) {
  alignas(32) uint8_t high[32], low[32];
  for (int c = 0; c < 16; ++c) {
    const uint32_t e = static_cast<uint32_t>(table[c]) >> 23;
    high[c] = high[c + 16] = static_cast<uint8_t>(e >> 1);
    low[c] = low[c + 16] = static_cast<uint8_t>((e & 1) << 7);
  }
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(high)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(low))};
}

// The bfloat16 words (float32 bits 31..16) of columns 32 q .. 32 q + 31 of unit j of the block at b: w0 holds
// columns [0-3, 8-11 | 4-7, 12-15], w1 [16-19, 24-27 | 20-23, 28-31]. The sm bytes and codes are first moved as
// dwords to [0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31], so that the byte unpacks (which work within
// 128-bit lanes) give those words, and decode256's word unpacks float32 lanes of 8 columns in order.
__attribute__((target("avx2"))) inline void words256(const uint8_t* b, int j, int q, const Dec256& d, __m256i& w0,
                                                     __m256i& w1) {
  const __m256i spread = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), nibble = _mm256_set1_epi8(0x0F);
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * j)), spread);
  const __m256i codes = _mm256_and_si256(q ? _mm256_srli_epi16(packed, 4) : packed, nibble);
  const __m256i sm = _mm256_permutevar8x32_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * j + 32 * q)), spread);
  const __m256i high = _mm256_or_si256(_mm256_and_si256(sm, _mm256_set1_epi8(static_cast<char>(0x80))),
                                       _mm256_shuffle_epi8(d.high, codes));
  const __m256i low = _mm256_or_si256(_mm256_and_si256(sm, _mm256_set1_epi8(0x7F)), _mm256_shuffle_epi8(d.low, codes));
  w0 = _mm256_unpacklo_epi8(low, high);
  w1 = _mm256_unpackhi_epi8(low, high);
}

// Columns 32 q .. 32 q + 31 of unit j of the block at b as float32, 8 at a time in w[0..3]: words256's words, with
// float32's low halves (their qwords moved to the words' order) or zeros.
template <bool F32>
__attribute__((target("avx2,fma"))) inline void decode256(const uint8_t* b, int j, int q, const Dec256& d,
                                                          __m256 w[4]) {
  __m256i b0, b1;
  words256(b, j, q, d, b0, b1);
  __m256i l0 = _mm256_setzero_si256(), l1 = l0;
  if constexpr (F32) {
    const uint8_t* lo = b + 192 + 128 * j + 64 * q;
    l0 = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)), 0xD8);
    l1 = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 32)), 0xD8);
  }
  w[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(l0, b0));
  w[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(l0, b0));
  w[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(l1, b1));
  w[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(l1, b1));
}

// An escaped weight (column col of the 32 in w) into its lane.
__attribute__((target("avx2"))) inline void patch256(__m256 w[4], int32_t col, int32_t bits) {
  const __m256 lane = _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(col & 7)));
  const __m256 v = _mm256_castsi256_ps(_mm256_set1_epi32(bits));
  switch ((col >> 3) & 3) {
    case 0: w[0] = _mm256_blendv_ps(w[0], v, lane); break;
    case 1: w[1] = _mm256_blendv_ps(w[1], v, lane); break;
    case 2: w[2] = _mm256_blendv_ps(w[2], v, lane); break;
    default: w[3] = _mm256_blendv_ps(w[3], v, lane); break;
  }
}

// ---- projections: one tile (a band of 32 rows by 64 columns) into the accumulators -----------------------------
// Each element's chain is decode.cpp's: a fused multiply-add per weight row in k order within the piece.

template <int R, bool F32, bool ESC>
__attribute__((target(T512))) void tile512(const float* x, const uint8_t* tile, const Dec512& d, Escapes esc,
                                           float* y, int64_t K, int64_t N, int64_t m0, int64_t n, int64_t k0,
                                           bool fresh) {
  __m512 a[R][4];  // fresh: a piece's first pass, from zero
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) a[r][g] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(y + (m0 + r) * N + n + 16 * g);
  for (int i = 0; i < BAND; i += 2) {
    const uint8_t* b = tile + i / 2 * BLOCK<F32>;
    if (m0 == 0)  // past the end of the units a prefetch is harmless
      for (int o = 0; o < BLOCK<F32>; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b + TILE_AHEAD + o), _MM_HINT_T1);
    for (int j = 0; j < 2; ++j) {
      __m512 w[4];
      decode512<F32>(b, j, d, w);
      if constexpr (ESC) esc.apply(i + j, [&](int32_t col, int32_t bits) { patch512(w, col, bits); });
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[(m0 + r) * K + k0 + i + j]);
        for (int g = 0; g < 4; ++g) a[r][g] = _mm512_fmadd_ps(xv, w[g], a[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(y + (m0 + r) * N + n + 16 * g, a[r][g]);
}

// AVX2 has 16 registers: at one row the whole tile (8 ymm), from two rows half of it (32 columns from 32 q).
template <int R, bool F32, bool ESC, bool WHOLE>
__attribute__((target("avx2,fma"))) void tile256(const float* x, const uint8_t* tile, const Dec256& d, Escapes esc,
                                                 float* y, int64_t K, int64_t N, int64_t m0, int64_t n, int64_t k0,
                                                 int q, bool fresh) {
  constexpr int G = WHOLE ? 8 : 4;  // ymm a row
  const int64_t c = n + (WHOLE ? 0 : 32 * q);
  __m256 a[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) a[r][g] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (m0 + r) * N + c + 8 * g);
  for (int i = 0; i < BAND; i += 2) {
    const uint8_t* b = tile + i / 2 * BLOCK<F32>;
    for (int j = 0; j < 2; ++j) {
      __m256 w[G];
      decode256<F32>(b, j, WHOLE ? 0 : q, d, w);
      if constexpr (WHOLE) decode256<F32>(b, j, 1, d, w + 4);
      if constexpr (ESC)
        esc.apply(i + j, [&](int32_t col, int32_t bits) {
          if (WHOLE || col >> 5 == q) patch256(w + (WHOLE ? (col >> 5) * 4 : 0), col, bits);
        });
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[(m0 + r) * K + k0 + i + j]);
        for (int g = 0; g < G; ++g) a[r][g] = _mm256_fmadd_ps(xv, w[g], a[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(y + (m0 + r) * N + c + 8 * g, a[r][g]);
}

// One piece's partial sums y = x[:, ka:kz] @ W[ka:kz, c0:c1] (whole tiles), pass by pass: a band's tile for the rows.
template <bool F32>
__attribute__((target(T512))) void columns512(const float* x, const Packed& w, float* y, int64_t M, int64_t K,
                                              int64_t N, int64_t ka, int64_t kz, int64_t c0, int64_t c1) {
  const Dec512 d = dec512<F32>(w.table);
  for (int64_t k0 = ka; k0 < kz; k0 += BAND) {
    const bool fresh = k0 == ka;
    for (int64_t n = c0; n < c1; n += 64) {
      const int64_t t = k0 / BAND * (N / 64) + n / 64;
      const uint8_t* tile = w.units + t * (BAND / 2) * BLOCK<F32>;
      const Escapes esc(w, t);
      for_rows(M, [&](auto R, int64_t m0) {
        constexpr int r = decltype(R)::value;
        esc.any() ? tile512<r, F32, true>(x, tile, d, esc, y, K, N, m0, n, k0, fresh)
                  : tile512<r, F32, false>(x, tile, d, esc, y, K, N, m0, n, k0, fresh);
      });
    }
  }
}

template <bool F32>
__attribute__((target("avx2,fma"))) void columns256(const float* x, const Packed& w, float* y, int64_t M, int64_t K,
                                                    int64_t N, int64_t ka, int64_t kz, int64_t c0, int64_t c1) {
  const Dec256 d = dec256(w.table);
  for (int64_t k0 = ka; k0 < kz; k0 += BAND) {
    const bool fresh = k0 == ka;
    for (int64_t n = c0; n < c1; n += 64) {
      const int64_t t = k0 / BAND * (N / 64) + n / 64;
      const uint8_t* tile = w.units + t * (BAND / 2) * BLOCK<F32>;
      const Escapes esc(w, t);
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2)
        for (int q = 0; q < 2; ++q)
          esc.any() ? tile256<2, F32, true, false>(x, tile, d, esc, y, K, N, m0, n, k0, q, fresh)
                    : tile256<2, F32, false, false>(x, tile, d, esc, y, K, N, m0, n, k0, q, fresh);
      if (m0 < M)
        esc.any() ? tile256<1, F32, true, true>(x, tile, d, esc, y, K, N, m0, n, k0, 0, fresh)
                  : tile256<1, F32, false, true>(x, tile, d, esc, y, K, N, m0, n, k0, 0, fresh);
    }
  }
}

// ---- the head: y[m, v] = dot(x[m], W[v]), a block of NV vocabulary rows for R input rows ------------------------
// Each (m, v) is decode.cpp's chain: lane l of one accumulator takes columns l, l + 16, ... (AVX-512; AVX2: l + 8)
// in order, then the lanes are reduced as decode.cpp reduces them.

// The next block's rows where this one reads, into L1 (every other row, as decode.cpp's prefetch_next), and every
// row HEAD_AHEAD blocks on into L2: the plain head's prefetches, at the packed rows' offsets.
template <int NV>
inline void head_prefetch(const uint8_t* row0, int64_t row_bytes, int64_t off, int64_t bytes) {
  for (int64_t o = off; o < off + bytes; o += 64) {
    for (int i = 0; i < NV; i += 2) _mm_prefetch(reinterpret_cast<const char*>(row0 + (NV + i) * row_bytes + o), _MM_HINT_T0);
    for (int i = 0; i < NV; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(row0 + (NV * HEAD_AHEAD + i) * row_bytes + o), _MM_HINT_T1);
  }
}

template <int R, int NV, bool F32, bool ESC>
__attribute__((target(T512))) void head512(const float* x, const Packed& w, const Dec512& d, float* y, int64_t C,
                                           int64_t ldy, int64_t y0, int64_t m0, int64_t v0) {
  const int64_t row_bytes = C / (2 * UNIT) * BLOCK<F32>;
  const uint8_t* row0 = w.units + v0 * row_bytes;
  __m512 acc[NV][R];
  for (int i = 0; i < NV; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  Escapes esc[NV];
  if constexpr (ESC)
    for (int i = 0; i < NV; ++i) esc[i] = Escapes(w, v0 + i);
  for (int64_t u = 0; u < C / UNIT; u += 2) {
    const int64_t off = u / 2 * BLOCK<F32>;
    if (m0 == 0) head_prefetch<NV>(row0, row_bytes, off, BLOCK<F32>);
    for (int j = 0; j < 2; ++j) {
      const int64_t c = (u + j) * UNIT;
      for (int i = 0; i < NV; ++i) {
        __m512 wv[4];
        decode512<F32>(row0 + i * row_bytes + off, j, d, wv);
        if constexpr (ESC) esc[i].apply(static_cast<int32_t>(u + j), [&](int32_t col, int32_t bits) { patch512(wv, col, bits); });
        for (int g = 0; g < 4; ++g)
          for (int r = 0; r < R; ++r)
            acc[i][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (m0 + r) * C + c + 16 * g), wv[g], acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NV; ++i)
    for (int r = 0; r < R; ++r) y[(m0 + r) * ldy + v0 - y0 + i] = _mm512_reduce_add_ps(acc[i][r]);
}

template <int R, int NV, bool F32, bool ESC>
__attribute__((target("avx2,fma"))) void head256(const float* x, const Packed& w, const Dec256& d, float* y,
                                                 int64_t C, int64_t ldy, int64_t y0, int64_t m0, int64_t v0) {
  const int64_t row_bytes = C / (2 * UNIT) * BLOCK<F32>;
  const uint8_t* row0 = w.units + v0 * row_bytes;
  __m256 acc[NV][R];
  for (int i = 0; i < NV; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  Escapes esc[NV];
  if constexpr (ESC)
    for (int i = 0; i < NV; ++i) esc[i] = Escapes(w, v0 + i);
  for (int64_t u = 0; u < C / UNIT; u += 2) {
    const int64_t off = u / 2 * BLOCK<F32>;
    if (m0 == 0) head_prefetch<NV>(row0, row_bytes, off, BLOCK<F32>);
    for (int j = 0; j < 2; ++j)
      for (int q = 0; q < 2; ++q) {
        const int64_t c = (u + j) * UNIT + 32 * q;
        for (int i = 0; i < NV; ++i) {
          __m256 wv[4];
          decode256<F32>(row0 + i * row_bytes + off, j, q, d, wv);
          if constexpr (ESC)  // this half's escapes: the unit's below column 32, then the rest
            esc[i].apply(static_cast<int32_t>(u + j), [&](int32_t col, int32_t bits) { patch256(wv, col, bits); },
                         32 * (q + 1));
          for (int g = 0; g < 4; ++g)
            for (int r = 0; r < R; ++r)
              acc[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (m0 + r) * C + c + 8 * g), wv[g], acc[i][r]);
        }
      }
  }
  for (int i = 0; i < NV; ++i)
    for (int r = 0; r < R; ++r) {  // decode.cpp's pairwise reduction of the 8 lanes
      __m128 lo = _mm256_castps256_ps128(acc[i][r]), hi = _mm256_extractf128_ps(acc[i][r], 1);
      __m128 s4 = _mm_add_ps(lo, hi);
      __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      y[(m0 + r) * ldy + v0 - y0 + i] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
}

// Vocabulary rows [v0, v1) for input rows [0, M) into y (row stride ldy, its column 0 at row y0), on the calling
// thread: blocks of HEAD_ROWS vocabulary rows, then single rows, for each group of input rows; the decoder's
// constants made here once (in an AVX-512 function: passed from code built without it, they were not aligned as its
// loads assume). The block width never changes a bit. Packed rows are read fastest one or two at a time, where the
// plain head reads 8: a packed row is consumed 3 (bfloat16) or 7 (float32) cache lines a step, and blocks of 4 or 8
// rows ran the whole head 2x-10x slower from memory on AVX-512 and AVX2 alike (not from L2), with or without
// software prefetches; float32 one row at a time, bfloat16 two, at one to four input rows (docs/benchmarks.md).
template <bool F32>
constexpr int HEAD_ROWS = F32 ? 1 : 2;

template <bool F32>
__attribute__((target(T512))) void head_range512(const float* x, const Packed& w, float* y, int64_t M, int64_t C,
                                                 int64_t ldy, int64_t y0, int64_t v0, int64_t v1) {
  const Dec512 d = dec512<F32>(w.table);
  for (int64_t b = v0; b < v1; b += VB) {
    const int64_t end = std::min<int64_t>(v1, b + VB);
    for_rows(M, [&](auto R, int64_t m0) {
      constexpr int r = decltype(R)::value;
      int64_t v = b;
      const auto one = [&](auto NV) {
        constexpr int n = decltype(NV)::value;
        bool esc = false;
        for (int i = 0; i < n; ++i) esc |= w.start[v + i + 1] > w.start[v + i];
        esc ? head512<r, n, F32, true>(x, w, d, y, C, ldy, y0, m0, v) : head512<r, n, F32, false>(x, w, d, y, C, ldy, y0, m0, v);
      };
      for (; v + HEAD_ROWS<F32> <= end; v += HEAD_ROWS<F32>) one(std::integral_constant<int, HEAD_ROWS<F32>>{});
      for (; v < end; ++v) one(std::integral_constant<int, 1>{});
    });
  }
}

template <bool F32>
__attribute__((target("avx2,fma"))) void head_range256(const float* x, const Packed& w, float* y, int64_t M,
                                                       int64_t C, int64_t ldy, int64_t y0, int64_t v0, int64_t v1) {
  const Dec256 d = dec256(w.table);
  for (int64_t b = v0; b < v1; b += VB) {
    const int64_t end = std::min<int64_t>(v1, b + VB);
    for_rows(M, [&](auto R, int64_t m0) {
      constexpr int r = decltype(R)::value;
      int64_t v = b;
      const auto one = [&](auto NV) {
        constexpr int n = decltype(NV)::value;
        bool esc = false;
        for (int i = 0; i < n; ++i) esc |= w.start[v + i + 1] > w.start[v + i];
        esc ? head256<r, n, F32, true>(x, w, d, y, C, ldy, y0, m0, v) : head256<r, n, F32, false>(x, w, d, y, C, ldy, y0, m0, v);
      };
      for (; v + HEAD_ROWS<F32> <= end; v += HEAD_ROWS<F32>) one(std::integral_constant<int, HEAD_ROWS<F32>>{});
      for (; v < end; ++v) one(std::integral_constant<int, 1>{});
    });
  }
}

void head_range(const float* x, const Packed& w, bool f32, float* y, int64_t M, int64_t C, int64_t ldy, int64_t y0,
                int64_t v0, int64_t v1, bool avx512) {
  if (avx512)
    f32 ? head_range512<true>(x, w, y, M, C, ldy, y0, v0, v1) : head_range512<false>(x, w, y, M, C, ldy, y0, v0, v1);
  else
    f32 ? head_range256<true>(x, w, y, M, C, ldy, y0, v0, v1) : head_range256<false>(x, w, y, M, C, ldy, y0, v0, v1);
}

// Unit j of the block at b as 64 float32 (wide) or bfloat16 values in order at `to`, its escapes (of `unit`) written
// over their places: AVX2's decoder, which every machine here has; a bfloat16 matrix's words need no widening.
template <bool F32>
__attribute__((target("avx2,fma"))) void decode_to(const uint8_t* b, int j, const Dec256& d, Escapes& esc, int32_t unit,
                                                   bool wide, void* to) {
  for (int q = 0; q < 2; ++q) {
    if (wide) {
      __m256 v[4];
      decode256<F32>(b, j, q, d, v);
      for (int g = 0; g < 4; ++g) _mm256_storeu_ps(static_cast<float*>(to) + 32 * q + 8 * g, v[g]);
    } else {  // words256's order back to columns in order: qwords [0, 2, 1, 3]
      __m256i w0, w1;
      words256(b, j, q, d, w0, w1);
      __m256i* out = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(to) + 32 * q);
      _mm256_storeu_si256(out, _mm256_permute4x64_epi64(w0, 0xD8));
      _mm256_storeu_si256(out + 1, _mm256_permute4x64_epi64(w1, 0xD8));
    }
  }
  esc.apply(unit, [&](int32_t col, int32_t bits) {
    if (wide)
      std::memcpy(static_cast<float*>(to) + col, &bits, 4);
    else
      static_cast<uint16_t*>(to)[col] = static_cast<uint16_t>(static_cast<uint32_t>(bits) >> 16);
  });
}

// ---- checks and views ----------------------------------------------------------------------------------------

bool has_vbmi() {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
  return vbmi;
}

// units [blocks, bytes] and side of a (R, C) matrix with tiles of `band` rows (1: a head, a tile a row), as Packed.
Packed view(const torch::Tensor& units, const torch::Tensor& side, int64_t R, int64_t C, int64_t band, int64_t bits,
            bool avx512, const char* who) {
  TORCH_CHECK(bits == 28 || bits == 12, who, ": bits must be 28 (float32) or 12 (bfloat16)");
  const bool f32 = bits == 28;
  const int64_t width = band == 1 ? C : UNIT;
  TORCH_CHECK(R > 0 && C > 0 && band > 0 && R % band == 0 && C % width == 0 && (band * width / UNIT) % 2 == 0 &&
                  C % UNIT == 0, who, ": a (", R, ", ", C, ") matrix is not whole tiles of ", band, " rows");
  const int64_t tiles = R / band * (C / width);
  TORCH_CHECK(units.scalar_type() == at::kByte && units.is_contiguous() &&
                  units.numel() == R * C / (2 * UNIT) * (f32 ? BLOCK<true> : BLOCK<false>),
              who, ": units must be contiguous uint8 of ", R * C / (2 * UNIT), " blocks of ",
              f32 ? BLOCK<true> : BLOCK<false>, " bytes");
  TORCH_CHECK(side.scalar_type() == at::kInt && side.is_contiguous() && side.dim() == 1 &&
                  side.numel() >= SIDE_HEAD + tiles + 1 && side.data_ptr<int32_t>()[16] == tiles,
              who, ": the side list must be int32 with a table, ", tiles, " tiles and their escapes");
  const int32_t* s = side.data_ptr<int32_t>();
  TORCH_CHECK(side.numel() == SIDE_HEAD + tiles + 1 + 2 * int64_t(s[SIDE_HEAD + tiles]) && s[SIDE_HEAD] == 0,
              who, ": the side list's escapes do not match its tile starts");
  TORCH_CHECK(!avx512 || has_vbmi(), who, ": the AVX-512 decoder needs AVX-512 VBMI, which this CPU lacks");
  return {units.data_ptr<uint8_t>(), s, tiles, s + SIDE_HEAD, s + SIDE_HEAD + tiles + 1};
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------------------------------

// x [M, K] (rows in a row) @ W [K, N] + b into y [M, N] for a packed projection (tiles of 32 rows by 64 columns,
// panels' order): decode.cpp's conv1d_rows on the plain matrix, to the bit. block.cpp calls this on its own buffers;
// conv1d_packed is the same on tensors.
void conv1d_packed_into(const float* x, int64_t M, int64_t K, const torch::Tensor& units, const torch::Tensor& side,
                        const torch::Tensor& b, int64_t bits, bool avx512, float* y) {
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 1 && b.is_contiguous(),
              "conv1d_packed: expected float32 x [M, K] and b [N]");
  const int64_t N = b.size(0);
  TORCH_CHECK(K % (8 * BAND) == 0, "conv1d_packed: K must be whole bands of ", BAND, " rows in each of 8 pieces");
  const Packed w = view(units, side, K, N, BAND, bits, avx512, "conv1d_packed");
  const bool f32 = bits == 28;
  by_pieces_into(
      x, M, K, N, b.data_ptr<float>(),
      [&](const float* xp, float* yp, int64_t R, int64_t ka, int64_t kz, int64_t c0, int64_t c1) {
        if (avx512)
          f32 ? columns512<true>(xp, w, yp, R, K, N, ka, kz, c0, c1) : columns512<false>(xp, w, yp, R, K, N, ka, kz, c0, c1);
        else
          f32 ? columns256<true>(xp, w, yp, R, K, N, ka, kz, c0, c1) : columns256<false>(xp, w, yp, R, K, N, ka, kz, c0, c1);
      },
      [](const float*, float*, int64_t, int64_t, int64_t) {},  // N is whole tiles
      y);
}

torch::Tensor conv1d_packed(torch::Tensor x, torch::Tensor units, torch::Tensor side, torch::Tensor b, int64_t bits,
                            bool avx512) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && b.scalar_type() == at::kFloat && b.dim() == 1,
              "conv1d_packed: expected float32 x [M, K] and b [N]");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), b.size(0)}, x.options());
  conv1d_packed_into(x.data_ptr<float>(), x.size(0), x.size(1), units, side, b, bits, avx512, y.data_ptr<float>());
  return y;
}

// x [M, C] @ W [V, C]^T for a packed head (a tile a row): decode.cpp's dot_rows on the plain matrix, to the bit.
torch::Tensor dot_packed(torch::Tensor x, torch::Tensor units, torch::Tensor side, int64_t V, int64_t bits,
                         bool avx512) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "dot_packed: expected float32 x [M, C]");
  x = x.contiguous();
  const int64_t M = x.size(0), C = x.size(1);
  const Packed w = view(units, side, V, C, 1, bits, avx512, "dot_packed");
  auto y = torch::empty({M, V}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (V + VB - 1) / VB, 64, [&](int64_t begin, int64_t end) {
    head_range(xp, w, bits == 28, yp, M, C, V, 0, begin * VB, std::min(V, end * VB), avx512);
  });
  return y;
}

// dot_packed for vocabulary rows [v0, v0 + n) only, into y [M, ldy] (its column 0 at row v0), on the calling thread,
// each logit dot_packed's own bits: block.cpp's greedy picks (decode.cpp's dot_rows_slice for the packed head).
void dot_packed_slice(const torch::Tensor& x, const torch::Tensor& units, const torch::Tensor& side, int64_t V,
                      int64_t bits, int64_t v0, int64_t n, float* y, int64_t ldy, bool avx512) {
  const int64_t M = x.size(0), C = x.size(1);
  const Packed w = view(units, side, V, C, 1, bits, avx512, "dot_packed");
  head_range(x.data_ptr<float>(), w, bits == 28, y, M, C, ldy, v0, v0, v0 + n, avx512);
}

// The (R, C) matrix of a packed one, float32 or (bits 12) its bfloat16 values as bfloat16: for the GEMMs of longer
// inputs. Each tile's units are decoded as the kernels decode them, escapes patched, and written in place.
torch::Tensor unpack_packed(torch::Tensor units, torch::Tensor side, int64_t R, int64_t C, int64_t band, int64_t bits,
                            bool as_float32) {
  const Packed w = view(units, side, R, C, band, bits, false, "unpack_packed");
  const bool f32 = bits == 28, wide = f32 || as_float32;
  const int64_t width = band == 1 ? C : UNIT, per_row = width / UNIT, per_tile = band * per_row;
  auto out = torch::empty({R, C}, torch::TensorOptions().dtype(wide ? at::kFloat : at::kBFloat16));
  uint8_t* o = static_cast<uint8_t*>(out.data_ptr());
  const Dec256 d = dec256(w.table);
  at::parallel_for(0, w.tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Escapes esc(w, t);
      const int64_t r0 = t / (C / width) * band, c0 = t % (C / width) * width;
      for (int64_t u = 0; u < per_tile; ++u) {
        const uint8_t* b = w.units + (t * per_tile + u) / 2 * (f32 ? BLOCK<true> : BLOCK<false>);
        uint8_t* to = o + ((r0 + u / per_row) * C + c0 + u % per_row * UNIT) * (wide ? 4 : 2);
        const int j = static_cast<int>(u % 2);
        f32 ? decode_to<true>(b, j, d, esc, static_cast<int32_t>(u), wide, to)
            : decode_to<false>(b, j, d, esc, static_cast<int32_t>(u), wide, to);
      }
    }
  });
  return out;
}

namespace {

// The float32 bits of w's element i (bfloat16: its top half).
inline uint32_t bits_of(const void* w, bool bf16, int64_t i) {
  if (bf16) return static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16;
  uint32_t v;
  std::memcpy(&v, static_cast<const float*>(w) + i, 4);
  return v;
}

}  // namespace

// How many weights of a contiguous float32 or bfloat16 tensor have each exponent: int64 [256].
torch::Tensor exponent_counts(torch::Tensor w) {
  TORCH_CHECK((w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.is_contiguous(),
              "exponent_counts: expected a contiguous float32 or bfloat16 tensor");
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const void* p = w.data_ptr();
  const int64_t n = w.numel(), chunks = std::max<int64_t>(1, std::min<int64_t>(64, n / 65536));
  std::vector<std::array<int64_t, 256>> part(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      std::array<int64_t, 256> h{};
      for (int64_t i = n * c / chunks; i < n * (c + 1) / chunks; ++i) ++h[(bits_of(p, bf16, i) >> 23) & 0xFF];
      part[c] = h;
    }
  });
  auto out = torch::zeros({256}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (const auto& h : part)
    for (int e = 0; e < 256; ++e) o[e] += h[e];
  return out;
}

// Packs the contiguous float32 or bfloat16 (R, C) matrix w with tiles of `band` rows (1: a head) and the exponent
// table `exponents` (int32, at most 15, codes in order) into `units` (uint8 [blocks, block bytes]); returns the side
// list. core/packed.py's pack_reference is the format's reference, and the tests hold this to it.
torch::Tensor pack_exponents(torch::Tensor w, int64_t band, torch::Tensor exponents, torch::Tensor units) {
  TORCH_CHECK((w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.is_contiguous() && w.dim() == 2,
              "pack_exponents: expected a contiguous float32 or bfloat16 matrix");
  TORCH_CHECK(exponents.scalar_type() == at::kInt && exponents.dim() == 1 && exponents.numel() <= ESCAPE,
              "pack_exponents: expected at most 15 int32 exponents");
  const bool bf16 = w.scalar_type() == at::kBFloat16, f32 = !bf16;
  const int64_t R = w.size(0), C = w.size(1), width = band == 1 ? C : UNIT, per_row = width / UNIT;
  const int64_t per_tile = band * per_row, tiles = R / band * (C / width), block = f32 ? BLOCK<true> : BLOCK<false>;
  TORCH_CHECK(R % band == 0 && C % width == 0 && C % UNIT == 0 && per_tile % 2 == 0,
              "pack_exponents: a (", R, ", ", C, ") matrix is not whole tiles of ", band, " rows");
  TORCH_CHECK(units.scalar_type() == at::kByte && units.is_contiguous() && units.numel() == R * C / (2 * UNIT) * block,
              "pack_exponents: units must be contiguous uint8 of ", R * C / (2 * UNIT) * block, " bytes");
  std::array<int32_t, 256> code;
  code.fill(ESCAPE);
  std::array<int32_t, 16> table{};
  for (int64_t c = 0; c < exponents.numel(); ++c) {
    const int32_t e = exponents.data_ptr<int32_t>()[c];
    TORCH_CHECK(0 <= e && e < 256 && code[e] == ESCAPE, "pack_exponents: exponents must be distinct, 0..255");
    code[e] = static_cast<int32_t>(c);
    table[c] = e << 23;
  }
  const void* src = w.data_ptr();
  uint8_t* out = units.data_ptr<uint8_t>();
  std::vector<int32_t> count(tiles + 1, 0);
  // a tile's unit u: row r0 + u / per_row, columns c0 + u % per_row * 64 onwards
  const auto first = [&](int64_t t, int64_t u) {
    return (t / (C / width) * band + u / per_row) * C + t % (C / width) * width + u % per_row * UNIT;
  };
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int32_t n = 0;
      for (int64_t u = 0; u < per_tile; ++u) {
        uint8_t* b = out + (t * per_tile + u) / 2 * block;
        const int j = static_cast<int>(u % 2);
        const int64_t at = first(t, u);
        uint8_t* codes = b + 128 + 32 * j;
        for (int64_t c = 0; c < UNIT; ++c) {
          const uint32_t v = bits_of(src, bf16, at + c);
          const int32_t k = code[(v >> 23) & 0xFF];
          n += k == ESCAPE;
          b[64 * j + c] = static_cast<uint8_t>(((v >> 24) & 0x80) | ((v >> 16) & 0x7F));
          if (c < 32)
            codes[c] = static_cast<uint8_t>(k);
          else
            codes[c - 32] = static_cast<uint8_t>(codes[c - 32] | (k << 4));
          if (f32) {
            const uint16_t lo = static_cast<uint16_t>(v & 0xFFFF);
            std::memcpy(b + 192 + 128 * j + 2 * c, &lo, 2);
          }
        }
      }
      count[t + 1] = n;
    }
  });
  for (int64_t t = 0; t < tiles; ++t) count[t + 1] += count[t];
  const int64_t E = count[tiles];
  auto side = torch::empty({SIDE_HEAD + tiles + 1 + 2 * E}, torch::kInt);
  int32_t* s = side.data_ptr<int32_t>();
  std::copy(table.begin(), table.end(), s);
  s[16] = static_cast<int32_t>(tiles);
  std::copy(count.begin(), count.end(), s + SIDE_HEAD);
  int32_t* pairs = s + SIDE_HEAD + tiles + 1;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int32_t* p = pairs + 2 * int64_t(count[t]);
      if (count[t + 1] == count[t]) continue;
      for (int64_t u = 0; u < per_tile; ++u) {
        const int64_t at = first(t, u);
        for (int64_t c = 0; c < UNIT; ++c) {
          const uint32_t v = bits_of(src, bf16, at + c);
          if (code[(v >> 23) & 0xFF] == ESCAPE) {
            *p++ = static_cast<int32_t>(u * UNIT + c);
            *p++ = static_cast<int32_t>(v);
          }
        }
      }
    }
  });
  return side;
}
