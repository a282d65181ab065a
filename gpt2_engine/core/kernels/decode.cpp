// Decode-sized matmuls (a few rows against a large weight) whose results do not depend on the number of rows.
//
// Why: a server batches the decode steps of unrelated requests. With a BLAS GEMM the kernel, its blocking and so
// the reduction order change with the row count M, so a request's logits (and then its greedy tokens) would depend
// on what else is running. Here every output element is one chain of fused multiply-adds in a fixed order,
// computed the same way for any M; the weight is still read once per call for all rows, which is what decode's
// memory-bound GEMV needs. Each output element is computed by one thread (at::parallel_for over column blocks),
// so the thread count does not change results either.
//
// The float32 routines below (and their int8 twins at the end), each with an AVX-512 and an AVX2+FMA body; the caller chooses (kernels.py: the CPU's best, or a
// named one in tests, so that both run wherever the CPU has AVX-512):
//   conv1d_rows: y[M, N] = x[M, K] @ w[K, N] + b[N]   (GPT-2's Conv1D (in, out) layout)
//   dot_rows:    y[M, V] = x[M, C] @ w[V, C]^T        (the tied output head, wte (V, C))
// conv1d_rows accumulates each element over k = 0..K-1 in order, one vector lane per column, so its AVX-512 and AVX2
// bodies (and the scalar tail) give identical bits. dot_rows reduces over C in vector lanes and then across them,
// so its bits differ between the two instruction sets (never between row counts).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <string>

namespace {

constexpr int MR = 4;  // rows of x sharing one pass over a block of the head

// ---- conv1d_rows ------------------------------------------------------------------------------------------------

// Rows in groups of MR, then the 1 to 3 left over: each row's arithmetic is the same in every group size.
template <typename Block1, typename Block2, typename Block3, typename Block4>
void for_rows(int64_t M, Block1 b1, Block2 b2, Block3 b3, Block4 b4) {
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) b4(m0);
  switch (M - m0) {
    case 3: b3(m0); break;
    case 2: b2(m0); break;
    case 1: b1(m0); break;
    default: break;
  }
}

// Columns [c0, c1) (whole tiles) of every row: y = x @ w + b. The weight streams row by row: KB rows at a time,
// each tile's accumulators are loaded once, take KB fused multiply-adds in k order, and are stored back, so every
// output element is still one FMA chain over k = 0..K-1 (the same order for any M), while the hardware prefetchers
// see KB contiguous streams instead of one short strided read per row and page.
constexpr int KB = 8;

// R rows share each load of the weight vectors (register blocking); every row's chain is the same for any R.
template <int R>
__attribute__((target("avx512f,fma"))) inline void conv1d_tile_avx512(const float* x, const float* w, float* y,
                                                                      int64_t K, int64_t N, int64_t m0, int64_t n,
                                                                      int64_t k0, int64_t kn) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(y + (m0 + r) * N + n + 16 * j);
  for (int64_t k = k0; k < k0 + kn; ++k) {
    const float* wk = w + k * N + n;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32),
                 w3 = _mm512_loadu_ps(wk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + r) * K + k]);
      a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(xv, w2, a[r][2]);
      a[r][3] = _mm512_fmadd_ps(xv, w3, a[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + (m0 + r) * N + n + 16 * j, a[r][j]);
}

__attribute__((target("avx512f,fma"))) void conv1d_cols_avx512(const float* x, const float* w, float* y, int64_t M,
                                                               int64_t K, int64_t N, int64_t c0, int64_t c1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = c0; n < c1; n += 16) _mm512_storeu_ps(y + m * N + n, _mm512_setzero_ps());
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t kn = std::min<int64_t>(KB, K - k0);
    for (int64_t n = c0; n < c1; n += 64)
      for_rows(M, [&](int64_t m0) { conv1d_tile_avx512<1>(x, w, y, K, N, m0, n, k0, kn); },
               [&](int64_t m0) { conv1d_tile_avx512<2>(x, w, y, K, N, m0, n, k0, kn); },
               [&](int64_t m0) { conv1d_tile_avx512<3>(x, w, y, K, N, m0, n, k0, kn); },
               [&](int64_t m0) { conv1d_tile_avx512<4>(x, w, y, K, N, m0, n, k0, kn); });
  }
}

// AVX2 has 16 registers: a 64-column tile goes as two halves of 4 vectors, 2 rows at a time (8 accumulators).
template <int R>
__attribute__((target("avx2,fma"))) inline void conv1d_half_avx2(const float* x, const float* w, float* y, int64_t K,
                                                                 int64_t N, int64_t m0, int64_t n, int64_t k0,
                                                                 int64_t kn) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_loadu_ps(y + (m0 + r) * N + n + 8 * j);
  for (int64_t k = k0; k < k0 + kn; ++k) {
    const float* wk = w + k * N + n;
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16),
                 w3 = _mm256_loadu_ps(wk + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[(m0 + r) * K + k]);
      a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(xv, w2, a[r][2]);
      a[r][3] = _mm256_fmadd_ps(xv, w3, a[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + (m0 + r) * N + n + 8 * j, a[r][j]);
}

__attribute__((target("avx2,fma"))) void conv1d_cols_avx2(const float* x, const float* w, float* y, int64_t M,
                                                         int64_t K, int64_t N, int64_t c0, int64_t c1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = c0; n < c1; n += 8) _mm256_storeu_ps(y + m * N + n, _mm256_setzero_ps());
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t kn = std::min<int64_t>(KB, K - k0);
    for (int64_t n = c0; n < c1; n += 32) {
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2) conv1d_half_avx2<2>(x, w, y, K, N, m0, n, k0, kn);
      if (m0 < M) conv1d_half_avx2<1>(x, w, y, K, N, m0, n, k0, kn);
    }
  }
}

// The same chain for columns the vector blocks do not cover: fmaf rounds exactly as a vector FMA lane does.
void conv1d_tail(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n_begin) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n_begin; n < N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = __builtin_fmaf(x[m * K + k], w[k * N + n], acc);
      y[m * N + n] = acc + b[n];
    }
}

torch::Tensor conv1d_rows(torch::Tensor x, torch::Tensor w, torch::Tensor b, bool avx512) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && b.dim() == 1, "conv1d_rows: expected x [M, K], w [K, N], b [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "conv1d_rows: float32 tensors only");
  TORCH_CHECK(x.size(1) == w.size(0) && w.size(1) == b.size(0), "conv1d_rows: shapes do not chain");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous() && b.is_contiguous(), "conv1d_rows: w and b must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *bp = b.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = N / 64;  // whole 64-column tiles; each thread takes a contiguous run of them
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    if (avx512)
      conv1d_cols_avx512(xp, wp, yp, M, K, N, begin * 64, end * 64);
    else
      conv1d_cols_avx2(xp, wp, yp, M, K, N, begin * 64, end * 64);
    for (int64_t m = 0; m < M; ++m)  // the bias after the whole chain, as the tail does
      for (int64_t n = begin * 64; n < end * 64; ++n) yp[m * N + n] += bp[n];
  });
  if (tiles * 64 < N) conv1d_tail(xp, wp, bp, yp, M, K, N, tiles * 64);
  return y;
}

// ---- dot_rows (the tied head) -----------------------------------------------------------------------------------

constexpr int VB = 8;  // vocabulary rows per pass: up to 8 x MR accumulators

template <int R>
__attribute__((target("avx512f,fma"))) void dot_block_avx512(const float* x, const float* w, float* y, int64_t C,
                                                            int64_t V, int64_t m0, int64_t v0, int64_t nv) {
  __m512 acc[VB][R];
  for (int i = 0; i < VB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    __m512 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = _mm512_loadu_ps(x + (m0 + r) * C + c);
    for (int i = 0; i < nv; ++i) {
      __m512 wv = _mm512_loadu_ps(w + (v0 + i) * C + c);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(xs[r], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < nv; ++i)
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(acc[i][r]);
      for (int64_t cc = c; cc < C; ++cc) s = __builtin_fmaf(x[(m0 + r) * C + cc], w[(v0 + i) * C + cc], s);
      y[(m0 + r) * V + v0 + i] = s;
    }
}

template <int R>
__attribute__((target("avx2,fma"))) void dot_block_avx2(const float* x, const float* w, float* y, int64_t C, int64_t V,
                                                       int64_t m0, int64_t v0, int64_t nv) {
  __m256 acc[VB][R];
  for (int i = 0; i < VB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= C; c += 8) {
    __m256 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_ps(x + (m0 + r) * C + c);
    for (int i = 0; i < nv; ++i) {
      __m256 wv = _mm256_loadu_ps(w + (v0 + i) * C + c);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(xs[r], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < nv; ++i)
    for (int r = 0; r < R; ++r) {
      // a fixed pairwise reduction of the 8 lanes
      __m128 lo = _mm256_castps256_ps128(acc[i][r]), hi = _mm256_extractf128_ps(acc[i][r], 1);
      __m128 s4 = _mm_add_ps(lo, hi);
      __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      float s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
      for (int64_t cc = c; cc < C; ++cc) s = __builtin_fmaf(x[(m0 + r) * C + cc], w[(v0 + i) * C + cc], s);
      y[(m0 + r) * V + v0 + i] = s;
    }
}

torch::Tensor dot_rows(torch::Tensor x, torch::Tensor w, bool avx512) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dot_rows: expected x [M, C], w [V, C]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "dot_rows: float32 tensors only");
  TORCH_CHECK(w.is_contiguous(), "dot_rows: w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), C = x.size(1), V = w.size(0);
  auto y = torch::empty({M, V}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (V + VB - 1) / VB;
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t v0 = blk * VB, nv = std::min<int64_t>(VB, V - v0);
      if (avx512)
        for_rows(M,
                 [&](int64_t m0) { dot_block_avx512<1>(xp, wp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { dot_block_avx512<2>(xp, wp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { dot_block_avx512<3>(xp, wp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { dot_block_avx512<4>(xp, wp, yp, C, V, m0, v0, nv); });
      else
        for_rows(M,
                 [&](int64_t m0) { dot_block_avx2<1>(xp, wp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { dot_block_avx2<2>(xp, wp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { dot_block_avx2<3>(xp, wp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { dot_block_avx2<4>(xp, wp, yp, C, V, m0, v0, nv); });
    }
  });
  return y;
}

// ---- int8_rows: weight-only int8 projections ------------------------------------------------------------------
//
// y[M, N] = (x[M, K] @ q[K, N]) * s[N] + b[N]: q int8 in the Conv1D (in, out) layout, one scale per output column.
// Decode reads every weight once per token, so int8 weights move a quarter of float32's bytes; each is widened in
// registers (sign-extend, convert) right before its multiply-add, and the column's scale is applied once, after the
// whole chain. Same traversal and order as conv1d_rows, so it is row-count-invariant too.

template <int R>
__attribute__((target("avx512f,fma"))) inline void int8_tile_avx512(const float* x, const int8_t* q, float* y,
                                                                    int64_t K, int64_t N, int64_t m0, int64_t n,
                                                                    int64_t k0, int64_t kn) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(y + (m0 + r) * N + n + 16 * j);
  for (int64_t k = k0; k < k0 + kn; ++k) {
    const int8_t* qk = q + k * N + n;
    __m512 w[4];
    for (int j = 0; j < 4; ++j)
      w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qk + 16 * j))));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + r) * K + k]);
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_fmadd_ps(xv, w[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + (m0 + r) * N + n + 16 * j, a[r][j]);
}

template <int R>
__attribute__((target("avx2,fma"))) inline void int8_half_avx2(const float* x, const int8_t* q, float* y, int64_t K,
                                                               int64_t N, int64_t m0, int64_t n, int64_t k0,
                                                               int64_t kn) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_loadu_ps(y + (m0 + r) * N + n + 8 * j);
  for (int64_t k = k0; k < k0 + kn; ++k) {
    const int8_t* qk = q + k * N + n;
    __m256 w[4];
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qk + 8 * j))));
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[(m0 + r) * K + k]);
      for (int j = 0; j < 4; ++j) a[r][j] = _mm256_fmadd_ps(xv, w[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + (m0 + r) * N + n + 8 * j, a[r][j]);
}

torch::Tensor int8_rows(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor b, bool avx512) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && s.dim() == 1 && b.dim() == 1,
              "int8_rows: expected x [M, K], q [K, N], s [N], b [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat, "int8_rows: expected float32 x, s, b and int8 q");
  TORCH_CHECK(x.size(1) == q.size(0) && q.size(1) == s.size(0) && s.size(0) == b.size(0), "int8_rows: shapes do not chain");
  TORCH_CHECK(q.is_contiguous() && s.is_contiguous() && b.is_contiguous(), "int8_rows: q, s and b must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(1);
  auto y = torch::zeros({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>(), *bp = b.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = N / 64;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t kn = std::min<int64_t>(KB, K - k0);
      for (int64_t n = begin * 64; n < end * 64; n += avx512 ? 64 : 32) {
        if (avx512)
          for_rows(M, [&](int64_t m0) { int8_tile_avx512<1>(xp, qp, yp, K, N, m0, n, k0, kn); },
                   [&](int64_t m0) { int8_tile_avx512<2>(xp, qp, yp, K, N, m0, n, k0, kn); },
                   [&](int64_t m0) { int8_tile_avx512<3>(xp, qp, yp, K, N, m0, n, k0, kn); },
                   [&](int64_t m0) { int8_tile_avx512<4>(xp, qp, yp, K, N, m0, n, k0, kn); });
        else {
          int64_t m0 = 0;
          for (; m0 + 2 <= M; m0 += 2) int8_half_avx2<2>(xp, qp, yp, K, N, m0, n, k0, kn);
          if (m0 < M) int8_half_avx2<1>(xp, qp, yp, K, N, m0, n, k0, kn);
        }
      }
    }
    for (int64_t m = 0; m < M; ++m)  // the scale after the whole chain, then the bias
      for (int64_t n = begin * 64; n < end * 64; ++n) yp[m * N + n] = yp[m * N + n] * sp[n] + bp[n];
  });
  for (int64_t m = 0; m < M; ++m)  // columns past the last whole tile: the same chain in scalar code
    for (int64_t n = tiles * 64; n < N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = __builtin_fmaf(xp[m * K + k], static_cast<float>(qp[k * N + n]), acc);
      yp[m * N + n] = acc * sp[n] + bp[n];
    }
  return y;
}

// ---- int8_dot_rows: the int8 head (V, C), one scale per vocabulary row ----------------------------------------

template <int R>
__attribute__((target("avx512f,fma"))) void int8_dot_block_avx512(const float* x, const int8_t* q, const float* s,
                                                                 float* y, int64_t C, int64_t V, int64_t m0,
                                                                 int64_t v0, int64_t nv) {
  __m512 acc[VB][R];
  for (int i = 0; i < VB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    __m512 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = _mm512_loadu_ps(x + (m0 + r) * C + c);
    for (int i = 0; i < nv; ++i) {
      __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (v0 + i) * C + c))));
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(xs[r], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < nv; ++i)
    for (int r = 0; r < R; ++r) {
      float t = _mm512_reduce_add_ps(acc[i][r]);
      for (int64_t cc = c; cc < C; ++cc) t = __builtin_fmaf(x[(m0 + r) * C + cc], static_cast<float>(q[(v0 + i) * C + cc]), t);
      y[(m0 + r) * V + v0 + i] = t * s[v0 + i];
    }
}

template <int R>
__attribute__((target("avx2,fma"))) void int8_dot_block_avx2(const float* x, const int8_t* q, const float* s, float* y,
                                                            int64_t C, int64_t V, int64_t m0, int64_t v0, int64_t nv) {
  __m256 acc[VB][R];
  for (int i = 0; i < VB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= C; c += 8) {
    __m256 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_ps(x + (m0 + r) * C + c);
    for (int i = 0; i < nv; ++i) {
      __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (v0 + i) * C + c))));
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(xs[r], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < nv; ++i)
    for (int r = 0; r < R; ++r) {
      __m128 lo = _mm256_castps256_ps128(acc[i][r]), hi = _mm256_extractf128_ps(acc[i][r], 1);
      __m128 s4 = _mm_add_ps(lo, hi);
      __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      float t = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
      for (int64_t cc = c; cc < C; ++cc) t = __builtin_fmaf(x[(m0 + r) * C + cc], static_cast<float>(q[(v0 + i) * C + cc]), t);
      y[(m0 + r) * V + v0 + i] = t * s[v0 + i];
    }
}

torch::Tensor int8_dot_rows(torch::Tensor x, torch::Tensor q, torch::Tensor s, bool avx512) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && s.dim() == 1 && x.size(1) == q.size(1) && q.size(0) == s.size(0),
              "int8_dot_rows: expected x [M, C], q [V, C], s [V]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat,
              "int8_dot_rows: expected float32 x and s, int8 q");
  TORCH_CHECK(q.is_contiguous() && s.is_contiguous(), "int8_dot_rows: q and s must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), C = x.size(1), V = q.size(0);
  auto y = torch::empty({M, V}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (V + VB - 1) / VB;
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t v0 = blk * VB, nv = std::min<int64_t>(VB, V - v0);
      if (avx512)
        for_rows(M, [&](int64_t m0) { int8_dot_block_avx512<1>(xp, qp, sp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { int8_dot_block_avx512<2>(xp, qp, sp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { int8_dot_block_avx512<3>(xp, qp, sp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { int8_dot_block_avx512<4>(xp, qp, sp, yp, C, V, m0, v0, nv); });
      else
        for_rows(M, [&](int64_t m0) { int8_dot_block_avx2<1>(xp, qp, sp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { int8_dot_block_avx2<2>(xp, qp, sp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { int8_dot_block_avx2<3>(xp, qp, sp, yp, C, V, m0, v0, nv); },
                 [&](int64_t m0) { int8_dot_block_avx2<4>(xp, qp, sp, yp, C, V, m0, v0, nv); });
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("conv1d_rows", &conv1d_rows, "y = x @ w + b with a row-count-independent reduction order");
  m.def("dot_rows", &dot_rows, "y = x @ w^T with a row-count-independent reduction order");
  m.def("int8_rows", &int8_rows, "y = (x @ q) * s + b for int8 q, row-count-independent");
  m.def("int8_dot_rows", &int8_dot_rows, "y = (x @ q^T) * s for an int8 head q (V, C), row-count-independent");
}
