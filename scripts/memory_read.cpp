// The memory ceiling the decode kernels are measured against (scripts/bench_memory.py): the sustained rate at which
// T threads read a buffer far larger than the last-level cache, as the kernels read weights: each thread streams its
// own contiguous part once per pass with vector loads of one width (32 bytes: AVX2, 64: AVX-512), optionally asking
// `ahead` bytes ahead with prefetcht0 (what the decode kernels do) or loading with vmovntdqa (the non-temporal hint).
// The loads feed eight independent adds, so the core never waits on its own arithmetic: only on memory.
#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>

namespace {

template <bool NT>
__attribute__((target("avx2"))) inline __m256 load8(const float* p) {
  if constexpr (NT)
    return _mm256_castsi256_ps(_mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p)));
  else
    return _mm256_load_ps(p);
}

template <bool NT>
__attribute__((target("avx2"))) float sum_avx2(const float* p, int64_t n, int64_t ahead) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 64) {  // 256 bytes a step: four cache lines
    if (ahead) {
      const char* q = reinterpret_cast<const char*>(p + i) + ahead;
      for (int l = 0; l < 4; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T0);
    }
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_add_ps(acc[j], load8<NT>(p + i + 8 * j));
  }
  for (int j = 1; j < 8; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  alignas(32) float out[8];
  _mm256_store_ps(out, acc[0]);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

template <bool NT>
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) {
  if constexpr (NT)
    return _mm512_castsi512_ps(_mm512_stream_load_si512(const_cast<void*>(reinterpret_cast<const void*>(p))));
  else
    return _mm512_load_ps(p);
}

template <bool NT>
__attribute__((target("avx512f"))) float sum_avx512(const float* p, int64_t n, int64_t ahead) {
  __m512 acc[8];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 128) {  // 512 bytes a step: eight cache lines
    if (ahead) {
      const char* q = reinterpret_cast<const char*>(p + i) + ahead;
      for (int l = 0; l < 8; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T0);
    }
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_add_ps(acc[j], load16<NT>(p + i + 16 * j));
  }
  for (int j = 1; j < 8; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  return _mm512_reduce_add_ps(acc[0]);
}

float sum_part(const float* p, int64_t n, int width, int64_t ahead, bool nt) {
  if (width == 64) return nt ? sum_avx512<true>(p, n, ahead) : sum_avx512<false>(p, n, ahead);
  return nt ? sum_avx2<true>(p, n, ahead) : sum_avx2<false>(p, n, ahead);
}

}  // namespace

// The best of `passes` timed passes over buf (float32, 64-byte aligned, a multiple of 128 elements per thread):
// (GB/s, the sum, so that the loads cannot be dropped).
std::tuple<double, double> read_rate(torch::Tensor buf, int64_t width, int64_t ahead, bool nt, int64_t threads,
                                     int64_t passes) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == torch::kFloat32, "read_rate: a contiguous float32 buffer");
  TORCH_CHECK(width == 32 || width == 64, "read_rate: width 32 or 64 bytes");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buf.data_ptr<float>()) % 64 == 0, "read_rate: a 64-byte aligned buffer");
  const float* p = buf.data_ptr<float>();
  const int64_t per = buf.numel() / threads / 128 * 128;  // each thread's part, whole steps of either width
  double best = 0.0, total = 0.0;
  for (int64_t r = 0; r < passes; ++r) {
    double sums[256] = {0};
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      sums[t] = sum_part(p + t * per, per, static_cast<int>(width), ahead, nt);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (int64_t t = 0; t < threads; ++t) total += sums[t];
    best = std::max(best, static_cast<double>(per * threads) * sizeof(float) / s / 1e9);
  }
  return {best, total};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("read_rate", &read_rate); }
