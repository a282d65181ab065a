// Decode-sized matmuls against blockwise-quantized weights, in llama.cpp's q8_0 / q4_0 manner: the weights are 8, 6 or
// 4 bits with one scale per group of 32 along the input dimension, and each row of activations is quantized to int8
// per group of 32 as well, so that a group's products are integer dot products (VNNI where the CPU has it).
//
//   packed_rows: y[M, N] = x[M, K] @ W[K, N] + b[N],   W[k, n] = (u[k, n] - zero) * scale[k / 32, n]
//
// Why this shape: decoding reads every weight once per token, so the weight's bytes set the speed. Widening int8 or
// int4 to float32 before a float multiply-add costs more instructions than the memory it saves; integer dot products
// (vpdpbusd: 64 byte products per instruction) do not. The weights are repacked at load time into panels of 16
// output columns, each panel one contiguous stream (the prefetchers' best case):
//   8 bits: panel p, quad j, column c, byte i = u[4j + i, 16p + c]                          (u = w + 128)
//   4 bits: panel p, octet j, column c, byte i = u[8j + i, 16p + c] | u[8j + 4 + i, 16p + c] << 4   (u = w + 8)
//   6 bits (u = w + 32; the int4 models' head): per group of 32 inputs, the 4 bits' 4 octets of the low nibbles of
//           u (256 bytes), then 4 planes of 32 bytes with their top 2 bits: plane j, byte 4c + i holds those of
//           inputs 8j + i and 8j + 4 + i of columns c (bits 0-1, 4-5) and c + 8 (bits 2-3, 6-7), c < 8
// so one 32-bit lane holds 4 consecutive inputs of one column: exactly what vpdpbusd multiplies by 4 broadcast
// activation bytes. A plane broadcast to both halves of a 512-bit register lines each top field up with its nibble's
// byte, so masks alone (no shifts) split it into dot products of their own, scaled back per lane once per group.
// Scales are float16 [panels, K / 32, 16]. With a few rows the kernel is bound by the dot products, not the memory:
// the AVX-512 body works on MR rows x NP panels at once, so each weight load feeds MR rows and each activation
// broadcast NP panels (8 rows: 15.5 -> 12.6 ms a step of GPT-2 small's int8 matmuls).
// From MR rows up, 6-bit panels are first widened into the 8-bit layout (u + 96 = w + 128) and run through the 8-bit
// body: the widening is paid once for all the rows instead of a mask per row.
//
// Exactness: within a group the products are summed in int32, which is exact, so the AVX-512 VNNI body, the AVX2 body
// (maddubs; no VNNI there), the widened 6 bits and any row count give the same integer. Across groups each lane
// accumulates acc = fma(float(isum_g), xscale_g * wscale_g, acc) for g = 0, 1, ... in order, then adds the bias: the
// same float operations in the same order on every path, so the results are identical bits whatever the CPU path or the
// number of rows (batch invariance). The torch reference (core/projection.py) does the same arithmetic.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int G = 32;    // inputs per scale group (weights and activations)
constexpr int P = 16;    // output columns per panel
constexpr int MR = 4;    // rows sharing each load of the weights
constexpr int NP = 2;    // panels sharing each broadcast of the activations: 16 accumulators at MR rows
// How far ahead (bytes) of a panel's stream each body asks for lines into L2. At one row the loop has little
// work per byte, and the hardware prefetchers alone left the two threads reading well below the machine's bandwidth.
constexpr int64_t PREFETCH = 8192;
// The 6-bit body does twice the dot products per byte of the 4- and 8-bit ones, so it falls further behind its stream
// between requests: it asks further ahead.
constexpr int64_t PREFETCH_6 = 12288;

// Activations of one call, quantized per row and group: q = round(x / s), s = max |x| / 127 (s = 0 for a zero group).
struct QuantX {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, K / G]
  std::vector<int32_t> sum;   // [M, K / G]: sum of q, for the weights' zero point
};

// One group of 32: scale = max |x| / 127, q = round(x / scale) (half to even, as torch.round; x / s, not x * (1 / s),
// so that projection.quantize_activations gives the same integers). AVX2, which every machine with these kernels has.
__attribute__((target("avx2,fma"))) void quantize_group(const float* x, int8_t* q, float* scale, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[G / 8], amax = _mm256_setzero_ps();
  for (int i = 0; i < G / 8; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float s = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1))) / 127.f;
  *scale = s;
  if (s == 0.f) {  // a group of zeros (NaN cannot reach here: the weights and the residual stream are finite)
    std::memset(q, 0, G);
    *sum = 0;
    return;
  }
  const __m256 d = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i total = _mm256_setzero_si256();
  alignas(32) int32_t ints[G];
  for (int i = 0; i < G / 8; ++i) {
    // cvtps rounds with the current mode: round to nearest, ties to even
    const __m256i r = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(v[i], d))));
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * i), r);
    total = _mm256_add_epi32(total, r);
  }
  for (int i = 0; i < G; ++i) q[i] = static_cast<int8_t>(ints[i]);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  *sum = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}

QuantX quantize_x(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / G;
  QuantX out{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<int32_t>(M * groups)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g)
      quantize_group(x + m * K + g * G, out.q.data() + m * K + g * G, out.scale.data() + m * groups + g,
                     out.sum.data() + m * groups + g);
  return out;
}

inline int32_t four(const int8_t* p) {  // 4 activation bytes as one lane's worth, for a broadcast
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- AVX-512 VNNI: one panel (16 columns) for rows [m0, m0 + R) ----------------------------------------------------

template <int R, int NP, int BITS>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma"))) void panel_vnni(
    const QuantX& xq, const uint8_t* w, const uint16_t* ws, const float* b, float* y, int64_t K, int64_t N,
    int64_t m0, int64_t n0) {
  // NP neighbouring panels at once, so that each broadcast of 4 activation bytes feeds NP dot products
  const int64_t groups = K / G, panel_bytes = K * P * BITS / 8, panel_scales = groups * P;
  constexpr int zero = BITS == 8 ? 128 : BITS == 6 ? 32 : 8;
  constexpr int64_t ahead = BITS == 6 ? PREFETCH_6 : PREFETCH;
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int64_t g = 0; g < groups; ++g) {
    if (m0 == 0)  // the first rows' pass fetches each panel `ahead` bytes ahead into L2 (see PREFETCH)
      for (int p = 0; p < NP; ++p)
        for (int64_t l = 0; l < G * P * BITS / 8; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + p * panel_bytes + g * G * P * BITS / 8 + ahead + l),
                       _MM_HINT_T1);
    __m512i isum[R][NP];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) isum[r][p] = _mm512_setzero_si512();
    const int8_t* xg[R];
    for (int r = 0; r < R; ++r) xg[r] = xq.q.data() + (m0 + r) * K + g * G;
    if constexpr (BITS == 8) {
      for (int j = 0; j < G / 4; ++j) {  // 8 quads of inputs, 64 bytes each
        __m512i u[NP];
        for (int p = 0; p < NP; ++p) u[p] = _mm512_loadu_si512(w + p * panel_bytes + (g * (G / 4) + j) * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i xb = _mm512_set1_epi32(four(xg[r] + 4 * j));
          for (int p = 0; p < NP; ++p) isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], u[p], xb);
        }
      }
    } else if constexpr (BITS == 4) {
      // The high nibbles are multiplied in place (16 u, masked, not shifted) into sums of their own: one
      // instruction fewer per 64 bytes, and two independent chains of dot products instead of one, which at one
      // row is what bounds the loop (each vpdpbusd waits for the previous one's result). 16 sum(u x) is exact in
      // int32 (|16 * 15 * 127 * 32| < 2^31), so the shift back gives the same integer.
      __m512i isum_hi[R][NP];
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < NP; ++p) isum_hi[r][p] = _mm512_setzero_si512();
      for (int j = 0; j < G / 8; ++j) {  // 4 octets: low nibbles hold inputs 0-3, high nibbles 4-7
        __m512i lo[NP], hi[NP];
        for (int p = 0; p < NP; ++p) {
          const __m512i u = _mm512_loadu_si512(w + p * panel_bytes + (g * (G / 8) + j) * 64);
          lo[p] = _mm512_and_si512(u, low), hi[p] = _mm512_and_si512(u, high);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x0 = _mm512_set1_epi32(four(xg[r] + 8 * j)), x1 = _mm512_set1_epi32(four(xg[r] + 8 * j + 4));
          for (int p = 0; p < NP; ++p) {
            isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], lo[p], x0);
            isum_hi[r][p] = _mm512_dpbusd_epi32(isum_hi[r][p], hi[p], x1);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < NP; ++p) isum[r][p] = _mm512_add_epi32(isum[r][p], _mm512_srai_epi32(isum_hi[r][p], 4));
    } else {
      // 6 bits: u = nibble + 16 top. Four chains: the low and high nibbles as in 4 bits, and the top fields of
      // each, masked in place from the broadcast plane: the low inputs' top sits at bits 0-1 in lanes 0-7 (x1) and
      // 2-3 in lanes 8-15 (x4), the high inputs' at 4-5 (x16) and 6-7 (x64). Per group, shifts by lane take each
      // chain to 16 sum(top x), exactly (|64 * 3 * 127 * 16| < 2^31).
      const __m512i top_lo = _mm512_inserti64x4(_mm512_set1_epi8(0x03), _mm256_set1_epi8(0x0C), 1);
      const __m512i top_hi = _mm512_inserti64x4(_mm512_set1_epi8(0x30), _mm256_set1_epi8(static_cast<char>(0xC0)), 1);
      __m512i isum_hi[R][NP], tsum_lo[R][NP], tsum_hi[R][NP];
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < NP; ++p)
          isum_hi[r][p] = tsum_lo[r][p] = tsum_hi[r][p] = _mm512_setzero_si512();
      for (int j = 0; j < G / 8; ++j) {
        __m512i lo[NP], hi[NP], tl[NP], th[NP];
        for (int p = 0; p < NP; ++p) {
          const uint8_t* grp = w + p * panel_bytes + g * (G * P * 6 / 8);
          const __m512i u = _mm512_loadu_si512(grp + 64 * j);
          const __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 256 + 32 * j)));
          lo[p] = _mm512_and_si512(u, low), hi[p] = _mm512_and_si512(u, high);
          tl[p] = _mm512_and_si512(t, top_lo), th[p] = _mm512_and_si512(t, top_hi);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x0 = _mm512_set1_epi32(four(xg[r] + 8 * j)), x1 = _mm512_set1_epi32(four(xg[r] + 8 * j + 4));
          for (int p = 0; p < NP; ++p) {
            isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], lo[p], x0);
            isum_hi[r][p] = _mm512_dpbusd_epi32(isum_hi[r][p], hi[p], x1);
            tsum_lo[r][p] = _mm512_dpbusd_epi32(tsum_lo[r][p], tl[p], x0);
            tsum_hi[r][p] = _mm512_dpbusd_epi32(tsum_hi[r][p], th[p], x1);
          }
        }
      }
      const __m512i up = _mm512_inserti64x4(_mm512_set1_epi32(4), _mm256_set1_epi32(2), 1);    // x1, x4 -> x16
      const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(2), 1);  // x16, x64 -> x16
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < NP; ++p) {
          const __m512i top = _mm512_add_epi32(_mm512_sllv_epi32(tsum_lo[r][p], up), _mm512_srav_epi32(tsum_hi[r][p], down));
          isum[r][p] = _mm512_add_epi32(_mm512_add_epi32(isum[r][p], _mm512_srai_epi32(isum_hi[r][p], 4)), top);
        }
    }
    for (int p = 0; p < NP; ++p) {
      const __m512 wscale =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + p * panel_scales + g * P)));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * groups + g;
        // sum (u - zero) x = sum u x - zero * sum x
        const __m512i exact = _mm512_sub_epi32(isum[r][p], _mm512_set1_epi32(zero * xq.sum[i]));
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(wscale, _mm512_set1_ps(xq.scale[i])),
                                    acc[r][p]);
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t c0 = n0 + p * P, n = std::min<int64_t>(P, N - c0);
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    const __m512 bias = b ? _mm512_maskz_loadu_ps(keep, b + c0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N + c0, keep, _mm512_add_ps(acc[r][p], bias));
  }
}

// Half h (columns 8h..8h+7) of a 6-bit octet: its nibble bytes u and the octet's plane t -> the u of its low inputs
// (8j + i) and of its high ones (8j + 4 + i), each < 64: the nibble with its top field moved to bits 4-5.
__attribute__((target("avx2"))) inline void six_bits(__m256i u, __m256i t, int h, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i tl = h == 0 ? _mm256_slli_epi16(t, 4) : _mm256_slli_epi16(t, 2);  // bits 0-1 or 2-3 -> 4-5
  const __m256i th = h == 0 ? t : _mm256_srli_epi16(t, 2);                        // bits 4-5 or 6-7 -> 4-5
  lo = _mm256_or_si256(_mm256_and_si256(u, low), _mm256_and_si256(tl, top));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u, 4), low), _mm256_and_si256(th, top));
}

// One panel of 6-bit weights in the 8-bit layout (u + 96 = w + 128): group g's octet j holds quads 2j (its low
// inputs) and 2j + 1 (its high ones), byte for byte in the same lanes.
__attribute__((target("avx2"))) void widen_panel(const uint8_t* src, uint8_t* dst, int64_t K) {
  const __m256i offset = _mm256_set1_epi8(96);
  for (int64_t g = 0; g < K / G; ++g, src += G * P * 6 / 8, dst += G * P) {
    for (int64_t l = 0; l < G * P * 6 / 8; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH + l), _MM_HINT_T1);
    for (int j = 0; j < G / 8; ++j) {
      const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 256 + 32 * j));
      for (int h = 0; h < 2; ++h) {
        __m256i lo, hi;
        six_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * j + 32 * h)), t, h, lo, hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 128 * j + 32 * h), _mm256_add_epi8(lo, offset));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 128 * j + 64 + 32 * h), _mm256_add_epi8(hi, offset));
      }
    }
  }
}

// ---- AVX2: the same panel as two halves of 8 columns; maddubs (u8 x s8 -> pairs in int16) then madd -> int32 ------

// 8 lanes of sum over 4 bytes of u * x. 4- and 6-bit weights: u <= 63, so the int16 pairs cannot saturate. 8-bit
// weights are taken back to signed w = u - 128 and multiplied as |w| * (x with w's sign): |w| <= 127, |x| <= 127, no
// saturation.
template <int BITS>
__attribute__((target("avx2,fma"))) inline __m256i dot4(__m256i u, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 8) {
    const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
  }
}

template <int R, int BITS>
__attribute__((target("avx2,f16c,fma"))) void panel_avx2(const QuantX& xq, const uint8_t* w, const uint16_t* ws,
                                                          const float* b, float* y, int64_t K, int64_t N, int64_t m0,
                                                          int64_t n0) {
  const int64_t groups = K / G;
  // the 8-bit body multiplies signed weights directly: no zero point to take off
  constexpr int zero = BITS == 8 ? 0 : BITS == 6 ? 32 : 8;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    if (m0 == 0)  // as the AVX-512 body
      for (int64_t l = 0; l < G * P * BITS / 8; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + g * G * P * BITS / 8 + (BITS == 6 ? PREFETCH_6 : PREFETCH) + l),
                     _MM_HINT_T1);
    __m256i isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    const int8_t* xg[R];
    for (int r = 0; r < R; ++r) xg[r] = xq.q.data() + (m0 + r) * K + g * G;
    if constexpr (BITS == 8) {
      for (int j = 0; j < G / 4; ++j) {
        const uint8_t* p = w + (g * (G / 4) + j) * 64;
        for (int h = 0; h < 2; ++h) {
          const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
          for (int r = 0; r < R; ++r)
            isum[r][h] = _mm256_add_epi32(isum[r][h], dot4<8>(u, _mm256_set1_epi32(four(xg[r] + 4 * j))));
        }
      }
    } else {
      for (int j = 0; j < G / 8; ++j) {
        const uint8_t* p = BITS == 4 ? w + (g * (G / 8) + j) * 64 : w + g * (G * P * 6 / 8) + 64 * j;
        for (int h = 0; h < 2; ++h) {
          const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
          __m256i lo, hi;
          if constexpr (BITS == 6)
            six_bits(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * (G * P * 6 / 8) + 256 + 32 * j)), h,
                     lo, hi);
          else
            lo = _mm256_and_si256(u, low), hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), low);
          for (int r = 0; r < R; ++r) {
            isum[r][h] = _mm256_add_epi32(isum[r][h], dot4<4>(lo, _mm256_set1_epi32(four(xg[r] + 8 * j))));
            isum[r][h] = _mm256_add_epi32(isum[r][h], dot4<4>(hi, _mm256_set1_epi32(four(xg[r] + 8 * j + 4))));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 wscale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + g * P + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * groups + g;
        const __m256i exact = _mm256_sub_epi32(isum[r][h], _mm256_set1_epi32(zero * xq.sum[i]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(wscale, _mm256_set1_ps(xq.scale[i])),
                                    acc[r][h]);
      }
    }
  }
  const int64_t n = std::min<int64_t>(P, N - n0);
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[P];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    for (int c = 0; c < n; ++c) y[(m0 + r) * N + n0 + c] = out[c] + (b ? b[n0 + c] : 0.f);
  }
}

// `count` (<= NP) neighbouring panels from panel p, at w and ws, for all M rows.
template <int BITS>
void run_set(const QuantX& xq, const uint8_t* w, const uint16_t* ws, const float* b, float* y, int64_t M, int64_t K,
             int64_t N, int64_t p, int64_t count, bool vnni) {
  const int64_t panel_bytes = K * P * BITS / 8, panel_scales = K / G * P;
  int64_t m0 = 0;
  if (vnni && count == NP) {
    if constexpr (BITS != 6)  // 6 bits come here below MR rows only (run_panels)
      for (; m0 + MR <= M; m0 += MR) panel_vnni<MR, NP, BITS>(xq, w, ws, b, y, K, N, m0, p * P);
    for (; m0 < M; ++m0) panel_vnni<1, NP, BITS>(xq, w, ws, b, y, K, N, m0, p * P);
    return;
  }
  for (int64_t q = 0; q < count; ++q) {
    const uint8_t* wq = w + q * panel_bytes;
    const uint16_t* sq = ws + q * panel_scales;
    if (vnni) {
      for (m0 = 0; m0 < M; ++m0) panel_vnni<1, 1, BITS>(xq, wq, sq, b, y, K, N, m0, (p + q) * P);
    } else {
      for (m0 = 0; m0 + 2 <= M; m0 += 2) panel_avx2<2, BITS>(xq, wq, sq, b, y, K, N, m0, (p + q) * P);
      if (m0 < M) panel_avx2<1, BITS>(xq, wq, sq, b, y, K, N, m0, (p + q) * P);
    }
  }
}

template <int BITS>
void run_panels(const QuantX& xq, const uint8_t* w, const uint16_t* ws, const float* b, float* y, int64_t M,
                int64_t K, int64_t N, bool vnni) {
  const int64_t panels = (N + P - 1) / P;
  const int64_t panel_bytes = K * P * BITS / 8, panel_scales = K / G * P;
  const bool widen = BITS == 6 && M >= MR;  // see the header
  at::parallel_for(0, (panels + NP - 1) / NP, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> wide(widen ? NP * K * P : 0);
    for (int64_t p = begin * NP; p < std::min(end * NP, panels); p += NP) {
      const int64_t count = std::min<int64_t>(NP, panels - p);
      if (widen) {
        for (int64_t q = 0; q < count; ++q) widen_panel(w + (p + q) * panel_bytes, wide.data() + q * K * P, K);
        run_set<8>(xq, wide.data(), ws + p * panel_scales, b, y, M, K, N, p, count, vnni);
      } else {
        run_set<BITS>(xq, w + p * panel_bytes, ws + p * panel_scales, b, y, M, K, N, p, count, vnni);
      }
    }
  });
}

// What packed_rows needs of its weight, for x [M, K] and y [M, N].
void check_packed(int64_t K, const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& bias,
                  int64_t N, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 6 || bits == 4, "packed_rows: bits must be 8, 6 or 4");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && bias.scalar_type() == at::kFloat,
              "packed_rows: expected float32 bias, uint8 packed, float16 scales");
  TORCH_CHECK(bias.dim() == 1, "packed_rows: expected bias [N]");
  TORCH_CHECK(N >= 0, "packed_rows: packed weights or scales do not match x [M, K] and bias [N]");
  const int64_t panels = (N + P - 1) / P;
  TORCH_CHECK(K % G == 0, "packed_rows: the input size must be a multiple of 32");
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == panels * K * P * bits / 8 && scales.is_contiguous() &&
                  scales.numel() == panels * (K / G) * P && bias.is_contiguous() &&
                  (bias.numel() == N || bias.numel() == 0),
              "packed_rows: packed weights or scales do not match x [M, K] and bias [N]");
}

// packed_rows on a checked weight
void run_packed(const float* x, int64_t M, int64_t K, const torch::Tensor& packed, const torch::Tensor& scales,
                const torch::Tensor& bias, int64_t N, int64_t bits, bool vnni, float* y) {
  const QuantX xq = quantize_x(x, M, K);
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;  // none: + 0 (the head has no bias)
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* ws = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  if (bits == 8)
    run_panels<8>(xq, w, ws, b, y, M, K, N, vnni);
  else if (bits == 6)
    run_panels<6>(xq, w, ws, b, y, M, K, N, vnni);
  else
    run_panels<4>(xq, w, ws, b, y, M, K, N, vnni);
}

}  // namespace

// x [M, K] float32 (rows contiguous), packed uint8 (see the header), scales float16 [panels, K / 32, 16], bias
// float32 [N] or empty (the head has none): into y [M, N] float32. vnni: the AVX-512 VNNI body, else the AVX2 one.
// block.cpp calls this with its own buffers: a decode step's block runs no tensor operation per projection (each is a
// dispatch through torch, and on the caches a block's weights have just streamed through, several microseconds).
void packed_rows_into(const float* x, int64_t M, int64_t K, const torch::Tensor& packed, const torch::Tensor& scales,
                      const torch::Tensor& bias, int64_t N, int64_t bits, bool vnni, float* y) {
  check_packed(K, packed, scales, bias, N, bits);
  run_packed(x, M, K, packed, scales, bias, N, bits, vnni, y);
}

// The same as a tensor: y [M, N] for x [M, K].
torch::Tensor packed_rows(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor bias, int64_t N,
                          int64_t bits, bool vnni) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "packed_rows: expected float32 x [M, K]");
  check_packed(x.size(1), packed, scales, bias, N, bits);
  x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  run_packed(x.data_ptr<float>(), x.size(0), x.size(1), packed, scales, bias, N, bits, vnni, y.data_ptr<float>());
  return y;
}

// The float32 weights W[k, 16 p0 ..] of panels [p0, p1) of a packed matrix, into out [K, 16 (p1 - p0)]: what a
// backward pass multiplies by (dL/dx = dL/dy W^T; QLoRA's frozen base). q * scale exactly as the kernel above means
// it, so the gradient is the quantized model's. The work goes by scale group (32 input rows) across all the panels:
// the 32 output rows being written then span a few pages, where going panel by panel wrote 16 floats on each of K
// rows kilobytes apart, one TLB miss per 64 bytes. Groups are split over threads.
void dequantize_panels(torch::Tensor packed, torch::Tensor scales, int64_t bits, int64_t K, int64_t p0, int64_t p1,
                       torch::Tensor out) {
  TORCH_CHECK(bits == 8 || bits == 6 || bits == 4, "dequantize_panels: bits must be 8, 6 or 4");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && out.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && scales.is_contiguous() && out.is_contiguous(),
              "dequantize_panels: expected contiguous uint8 packed, float16 scales and float32 out");
  const int64_t panels = scales.numel() / ((K / G) * P);
  TORCH_CHECK(K % G == 0 && 0 <= p0 && p0 <= p1 && p1 <= panels && out.dim() == 2 && out.size(0) == K &&
                  out.size(1) == (p1 - p0) * P && packed.numel() == panels * K * P * bits / 8,
              "dequantize_panels: shapes do not match");
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* ws = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  const int64_t width = (p1 - p0) * P, panel_bytes = K * P * bits / 8, group_bytes = G * P * bits / 8;
  // a lane of 4 bytes per column holds 4 inputs (8 bits) or 8 inputs (4 and 6 bits: low nibbles first, then high;
  // 6 bits add each one's top 2 bits from the octet's plane, see the header)
  const int64_t per_lane = bits == 8 ? 4 : 8;
  const int zero = bits == 8 ? 128 : bits == 6 ? 32 : 8;
  at::parallel_for(0, K / G, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* src = w + p * panel_bytes + g * group_bytes;
        const uint16_t* sc = ws + (p * (K / G) + g) * P;
        float s[P];
        for (int c = 0; c < P; ++c) s[c] = static_cast<float>(c10::Half(sc[c], c10::Half::from_bits()));
        float* dst = o + g * G * width + (p - p0) * P;
        for (int64_t j = 0; j < G / per_lane; ++j) {
          const uint8_t* lane = src + j * P * 4;
          for (int i = 0; i < 4; ++i) {
            float* row = dst + (j * per_lane + i) * width;
            if (bits == 8) {
              for (int c = 0; c < P; ++c) row[c] = static_cast<float>(static_cast<int>(lane[c * 4 + i]) - 128) * s[c];
            } else {
              float* high = row + 4 * width;
              for (int c = 0; c < P; ++c) {
                const uint8_t u = lane[c * 4 + i];
                int top_lo = 0, top_hi = 0;
                if (bits == 6) {
                  const uint8_t t = src[256 + 32 * j + 4 * (c % 8) + i];
                  top_lo = (t >> (c < 8 ? 0 : 2)) & 3, top_hi = (t >> (c < 8 ? 4 : 6)) & 3;
                }
                row[c] = static_cast<float>(static_cast<int>(u & 0x0F) + 16 * top_lo - zero) * s[c];
                high[c] = static_cast<float>(static_cast<int>(u >> 4) + 16 * top_hi - zero) * s[c];
              }
            }
          }
        }
      }
    }
  });
}
