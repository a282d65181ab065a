// One decode step of causal self-attention for many sequences at once, each in its own KV-cache slot:
//
//   out[r, h] = softmax(q[r, h] . k[slot_r, h, j] / sqrt(hs), j < S_r) @ v[slot_r, h, :S_r]
//
// Why: with torch ops, a step of R sequences at different lengths is a Python loop of ~15 small ops per sequence
// and layer (their caches cannot share one batched matmul without padding, and padding changes the reduction
// order, so a sequence's logits would depend on its neighbours). Here each (row, head) is one pass over its own
// keys and values in a fixed order: the result is the same bits however many rows share the call.
// The scores of a row are kept in a small buffer, and exponentiated 8 at a time (exp8): the C library's exp, one at a
// time, was a quarter of a layer's attention at 1,000 positions (78 us; 60 us with exp8, Zen 4, 2 threads).
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

// q, k, v [R, nh, hs]: each row's new token; k_cache, v_cache [slots, nh, L, hs]; slots, starts [R] int64. Row r's
// key and value are written at position starts[r] of slot slots[r], then it attends to positions [0, starts[r]]
// of that slot. Returns [R, nh, hs].
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
  const int64_t R = q.size(0), nh = q.size(1), hs = q.size(2), n_slots = k_cache.size(0), L = k_cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(0 <= slot[r] && slot[r] < n_slots && 0 <= start[r] && start[r] < L,
                "decode_attention: a slot or position is out of range");
  float *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t at = ((slot[r] * nh + h) * L + start[r]) * hs;
      std::copy_n(k.data_ptr<float>() + (r * nh + h) * hs, hs, kp + at);
      std::copy_n(v.data_ptr<float>() + (r * nh + h) * hs, hs, vp + at);
    }
  auto out = torch::empty({R, nh, hs}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  at::parallel_for(0, R * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(L);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nh, h = i % nh, S = start[r] + 1;
      const float* keys = kp + ((slot[r] * nh + h) * L) * hs;
      const float* values = vp + ((slot[r] * nh + h) * L) * hs;
      const float* qi = qp + i * hs;
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
  return out;
}
