// Decode-sized matmuls (a few rows against a large weight) whose results do not depend on the number of rows.
//
// Why: a server batches the decode steps of unrelated requests. With a BLAS GEMM the kernel, its blocking and so
// the reduction order change with the row count M, so a request's logits (and then its greedy tokens) would depend
// on what else is running. Here every output element is a fixed set of chains of fused multiply-adds in a fixed
// order, computed the same way for any M and any thread count; the weight is still read once per call for all rows,
// which is what decode's memory-bound GEMV needs.
//
//   conv1d_rows:   y[M, N] = x[M, K] @ w[K, N] + b[N]        (GPT-2's Conv1D (in, out) layout)
//   dot_rows:      y[M, V] = x[M, C] @ w[V, C]^T             (the tied output head, wte (V, C))
// x, b and y are float32; w is float32 or bfloat16 (widened exactly in registers).
// Each has an AVX-512 and an AVX2+FMA body; the caller chooses (core/projection.py: the CPU's best, or a named one
// in tests, so that both run wherever the CPU has AVX-512). The projections accumulate each element over each of
// KPIECES fixed ranges of k in order, one vector lane per column, then add the pieces' sums in order, so their two
// bodies (and the scalar tail) give identical bits;
// the head reduces over C in lanes and then across them, so its bits differ between instruction sets (never
// between row counts). The quantized formats' kernel is in quant.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <type_traits>

// One piece's partial sums y [M, N] = x[:, ka:kz] @ w[ka:kz, c0:c1] over whole 64-column tiles [c0, c1), from zero
// (by_pieces_into; x [M, K]); and over the columns past the last whole tile.
using PieceColumns = std::function<void(const float* x, float* y, int64_t M, int64_t ka, int64_t kz, int64_t c0,
                                        int64_t c1)>;
using PieceTail = std::function<void(const float* x, float* y, int64_t M, int64_t ka, int64_t kz)>;
void by_pieces_into(const float* x, int64_t M, int64_t K, int64_t N, const float* b, const PieceColumns& columns,
                    const PieceTail& tail, float* y);

namespace {

constexpr int MR = 4;   // rows of x sharing each load of the weight (register blocking)
// Weight rows streamed per pass over a tile's accumulators (each element's chain within a piece of K stays in k
// order, so the pass length never changes a bit). One or two rows are bound by memory: short passes of KB_FEW rows
// keep 8 contiguous streams in flight, which the hardware prefetchers follow, and each pass also asks for its tile's
// segment of the next KB_FEW rows. From 3 rows the multiply-adds dominate and reloading the accumulators every few
// rows would cost more than the loads, so passes are KB_MANY rows long; that is too many streams for the hardware
// prefetchers, so each pass prefetches the next tile's segments itself, one tile ahead, into L2 (asked into L1, the
// lines queue on its few miss buffers and evict the tile being computed). The measurements behind these three
// constants are in docs/benchmarks.md ("Why the decode kernels are shaped as they are").
constexpr int KB_FEW = 8;
constexpr int KB_MANY = 128;
// A projection's K rows are cut into KPIECES contiguous ranges, whose partial sums are added in order at the end. A
// thread then owns whole pieces (all the columns of a run of weight rows): one contiguous stretch of memory, which
// the prefetchers follow. Split by columns, each thread read part of every weight row (for float32 (3072, 768), 1.5
// KB of each 3 KB row), and the narrow projections (N = 768) read well below the wide ones; by pieces, float32 reads
// them at about 1.2x the rate at one row (docs/benchmarks.md), and each element's rounding error is a few times
// smaller (eight short chains). The count is fixed, never the thread count, so the bits are the same on every
// machine.
constexpr int64_t KPIECES = 8;
// Weight rows per band of a weight in panels (weights.PanelMatrix; Layout below): K must be whole bands in every
// piece.
constexpr int64_t PANEL_ROWS = 32;
constexpr int VB = 8;   // vocabulary rows per pass of the head

// Weight loaders: 16 (AVX-512) or 8 (AVX2) consecutive weights as float32 lanes, and one weight for scalar tails.
// bfloat16 is the top half of a float32, so widening is exact (a shift): bf16 weights give the float32 arithmetic of
// their widened values, reading half the bytes.
struct F32 {
  using T = float;
  __attribute__((target("avx512f"))) static __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
  __attribute__((target("avx2"))) static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static float one(float v) { return v; }
};
struct BF16 {
  using T = uint16_t;
  __attribute__((target("avx512f"))) static __m512 load16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  __attribute__((target("avx2"))) static __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  // 16 consecutive weights as two float32 vectors: lane i of `even` is weight 2i, of `odd` weight 2i + 1. A 32-bit
  // lane holds two bfloat16, so one shift and one mask widen both: three instructions for 16 weights where two
  // load8 take four. From 4 rows, where each weight row is widened once per pair of rows, the AVX2 projections read
  // about 1.05x faster so (at 1 and 2 rows, bound by memory, the same; docs/benchmarks.md). The accumulators of a
  // kernel that keeps one per column are then in this order, and go back to column order when they are stored
  // (split_columns, join_columns): each column's chain is unchanged, so are the bits.
  __attribute__((target("avx2"))) static void load16_split(const uint16_t* p, __m256& even, __m256& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static float one(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

// 16 columns as two vectors in column order (lo: 0-7, hi: 8-15) -> as BF16::load16_split orders them (even: columns
// 0, 2, .., 14; odd: 1, 3, .., 15), and back. Exact (moves only).
__attribute__((target("avx2"))) inline void split_columns(__m256 lo, __m256 hi, __m256& even, __m256& odd) {
  const __m256 a = _mm256_permute2f128_ps(lo, hi, 0x20), b = _mm256_permute2f128_ps(lo, hi, 0x31);  // 0-3 8-11, 4-7 12-15
  even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
}
__attribute__((target("avx2"))) inline void join_columns(__m256 even, __m256 odd, __m256& lo, __m256& hi) {
  const __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);  // 0-3 8-11, 4-7 12-15
  lo = _mm256_permute2f128_ps(a, b, 0x20);
  hi = _mm256_permute2f128_ps(a, b, 0x31);
}

// Rows in groups of MR, then the 1 to 3 left over: each row's arithmetic is the same in every group size.
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

// ---- projections: y (accumulators, zeroed by the caller) += x @ w over the columns of one tile -------------------

// 64 columns (4 zmm) for rows [m0, m0 + R), weight rows [k0, k0 + kn): load the accumulators, kn multiply-adds in k
// order, store. wk points at weight row k0's column n, and row k0 + i is i * ldw further (N in a plain weight, 64 in
// panels, whose passes never leave a band). Streaming the weight row by row, kb rows at a time (KB_FEW or KB_MANY),
// gives the prefetchers contiguous streams; panels are one stream already, and ask for nothing ahead.
enum class Ahead { nothing, next_tile, next_pass };

template <int R, typename W>
__attribute__((target("avx512f,fma"))) inline void tile_avx512(const float* x, const typename W::T* wk, int64_t ldw,
                                                               float* y, int64_t K, int64_t N, int64_t m0, int64_t n,
                                                               int64_t k0, int64_t kn, Ahead ahead, bool fresh) {
  __m512 a[R][4];  // fresh: a piece's first pass, from zero
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(y + (m0 + r) * N + n + 16 * j);
  for (int64_t i = 0; i < kn; ++i) {
    const typename W::T* row = wk + i * ldw;
    __m512 wv[4];
    // the next tile's part of this weight row, 4 cache lines in float32 (past the end of w a prefetch is harmless)
    if (ahead == Ahead::next_tile)
      for (int j = 0; j < int(sizeof(typename W::T)); ++j)
        _mm_prefetch(reinterpret_cast<const char*>(row + 64) + 64 * j, _MM_HINT_T1);
    else if (ahead == Ahead::next_pass && m0 == 0)  // the next pass's segment of this column tile, into L2 (KB_FEW)
      for (int j = 0; j < int(sizeof(typename W::T)); ++j)
        _mm_prefetch(reinterpret_cast<const char*>(row + KB_FEW * ldw) + 64 * j, _MM_HINT_T1);
    for (int j = 0; j < 4; ++j) wv[j] = W::load16(row + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + r) * K + k0 + i]);
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_fmadd_ps(xv, wv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + (m0 + r) * N + n + 16 * j, a[r][j]);
}

// AVX2 has 16 registers: 32 columns (4 ymm) and up to 2 rows at a time.
template <int R, typename W>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* x, const typename W::T* wk, int64_t ldw,
                                                          float* y, int64_t K, int64_t N, int64_t m0, int64_t n,
                                                          int64_t k0, int64_t kn, Ahead ahead, bool fresh) {
  constexpr bool split = std::is_same_v<W, BF16>;  // accumulators in load16_split's order: (even, odd) x 2
  __m256 a[R][4];
  for (int r = 0; r < R; ++r) {
    float* yr = y + (m0 + r) * N + n;
    for (int j = 0; j < 4; ++j) a[r][j] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(yr + 8 * j);
    if (split && !fresh)
      for (int h = 0; h < 4; h += 2) split_columns(a[r][h], a[r][h + 1], a[r][h], a[r][h + 1]);
  }
  for (int64_t i = 0; i < kn; ++i) {
    const typename W::T* row = wk + i * ldw;
    __m256 wv[4];
    if (ahead == Ahead::next_tile)  // the next tile's part of this weight row, 2 cache lines in float32
      for (int j = 0; j < int(sizeof(typename W::T)) / 2; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(row + 32) + 64 * j, _MM_HINT_T1);
    else if (ahead == Ahead::next_pass && m0 == 0)  // as the AVX-512 body
      for (int j = 0; j < int(sizeof(typename W::T)) / 2; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(row + KB_FEW * ldw) + 64 * j, _MM_HINT_T1);
    if constexpr (split)
      for (int h = 0; h < 4; h += 2) BF16::load16_split(row + 8 * h, wv[h], wv[h + 1]);
    else
      for (int j = 0; j < 4; ++j) wv[j] = W::load8(row + 8 * j);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[(m0 + r) * K + k0 + i]);
      for (int j = 0; j < 4; ++j) a[r][j] = _mm256_fmadd_ps(xv, wv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (split)
      for (int h = 0; h < 4; h += 2) join_columns(a[r][h], a[r][h + 1], a[r][h], a[r][h + 1]);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + (m0 + r) * N + n + 8 * j, a[r][j]);
  }
}

// One row over a panel's whole 64 columns (8 ymm): the same chains as two tile_avx2<1> calls, but each weight row of
// a band is read once, in address order. bfloat16 also asks for the lines PANEL_AHEAD bytes on (8 weight rows), into
// L1: without it the pass read panels at about 0.9x the rate (docs/benchmarks.md); float32, which does half the
// arithmetic a byte, read slower with it.
constexpr int64_t PANEL_AHEAD = 1024;

template <typename W>
__attribute__((target("avx2,fma"))) inline void wide_avx2(const float* x, const typename W::T* wk, float* y, int64_t K,
                                                          int64_t N, int64_t m0, int64_t n, int64_t k0, int64_t kn,
                                                          bool fresh) {
  constexpr bool split = std::is_same_v<W, BF16>;  // accumulators in load16_split's order, as tile_avx2's
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m0 * N + n + 8 * j);
  if (split && !fresh)
    for (int h = 0; h < 8; h += 2) split_columns(a[h], a[h + 1], a[h], a[h + 1]);
  for (int64_t i = 0; i < kn; ++i) {
    const typename W::T* row = wk + i * 64;
    if constexpr (split)
      for (int j = 0; j < 2; ++j) _mm_prefetch(reinterpret_cast<const char*>(row) + PANEL_AHEAD + 64 * j, _MM_HINT_T0);
    const __m256 xv = _mm256_set1_ps(x[m0 * K + k0 + i]);
    if constexpr (split) {
      for (int h = 0; h < 8; h += 2) {
        __m256 even, odd;
        BF16::load16_split(row + 8 * h, even, odd);
        a[h] = _mm256_fmadd_ps(xv, even, a[h]);
        a[h + 1] = _mm256_fmadd_ps(xv, odd, a[h + 1]);
      }
    } else {
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(xv, W::load8(row + 8 * j), a[j]);
    }
  }
  if (split)
    for (int h = 0; h < 8; h += 2) join_columns(a[h], a[h + 1], a[h], a[h + 1]);
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(y + m0 * N + n + 8 * j, a[j]);
}

// The same chains for `width` <= 16 J columns from n, with masked loads and stores (float32 weights, from 3 rows).
template <int R, int J>
__attribute__((target("avx512f,fma"))) inline void edge_avx512(const float* x, const float* w, float* y, int64_t K,
                                                               int64_t N, int64_t m0, int64_t n, int64_t width,
                                                               int64_t k0, int64_t kn, bool fresh) {
  __mmask16 mask[J];
  for (int j = 0; j < J; ++j) {
    const int64_t left = std::clamp<int64_t>(width - 16 * j, 0, 16);
    mask[j] = static_cast<__mmask16>((1u << left) - 1);
  }
  __m512 a[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      a[r][j] = fresh ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[j], y + (m0 + r) * N + n + 16 * j);
  for (int64_t k = k0; k < k0 + kn; ++k) {
    __m512 wv[J];
    for (int j = 0; j < 4; ++j)  // the next tile's part of this row, as tile_avx512's passes do
      _mm_prefetch(reinterpret_cast<const char*>(w + k * N + n + width) + 64 * j, _MM_HINT_T1);
    for (int j = 0; j < J; ++j) wv[j] = _mm512_maskz_loadu_ps(mask[j], w + k * N + n + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + r) * K + k]);
      for (int j = 0; j < J; ++j) a[r][j] = _mm512_fmadd_ps(xv, wv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) _mm512_mask_storeu_ps(y + (m0 + r) * N + n + 16 * j, mask[j], a[r][j]);
}

template <int R>
inline void edge(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n, int64_t width,
                 int64_t k0, int64_t kn, bool fresh) {
  switch ((width + 15) / 16) {
    case 1: edge_avx512<R, 1>(x, w, y, K, N, m0, n, width, k0, kn, fresh); break;
    case 2: edge_avx512<R, 2>(x, w, y, K, N, m0, n, width, k0, kn, fresh); break;
    case 3: edge_avx512<R, 3>(x, w, y, K, N, m0, n, width, k0, kn, fresh); break;
    default: edge_avx512<R, 4>(x, w, y, K, N, m0, n, width, k0, kn, fresh); break;
  }
}

// tile_avx2's chains for `width` < 32 columns from n, with masked loads and stores (float32 weights, from 3 rows).
template <int R>
__attribute__((target("avx2,fma"))) void edge_avx2(const float* x, const float* w, float* y, int64_t K, int64_t N,
                                                   int64_t m0, int64_t n, int64_t width, int64_t k0, int64_t kn,
                                                   bool fresh) {
  __m256i mask[4];
  for (int j = 0; j < 4; ++j)
    mask[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(width - 8 * j)),
                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      a[r][j] = fresh ? _mm256_setzero_ps() : _mm256_maskload_ps(y + (m0 + r) * N + n + 8 * j, mask[j]);
  for (int64_t k = k0; k < k0 + kn; ++k) {
    __m256 wv[4];
    for (int j = 0; j < 2; ++j)  // the next tile's part of this row, as tile_avx2's passes do
      _mm_prefetch(reinterpret_cast<const char*>(w + k * N + n + width) + 64 * j, _MM_HINT_T1);
    for (int j = 0; j < 4; ++j) wv[j] = _mm256_maskload_ps(w + k * N + n + 8 * j, mask[j]);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[(m0 + r) * K + k]);
      for (int j = 0; j < 4; ++j) a[r][j] = _mm256_fmadd_ps(xv, wv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm256_maskstore_ps(y + (m0 + r) * N + n + 8 * j, mask[j], a[r][j]);
}

// Where weight row k's column n is (n a multiple of 32): a plain (K, N) weight, or panels
// [K / PANEL_ROWS, N / 64, PANEL_ROWS, 64] (weights.PanelMatrix), where PANEL_ROWS rows of 64 columns are one
// contiguous run. A thread's share of plain rows is contiguous too, but a pass reads it as kb streams (one per weight
// row, a tile's 64-256 bytes each), which AMD's hardware prefetchers follow badly: at one row on a Zen 3 EPYC,
// bfloat16 read at about 0.8x the rate of the same pass over panels, from memory and from cache alike (an Intel Xeon
// read plain weights faster: kernels.CPU.bf16_panels chooses; docs/benchmarks.md).
template <typename T>
struct Layout {
  const T* w;
  int64_t N;
  bool panels;
  const T* at(int64_t k, int64_t n) const {
    if (!panels) return w + k * N + n;
    return w + ((k / PANEL_ROWS) * (N / 64) + n / 64) * (PANEL_ROWS * 64) + (k % PANEL_ROWS) * 64 + n % 64;
  }
  int64_t ld() const { return panels ? 64 : N; }  // from one weight row to the next within a pass
};

// A pass covers kb weight rows: KB_FEW or KB_MANY on a plain weight, one band of PANEL_ROWS in panels at every row
// count (passes of KB_MANY rows across bands read GPT-2's projections at 8 rows at about 0.8x the rate of one-band
// passes). A piece is whole bands: conv1d_rows checks K.
inline int64_t pass_rows(int64_t M, bool panels) { return panels ? PANEL_ROWS : M <= 2 ? KB_FEW : KB_MANY; }
inline Ahead pass_ahead(int64_t kb, bool panels) {
  return panels ? Ahead::nothing : kb == KB_MANY ? Ahead::next_tile : Ahead::next_pass;
}

// From 3 rows on the multiply-adds keep the loads busy, and a 64-byte load that straddles two cache lines costs two
// (a memory-mapped safetensors file aligns a tensor to 8 bytes at best, so float32 weights used in place often sit
// mid-line): those passes start their tiles at the weight rows' first 64-byte boundary, with masked tiles for the
// columns before it and after the last whole tile. Rows of a (K, N) weight with N a multiple of 16 all share that
// boundary (panels start on one). Each body computes y (one piece's partial sums) = x[:, ka:kz] @ w[ka:kz, c0:c1],
// from zero.
template <typename W>
__attribute__((target("avx512f,fma"))) void columns_avx512(const float* x, Layout<typename W::T> w, float* y,
                                                           int64_t M, int64_t K, int64_t N, int64_t ka, int64_t kz,
                                                           int64_t c0, int64_t c1) {
  const int64_t kb = pass_rows(M, w.panels);
  const Ahead ahead = pass_ahead(kb, w.panels);
  int64_t lead = 0;
  if constexpr (std::is_same_v<W, F32>)
    if (kb == KB_MANY && !w.panels)
      lead = std::min<int64_t>(c1 - c0, (64 - reinterpret_cast<uintptr_t>(w.w + c0) % 64) % 64 / 4);
  for (int64_t k0 = ka; k0 < kz; k0 += kb) {
    const int64_t kn = std::min<int64_t>(kb, kz - k0);
    const bool fresh = k0 == ka;
    int64_t n = c0 + lead;
    if constexpr (std::is_same_v<W, F32>)
      if (lead)
        for_rows(M, [&](auto R, int64_t m0) {
          edge<decltype(R)::value>(x, w.w, y, K, N, m0, c0, lead, k0, kn, fresh);
        });
    for (; n + 64 <= c1; n += 64)
      for_rows(M, [&](auto R, int64_t m0) {
        tile_avx512<decltype(R)::value, W>(x, w.at(k0, n), w.ld(), y, K, N, m0, n, k0, kn, ahead, fresh);
      });
    if constexpr (std::is_same_v<W, F32>)
      if (n < c1)
        for_rows(M, [&](auto R, int64_t m0) {
          edge<decltype(R)::value>(x, w.w, y, K, N, m0, n, c1 - n, k0, kn, fresh);
        });
  }
}

template <typename W>
__attribute__((target("avx2,fma"))) void columns_avx2(const float* x, Layout<typename W::T> w, float* y, int64_t M,
                                                      int64_t K, int64_t N, int64_t ka, int64_t kz, int64_t c0,
                                                      int64_t c1) {
  const int64_t kb = pass_rows(M, w.panels);
  const Ahead ahead = pass_ahead(kb, w.panels);
  int64_t lead = 0;  // as the AVX-512 body: from 3 rows, tiles start at the rows' first 64-byte boundary
  if constexpr (std::is_same_v<W, F32>)
    if (kb == KB_MANY && !w.panels)
      lead = std::min<int64_t>(c1 - c0, (64 - reinterpret_cast<uintptr_t>(w.w + c0) % 64) % 64 / 4);
  for (int64_t k0 = ka; k0 < kz; k0 += kb) {
    const int64_t kn = std::min<int64_t>(kb, kz - k0);
    const bool fresh = k0 == ka;
    const auto edge = [&](int64_t n, int64_t width) {
      if constexpr (std::is_same_v<W, F32>) {
        int64_t m0 = 0;
        for (; m0 + 2 <= M; m0 += 2) edge_avx2<2>(x, w.w, y, K, N, m0, n, width, k0, kn, fresh);
        if (m0 < M) edge_avx2<1>(x, w.w, y, K, N, m0, n, width, k0, kn, fresh);
      }
    };
    if (lead) edge(c0, lead);
    int64_t n = c0 + lead;
    if (w.panels)  // c0 and c1 are whole panels
      for (; n < c1; n += 64) {
        int64_t m0 = 0;
        for (; m0 + 2 <= M; m0 += 2)
          for (int64_t h = 0; h < 64; h += 32)
            tile_avx2<2, W>(x, w.at(k0, n + h), 64, y, K, N, m0, n + h, k0, kn, Ahead::next_tile, fresh);
        if (m0 < M) wide_avx2<W>(x, w.at(k0, n), y, K, N, m0, n, k0, kn, fresh);
      }
    for (; n + 32 <= c1; n += 32) {
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2) tile_avx2<2, W>(x, w.at(k0, n), w.ld(), y, K, N, m0, n, k0, kn, ahead, fresh);
      if (m0 < M) tile_avx2<1, W>(x, w.at(k0, n), w.ld(), y, K, N, m0, n, k0, kn, ahead, fresh);
    }
    if (n < c1) edge(n, c1 - n);
  }
}

// y[i] = ((pp[0][i] + pp[1][i]) + ... + pp[P - 1][i]) + b[i % N] for i in [begin, end), each piece's partial sums
// MN floats apart: 8 elements of a row at a time (each lane does the scalar additions in the same order, so the same
// bits), the rest one by one. Written out because the compiler keeps the plain loop scalar (its inner sum over the
// pieces has a run-time length), and at one row that scalar loop was a visible part of a projection's time.
__attribute__((target("avx2"))) void add_pieces(const float* pp, const float* b, float* y, int64_t P, int64_t MN,
                                                int64_t N, int64_t begin, int64_t end) {
  int64_t i = begin;
  while (i < end) {
    const int64_t n = i % N, stop = std::min(end, i - n + N);  // this row's part of [begin, end)
    for (; i + 8 <= stop; i += 8) {
      __m256 acc = _mm256_loadu_ps(pp + i);
      for (int64_t p = 1; p < P; ++p) acc = _mm256_add_ps(acc, _mm256_loadu_ps(pp + p * MN + i));
      _mm256_storeu_ps(y + i, _mm256_add_ps(acc, _mm256_loadu_ps(b + i % N)));
    }
    for (; i < stop; ++i) {
      float acc = pp[i];
      for (int64_t p = 1; p < P; ++p) acc += pp[p * MN + i];
      y[i] = acc + b[i % N];
    }
  }
}

}  // namespace

// y[m, n] = (sum over the pieces p, in order, of x[m, piece p] @ w[piece p, n]) + b[n], for any weight format:
// `columns` computes one piece's partial sums over whole 64-column tiles, `tail` over the columns past the last one.
// The work is pieces x column groups (one group where the threads are no more than the pieces), in piece order, so
// each thread's share of the weight is a contiguous run of rows. Here and in packed.cpp (packed exponents), so that
// every format adds the same pieces in the same order. x [M, K] and y [M, N] are rows in a row.
void by_pieces_into(const float* xp, int64_t M, int64_t K, int64_t N, const float* b, const PieceColumns& columns,
                    const PieceTail& tail, float* yp) {
  const int64_t P = std::min<int64_t>(KPIECES, K);  // P depends on K alone, never on M or threads
  if (P == 0) {  // K = 0: b
    for (int64_t m = 0; m < M; ++m) std::copy_n(b, N, yp + m * N);
    return;
  }
  const std::unique_ptr<float[]> part(new float[P * M * N]);  // each piece's partial sums (every one written)
  float* pp = part.get();
  const int64_t tiles = N / 64, groups = tiles ? std::max<int64_t>(1, (at::get_num_threads() + P - 1) / P) : 0;
  const auto piece = [&](int64_t p) { return std::pair<int64_t, int64_t>{K * p / P, K * (p + 1) / P}; };
  at::parallel_for(0, P * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [ka, kz] = piece(i / groups);
      const int64_t g = i % groups, c0 = tiles * g / groups * 64, c1 = tiles * (g + 1) / groups * 64;
      columns(xp, pp + i / groups * M * N, M, ka, kz, c0, c1);
    }
  });
  if (tiles * 64 < N)
    for (int64_t p = 0; p < P; ++p) {
      const auto [ka, kz] = piece(p);
      tail(xp, pp + p * M * N, M, ka, kz);
    }
  at::parallel_for(0, M * N, 4096, [&](int64_t begin, int64_t end) { add_pieces(pp, b, yp, P, M * N, N, begin, end); });
}

namespace {

// conv1d_rows on a plain or paneled weight: the columns past the last whole 64-column tile run the same chains in
// scalar code (fmaf rounds exactly as a vector FMA lane does).
template <typename W>
void rows_into(const float* x, int64_t M, Layout<typename W::T> w, int64_t K, int64_t N, const float* b, bool avx512,
               float* out) {
  by_pieces_into(
      x, M, K, N, b,
      [&](const float* xp, float* y, int64_t M, int64_t ka, int64_t kz, int64_t c0, int64_t c1) {
        if (avx512)
          columns_avx512<W>(xp, w, y, M, K, N, ka, kz, c0, c1);
        else
          columns_avx2<W>(xp, w, y, M, K, N, ka, kz, c0, c1);
      },
      [&](const float* xp, float* y, int64_t M, int64_t ka, int64_t kz) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = N / 64 * 64; n < N; ++n) {
            float acc = 0.0f;
            for (int64_t k = ka; k < kz; ++k) acc = __builtin_fmaf(xp[m * K + k], W::one(w.w[k * N + n]), acc);
            y[m * N + n] = acc;
          }
      },
      out);
}

// ---- the head: y[m, v] = dot(x[m], w[v]) ----------------------------------------------------------------
// A block is NV vocabulary rows x R input rows of accumulators, NV a compile-time constant so that the compiler can
// keep them in registers (a run-time count left them on the stack). Each (m, v) element is one chain over C in the
// same order whatever the block shape, so the bits do not depend on how rows are grouped.

// Weights per cache line.
template <typename W>
constexpr int64_t LINE() { return 64 / sizeof(typename W::T); }

// While a block reads column c of its NV vocabulary rows, the first row group prefetches that column's line in every
// other row of the next block; the hardware prefetchers fetch the rest (every row, or the next block's lines in
// address order, measured slower: docs/benchmarks.md has the figures).
// Each row of the block HEAD_AHEAD blocks on is also asked for into L2 (past the end of w, harmlessly): the head is
// GPT-2's largest matrix (154 MB in float32), and its one stream ran below the machine's bandwidth without it.
constexpr int64_t HEAD_AHEAD = 8;

template <int NV, typename W>
inline void prefetch_next(const typename W::T* w, int64_t C, int64_t v0, int64_t c) {
  for (int i = 0; i < NV; i += 2) _mm_prefetch(reinterpret_cast<const char*>(w + (v0 + NV + i) * C + c), _MM_HINT_T0);
}

template <int R, int NV, typename W>
__attribute__((target("avx512f,fma"))) void head_block_avx512(const float* x, const typename W::T* w, float* y,
                                                              int64_t C, int64_t ldy, int64_t y0, int64_t m0,
                                                              int64_t v0) {
  __m512 acc[NV][R];
  for (int i = 0; i < NV; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    __m512 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = _mm512_loadu_ps(x + (m0 + r) * C + c);
    if (m0 == 0 && c % LINE<W>() == 0) {
      prefetch_next<NV, W>(w, C, v0, c);
      for (int i = 0; i < NV; ++i)  // and every row of the block HEAD_AHEAD blocks on, into L2
        _mm_prefetch(reinterpret_cast<const char*>(w + (v0 + NV * HEAD_AHEAD + i) * C + c), _MM_HINT_T1);
    }
    for (int i = 0; i < NV; ++i) {
      const __m512 wv = W::load16(w + (v0 + i) * C + c);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(xs[r], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < NV; ++i)
    for (int r = 0; r < R; ++r) {
      float t = _mm512_reduce_add_ps(acc[i][r]);
      for (int64_t cc = c; cc < C; ++cc) t = __builtin_fmaf(x[(m0 + r) * C + cc], W::one(w[(v0 + i) * C + cc]), t);
      y[(m0 + r) * ldy + v0 - y0 + i] = t;
    }
}

template <int R, int NV, typename W>
__attribute__((target("avx2,fma"))) void head_block_avx2(const float* x, const typename W::T* w, float* y, int64_t C,
                                                         int64_t ldy, int64_t y0, int64_t m0, int64_t v0) {
  __m256 acc[NV][R];
  for (int i = 0; i < NV; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= C; c += 8) {
    __m256 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_ps(x + (m0 + r) * C + c);
    // as the AVX-512 body, but for one row of float32 weights: on an AVX2-only EPYC (Zen 3) its two threads read the
    // head at about 0.8x the rate with these prefetches (docs/benchmarks.md); a bfloat16 row, or several rows, read
    // faster with them
    if (m0 == 0 && c % LINE<W>() == 0 && !(R == 1 && std::is_same_v<W, F32>)) {
      prefetch_next<NV, W>(w, C, v0, c);
      for (int i = 0; i < NV; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + (v0 + NV * HEAD_AHEAD + i) * C + c), _MM_HINT_T1);
    }
    for (int i = 0; i < NV; ++i) {
      const __m256 wv = W::load8(w + (v0 + i) * C + c);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(xs[r], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < NV; ++i)
    for (int r = 0; r < R; ++r) {
      // a fixed pairwise reduction of the 8 lanes
      __m128 lo = _mm256_castps256_ps128(acc[i][r]), hi = _mm256_extractf128_ps(acc[i][r], 1);
      __m128 s4 = _mm_add_ps(lo, hi);
      __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      float t = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
      for (int64_t cc = c; cc < C; ++cc) t = __builtin_fmaf(x[(m0 + r) * C + cc], W::one(w[(v0 + i) * C + cc]), t);
      y[(m0 + r) * ldy + v0 - y0 + i] = t;
    }
}

// Vocabulary rows [v0, v0 + nv) for input rows [m0, m0 + R), into y (row stride ldy, its column 0 at vocabulary
// row y0): whole blocks, then single rows. AVX-512
// blocks are 8 wide at every R (at R = 4 the 32 accumulators spill a little, which measured faster than 4 wide and
// re-reading x); AVX2's 16 registers take 8, 4, 2 and 2 at R = 1..4, but bfloat16 at one row takes 2: its 8 rows of
// 1.5 KB made 8 short streams, read at about 0.88x the rate of 2 (docs/benchmarks.md). The width never changes a bit.
template <int R, typename W>
void head_rows(const float* x, const typename W::T* w, float* y, int64_t C, int64_t ldy, int64_t y0, int64_t m0,
               int64_t v0, int64_t nv, bool avx512) {
  constexpr int N512 = 8;
  constexpr int N256 = R == 1 ? (std::is_same_v<W, BF16> ? 2 : 8) : R == 2 ? 4 : 2;
  const int64_t n = avx512 ? N512 : N256;
  int64_t v = v0;
  for (; v + n <= v0 + nv; v += n)
    avx512 ? head_block_avx512<R, N512, W>(x, w, y, C, ldy, y0, m0, v)
           : head_block_avx2<R, N256, W>(x, w, y, C, ldy, y0, m0, v);
  for (; v < v0 + nv; ++v)
    avx512 ? head_block_avx512<R, 1, W>(x, w, y, C, ldy, y0, m0, v) : head_block_avx2<R, 1, W>(x, w, y, C, ldy, y0, m0, v);
}

template <typename W>
torch::Tensor head(torch::Tensor x, const typename W::T* w, int64_t V, bool avx512) {
  x = x.contiguous();
  const int64_t M = x.size(0), C = x.size(1);
  auto y = torch::empty({M, V}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (V + VB - 1) / VB, 64, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t v0 = blk * VB, nv = std::min<int64_t>(VB, V - v0);
      for_rows(M, [&](auto R, int64_t m0) { head_rows<decltype(R)::value, W>(xp, w, yp, C, V, 0, m0, v0, nv, avx512); });
    }
  });
  return y;
}

}  // namespace

// dot_rows for vocabulary rows [v0, v0 + n) only, into y [M, ldy] (its column 0 at row v0), on the calling thread,
// each logit dot_rows' own bits (the same blocks in the same order): block.cpp's greedy picks make the head a piece at
// a time this way and reduce each piece while it is in L1. x: contiguous float32 [M, C]; w: [V, C] as dot_rows'.
void dot_rows_slice(const torch::Tensor& x, const torch::Tensor& w, int64_t v0, int64_t n, float* y, int64_t ldy,
                    bool avx512) {
  const int64_t M = x.size(0), C = x.size(1);
  const float* xp = x.data_ptr<float>();
  for (int64_t b = v0; b < v0 + n; b += VB) {
    const int64_t nv = std::min<int64_t>(VB, v0 + n - b);
    for_rows(M, [&](auto R, int64_t m0) {
      if (w.scalar_type() == at::kBFloat16)
        head_rows<decltype(R)::value, BF16>(xp, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), y, C, ldy,
                                            v0, m0, b, nv, avx512);
      else
        head_rows<decltype(R)::value, F32>(xp, w.data_ptr<float>(), y, C, ldy, v0, m0, b, nv, avx512);
    });
  }
}

// ---- entry points: shapes and dtypes checked, then the templates above -------------------------------------------

// x [M, K] (rows in a row) @ w + b into y [M, N]: w float32 or bfloat16, a plain (K, N) weight or panels
// [K / PANEL_ROWS, N / 64, PANEL_ROWS, 64] (weights.PanelMatrix) with K whole bands in each of the KPIECES pieces.
// block.cpp calls this on its own buffers; conv1d_rows is the same on tensors.
void conv1d_rows_into(const float* x, int64_t M, int64_t K, const torch::Tensor& w, const torch::Tensor& b,
                      bool avx512, float* y) {
  TORCH_CHECK(b.scalar_type() == at::kFloat && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "conv1d_rows: float32 x and b, float32 or bfloat16 w only");
  const bool panels = w.dim() == 4;
  TORCH_CHECK(!panels || (w.size(2) == PANEL_ROWS && w.size(3) == 64 && w.size(0) % KPIECES == 0),
              "conv1d_rows: panels must be [K / ", PANEL_ROWS, ", N / 64, ", PANEL_ROWS, ", 64] with K a multiple of ",
              KPIECES * PANEL_ROWS);
  const int64_t WK = panels ? w.size(0) * PANEL_ROWS : w.size(0), N = panels ? w.size(1) * 64 : w.size(1);
  TORCH_CHECK((panels || w.dim() == 2) && b.dim() == 1 && K == WK && N == b.size(0),
              "conv1d_rows: shapes do not chain (expected x [M, K], w [K, N] or its panels, b [N])");
  TORCH_CHECK(w.is_contiguous() && b.is_contiguous(), "conv1d_rows: w and b must be contiguous");
  if (w.scalar_type() == at::kBFloat16)
    rows_into<BF16>(x, M, {reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), N, panels}, K, N,
                    b.data_ptr<float>(), avx512, y);
  else
    rows_into<F32>(x, M, {w.data_ptr<float>(), N, panels}, K, N, b.data_ptr<float>(), avx512, y);
}

torch::Tensor conv1d_rows(torch::Tensor x, torch::Tensor w, torch::Tensor b, bool avx512) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "conv1d_rows: float32 x and b, float32 or bfloat16 w only");
  TORCH_CHECK(x.dim() == 2 && b.dim() == 1,
              "conv1d_rows: shapes do not chain (expected x [M, K], w [K, N] or its panels, b [N])");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), b.size(0)}, x.options());
  conv1d_rows_into(x.data_ptr<float>(), x.size(0), x.size(1), w, b, avx512, y.data_ptr<float>());
  return y;
}

// Panels [K / PANEL_ROWS, N / 64, PANEL_ROWS, 64] (bfloat16 or float32) -> the (K, N) float32 matrix, for the GEMMs
// of longer inputs: each band read once in address order, each of its rows widened into 64 contiguous columns (torch's
// copy from the permuted view ran prefill at about 0.97x the plain matrix's widening).
torch::Tensor unpack_panels(torch::Tensor panels) {
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == PANEL_ROWS && panels.size(3) == 64 && panels.is_contiguous() &&
                  (panels.scalar_type() == at::kBFloat16 || panels.scalar_type() == at::kFloat),
              "unpack_panels: expected contiguous bfloat16 or float32 panels [K / ", PANEL_ROWS, ", N / 64, ",
              PANEL_ROWS, ", 64]");
  const int64_t bands = panels.size(0), tiles = panels.size(1), N = tiles * 64;
  auto out = torch::empty({bands * PANEL_ROWS, N}, panels.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  const void* src = panels.data_ptr();
  at::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t t = 0; t < tiles; ++t)
        for (int64_t r = 0; r < PANEL_ROWS; ++r) {
          const int64_t from = ((b * tiles + t) * PANEL_ROWS + r) * 64;
          float* to = o + (b * PANEL_ROWS + r) * N + t * 64;
          for (int64_t c = 0; c < 64; ++c)
            to[c] = bf16 ? BF16::one(static_cast<const uint16_t*>(src)[from + c])
                         : static_cast<const float*>(src)[from + c];
        }
  });
  return out;
}

torch::Tensor dot_rows(torch::Tensor x, torch::Tensor w, bool avx512) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "dot_rows: float32 x, float32 or bfloat16 w only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dot_rows: expected x [M, C], w [V, C]");
  TORCH_CHECK(w.is_contiguous(), "dot_rows: w must be contiguous");
  if (w.scalar_type() == at::kBFloat16)
    return head<BF16>(x, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), w.size(0), avx512);
  return head<F32>(x, w.data_ptr<float>(), w.size(0), avx512);
}
