// One decode step of causal self-attention for many sequences at once, each in its own KV-cache slot:
//
//   out[r, h] = softmax(q[r, h] . k[slot_r, h, j] / sqrt(hs), j < S_r) @ v[slot_r, h, :S_r]
//
// Why: with torch ops, a step of R sequences at different lengths is a Python loop of ~15 small ops per sequence
// and layer (their caches cannot share one batched matmul without padding, and padding changes the reduction
// order, so a sequence's logits would depend on its neighbours). Here each (row, head) is one pass over its own
// keys and values in a fixed order: the result is the same bits however many rows share the call.
// The scores of a row are kept in a small buffer, and exponentiated 8 at a time (exp8): the C library's exp, one at a
// time, was a quarter of a layer's attention at 1,000 positions.
//
// And a prompt's causal self-attention (prefill_attention), T queries at the last T of S positions:
//
//   out[b, t, h] = softmax(q[b, h, t] . k[b, h, j] / sqrt(hs), j <= S - T + t) @ v[b, h, :S - T + t + 1]
//
// Why: torch's fused CPU kernel (online softmax over blocks of keys) ran a 512-token prompt's attention at a third
// of the machine's multiply-add rate. Here each (sequence, head) first lays its keys out in blocks of 16 positions
// x hs (one contiguous stream per block), then takes its queries 16 at a time: scores for 16 queries x 16 keys
// are 16 accumulators fed by one key load and 16 broadcasts per dimension, kept in a buffer of 16 rows up to the
// last query's position; a softmax per row (exp8); then the weighted sum of values, 4 queries x 64 lanes of
// accumulators per value row. Every element is one chain in a fixed order (scores over d, outputs over j), and
// the output is written with the heads merged ([B, T, nh * hs], what the next projection reads). hs = 64 (every
// GPT-2 size), AVX-512; elsewhere the caller keeps torch's kernel.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

__attribute__((target("avx2,fma"))) __m256 exp8(__m256 v);  // below
__attribute__((target("avx2,fma"))) float sum8(__m256 v);  // below

namespace {

// dot(a, b) over hs floats: 16-lane (AVX-512) or 8-lane (AVX2) partial sums, then a fixed reduction.
__attribute__((target("avx512f,fma"))) float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float t = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) t = __builtin_fmaf(a[i], b[i], t);
  return t;
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  float t = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  for (; i < n; ++i) t = __builtin_fmaf(a[i], b[i], t);
  return t;
}

// out[0:n] = sum_j p[j] * v[j, 0:n] over j = 0..S-1 in order, lane by lane (the same bits on both paths). All of a
// row's lanes advance together, up to MAXV vectors (a head of 128 floats): independent multiply-add chains, so the
// loop is bound by throughput rather than by one chain's latency.
constexpr int MAXV = 8;

__attribute__((target("avx512f,fma"))) void weighted_avx512(const float* p, const float* v, float* out, int64_t S,
                                                            int64_t n) {
  for (int64_t d0 = 0; d0 < n; d0 += 16 * MAXV) {
    const int nv = static_cast<int>(std::min<int64_t>(MAXV, (n - d0 + 15) / 16));
    __mmask16 m[MAXV];
    __m512 acc[MAXV];
    for (int i = 0; i < nv; ++i) {
      const int64_t left = n - d0 - 16 * i;
      m[i] = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
      acc[i] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < S; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j]);
      for (int i = 0; i < nv; ++i)
        acc[i] = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[i], v + j * n + d0 + 16 * i), acc[i]);
    }
    for (int i = 0; i < nv; ++i) _mm512_mask_storeu_ps(out + d0 + 16 * i, m[i], acc[i]);
  }
}

__attribute__((target("avx2,fma"))) void weighted_avx2(const float* p, const float* v, float* out, int64_t S, int64_t n) {
  const int64_t whole = n / 8 * 8;
  for (int64_t d0 = 0; d0 < whole; d0 += 8 * MAXV) {
    const int nv = static_cast<int>(std::min<int64_t>(MAXV, (whole - d0) / 8));
    __m256 acc[MAXV];
    for (int i = 0; i < nv; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < S; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int i = 0; i < nv; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * n + d0 + 8 * i), acc[i]);
    }
    for (int i = 0; i < nv; ++i) _mm256_storeu_ps(out + d0 + 8 * i, acc[i]);
  }
  for (int64_t d = whole; d < n; ++d) {
    float acc = 0.f;
    for (int64_t j = 0; j < S; ++j) acc = __builtin_fmaf(p[j], v[j * n + d], acc);
    out[d] = acc;
  }
}

// p[j] = exp(p[j] - m) for j < n (m = max p, so every argument is <= 0; below -87 it is clamped, where exp is under
// 1.7e-38 anyway); returns their sum, accumulated in 8 lanes in j order, then pairwise, then the tail in order.
__attribute__((target("avx2,fma"))) float exp_shifted(float* p, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_max_ps(lo, _mm256_sub_ps(_mm256_loadu_ps(p + j), mv)));
    _mm256_storeu_ps(p + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = sum8(acc);
  if (j < n) {  // the tail through the same exp, padded
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = j + i < n ? p[j + i] : m;
    _mm256_store_ps(tail, exp8(_mm256_max_ps(lo, _mm256_sub_ps(_mm256_load_ps(tail), mv))));
    for (int64_t i = 0; j + i < n; ++i) sum += (p[j + i] = tail[i]);
  }
  return sum;
}


constexpr int QB = 16;  // queries per block, and keys per block of the laid-out keys
constexpr int HS = 64;  // head size this kernel is written for: 4 vectors of 16 lanes

// The scores of queries qb [QB, HS] against key blocks [0, blocks): kb holds block c's keys as [c][d][16].
// sc[r * ld + j] = (q_r . k_j) * scale.
__attribute__((target("avx512f,fma"))) void block_scores(const float* qb, const float* kb, int64_t blocks,
                                                         float scale, float* sc, int64_t ld) {
  for (int64_t c = 0; c < blocks; ++c) {
    const float* kc = kb + c * HS * QB;
    __m512 acc[QB];
    for (int r = 0; r < QB; ++r) acc[r] = _mm512_setzero_ps();
    for (int d = 0; d < HS; ++d) {
      const __m512 kv = _mm512_loadu_ps(kc + d * QB);
      for (int r = 0; r < QB; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qb[r * HS + d]), kv, acc[r]);
    }
    for (int r = 0; r < QB; ++r) _mm512_storeu_ps(sc + r * ld + c * QB, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
  }
}

// p[0:n] = softmax(p[0:n]), and zero in [n, end): the max and the division 16 lanes at a time (exact either way),
// the exponentials through exp_shifted.
__attribute__((target("avx512f,fma"))) void softmax_row(float* p, int64_t n, int64_t end) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + j));
  float m = _mm512_reduce_max_ps(mv);
  for (; j < n; ++j) m = std::max(m, p[j]);
  const float sum = exp_shifted(p, n, m);
  const __m512 sv = _mm512_set1_ps(sum);
  for (j = 0; j + 16 <= n; j += 16) _mm512_storeu_ps(p + j, _mm512_div_ps(_mm512_loadu_ps(p + j), sv));
  for (; j < n; ++j) p[j] /= sum;
  std::fill(p + n, p + end, 0.f);
}

// out_r[0:64] = sum_j p_r[j] v[j] over j < n for 4 rows of weights (rows of p `ld` apart, zero past each row's own
// keys), 4 x 4 accumulators; out rows `os` floats apart.
__attribute__((target("avx512f,fma"))) void block_values(const float* p, int64_t ld, const float* v, int64_t vs,
                                                         int64_t n, int rows, float* out, int64_t os) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vj[4];
    for (int i = 0; i < 4; ++i) vj[i] = _mm512_loadu_ps(v + j * vs + 16 * i);
    for (int r = 0; r < 4; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * ld + j]);
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(pj, vj[i], acc[r][i]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + r * os + 16 * i, acc[r][i]);
}

}  // namespace

// The sum of 8 lanes in a fixed pairwise order, the same on every machine these kernels run on (block.cpp uses it
// too).
__attribute__((target("avx2,fma"))) float sum8(__m256 v) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// exp(v) for v in [-87, 88] (callers clamp), 8 lanes at a time; the softmaxes here and in block.cpp (GELU, the
// logsumexp of a row of logits) use it: v = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial
// (about 1 ulp), times 2^n built in the exponent bits.
__attribute__((target("avx2,fma"))) __m256 exp8(__m256 v) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Rows r < R: q, k, v at q + r ld (and k + r ld, v + r ld), [nh, hs] each, row r's new token; the caches
// [n_slots, nh, L, hs] at kp, vp; slot, start [R]. Row r's key and value are written at position start[r] of slot
// slot[r], then it attends to positions [0, start[r]] of that slot; its output goes to out + r nh hs ([nh, hs]).
// block.cpp calls this on its own buffers (q, k and v side by side in one row of c_attn's output).
void decode_attention_into(const float* q, const float* k, const float* v, int64_t ld, int64_t R, int64_t nh,
                           int64_t hs, float* kp, float* vp, int64_t n_slots, int64_t L, const int64_t* slot,
                           const int64_t* start, bool avx512, float* op) {
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(0 <= slot[r] && slot[r] < n_slots && 0 <= start[r] && start[r] < L,
                "decode_attention: a slot or position is out of range");
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t at = ((slot[r] * nh + h) * L + start[r]) * hs;
      std::copy_n(k + r * ld + h * hs, hs, kp + at);
      std::copy_n(v + r * ld + h * hs, hs, vp + at);
    }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  at::parallel_for(0, R * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(L);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nh, h = i % nh, S = start[r] + 1;
      const float* keys = kp + ((slot[r] * nh + h) * L) * hs;
      const float* values = vp + ((slot[r] * nh + h) * L) * hs;
      const float* qi = q + r * ld + h * hs;
      float m = -INFINITY;
      for (int64_t j = 0; j < S; ++j) {
        p[j] = (avx512 ? dot_avx512(qi, keys + j * hs, hs) : dot_avx2(qi, keys + j * hs, hs)) * scale;
        m = std::max(m, p[j]);
      }
      const float sum = exp_shifted(p.data(), S, m);
      for (int64_t j = 0; j < S; ++j) p[j] /= sum;
      if (avx512)
        weighted_avx512(p.data(), values, op + i * hs, S, hs);
      else
        weighted_avx2(p.data(), values, op + i * hs, S, hs);
    }
  });
}

// The same on tensors: q, k, v [R, nh, hs]; k_cache, v_cache [slots, nh, L, hs]; slots, starts [R] int64. Returns
// [R, nh, hs].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                               torch::Tensor v_cache, torch::Tensor slots, torch::Tensor starts, bool avx512) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "decode_attention: float32 q and caches only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && q.size(1) == k_cache.size(1) &&
                  q.size(2) == k_cache.size(3), "decode_attention: expected q [R, nh, hs] and caches [slots, nh, L, hs]");
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "decode_attention: k and v must be float32 like q [R, nh, hs]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && slots.numel() == q.size(0) &&
                  starts.numel() == q.size(0), "decode_attention: slots and starts must be int64 [R]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous();
  const int64_t R = q.size(0), nh = q.size(1), hs = q.size(2);
  auto out = torch::empty({R, nh, hs}, q.options());
  decode_attention_into(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), nh * hs, R, nh, hs,
                        k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(0), k_cache.size(2),
                        slots.contiguous().data_ptr<int64_t>(), starts.contiguous().data_ptr<int64_t>(), avx512,
                        out.data_ptr<float>());
  return out;
}

// q [B, nh, T, hs], k and v [B, nh, S, hs] (S >= T; any strides, hs contiguous): the T queries are the last T of
// the S positions, each attending causally. Returns [B, T, nh, hs] (contiguous: the heads merged by a view).
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prefill_attention: float32 q, k and v only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(1) == k.size(1) && q.size(3) == HS && k.size(3) == HS && k.size(2) >= q.size(2),
              "prefill_attention: expected q [B, nh, T, 64], k and v [B, nh, S, 64] with S >= T");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "prefill_attention: hs must be contiguous");
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), S = k.size(2), offset = S - T;
  const int64_t blocks_max = (S + QB - 1) / QB, ld = blocks_max * QB;
  auto out = torch::empty({B, T, nh, HS}, q.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kb(blocks_max * HS * QB), sc(QB * ld), qb(QB * HS);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / nh, h = i % nh;
      const float* qh = qp + b * q.stride(0) + h * q.stride(1);
      const float* kh = kp + b * k.stride(0) + h * k.stride(1);
      const float* vh = vp + b * v.stride(0) + h * v.stride(1);
      // keys as [block][d][16], zero past S (their scores are never read)
      std::fill(kb.begin() + (S / QB) * HS * QB, kb.end(), 0.f);
      for (int64_t j = 0; j < S; ++j)
        for (int d = 0; d < HS; ++d) kb[(j / QB) * HS * QB + d * QB + j % QB] = kh[j * k.stride(2) + d];
      for (int64_t t0 = 0; t0 < T; t0 += QB) {
        const int rows = static_cast<int>(std::min<int64_t>(QB, T - t0));
        for (int r = 0; r < QB; ++r)  // rows past T repeat the last one (computed, never stored)
          std::copy_n(qh + std::min<int64_t>(t0 + r, T - 1) * q.stride(2), HS, qb.data() + r * HS);
        const int64_t keys = offset + t0 + rows;  // the last row's keys: positions [0, keys)
        block_scores(qb.data(), kb.data(), (keys + QB - 1) / QB, scale, sc.data(), ld);
        for (int r = 0; r < rows; ++r)  // each row over its own keys
          softmax_row(sc.data() + r * ld, offset + t0 + r + 1, keys);
        for (int r0 = 0; r0 < rows; r0 += 4) {
          const int group = std::min(4, rows - r0);
          block_values(sc.data() + r0 * ld, ld, vh, v.stride(2), offset + t0 + r0 + group, group,
                       op + ((b * T + t0 + r0) * nh + h) * HS, nh * HS);
        }
      }
    }
  });
  return out;
}
