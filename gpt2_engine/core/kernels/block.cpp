// One transformer block over the rows of a decode-sized pass, in one call: what model.block() does with
// self_attention_segments(), on the same row-invariant kernels (decode.cpp, quant.cpp, attention.cpp, lora.cpp).
//
//   x = x + attn_c_proj(attention(c_attn(ln_1(x))))        x [R, C]
//   x = x + mlp_c_proj(gelu(c_fc(ln_2(x))))
//
// Why: a decode step of GPT-2 small is ~13 small torch ops per block (layer norms, GELU, residual adds, splits and
// views around the kernels), each a dispatch, an allocation and for some a wake-up of the thread pool. At batch 1
// in int8 or int4 they cost a third of the step. Here the same work is one call per block, and the element-wise
// pieces are short loops in a fixed order: layer norm and GELU reduce or act per row, so a row's bits still do not
// depend on the other rows (the server's batch invariance). They are not torch's bits (torch's layer norm and tanh
// are its own), which is why every decode-sized pass runs here, never some on torch and some here.
// Inside the call the block runs on plain buffers of its own and the kernels' `_into` entry points: each tensor
// operation (a view, a split, an empty output) is a dispatch through torch, and on the caches that a block's weights
// have just streamed through, a few microseconds; 25 of them a block were a tenth of an int4 step.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

// decode.cpp, packed.cpp, quant.cpp, attention.cpp (its exp8 and sum8 too), lora.cpp
void conv1d_rows_into(const float* x, int64_t M, int64_t K, const torch::Tensor& w, const torch::Tensor& b,
                      bool avx512, float* y);
void conv1d_packed_into(const float* x, int64_t M, int64_t K, const torch::Tensor& units, const torch::Tensor& side,
                        const torch::Tensor& b, int64_t bits, bool avx512, float* y);
torch::Tensor dot_packed(torch::Tensor x, torch::Tensor units, torch::Tensor side, int64_t V, int64_t bits,
                         bool avx512);
void dot_packed_slice(const torch::Tensor& x, const torch::Tensor& units, const torch::Tensor& side, int64_t V,
                      int64_t bits, int64_t v0, int64_t n, float* y, int64_t ldy, bool avx512);
torch::Tensor dot_rows(torch::Tensor x, torch::Tensor w, bool avx512);
void dot_rows_slice(const torch::Tensor& x, const torch::Tensor& w, int64_t v0, int64_t n, float* y, int64_t ldy,
                    bool avx512);
torch::Tensor packed_rows(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor bias, int64_t N,
                          int64_t bits, bool vnni);
void packed_rows_into(const float* x, int64_t M, int64_t K, const torch::Tensor& packed, const torch::Tensor& scales,
                      const torch::Tensor& bias, int64_t N, int64_t bits, bool vnni, float* y);
void decode_attention_into(const float* q, const float* k, const float* v, int64_t ld, int64_t R, int64_t nh,
                           int64_t hs, float* kp, float* vp, int64_t n_slots, int64_t L, const int64_t* slot,
                           const int64_t* start, bool avx512, float* out);
void lora_rows(torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor scale, torch::Tensor index,
               torch::Tensor y);
__attribute__((target("avx2,fma"))) __m256 exp8(__m256 v);
__attribute__((target("avx2,fma"))) float sum8(__m256 v);

namespace {

// y = (x - mean) / sqrt(var + eps) * w + b over one row of C; mean and (biased) variance in 8 lanes then sum8, the
// last C % 8 in scalar code. GPT-2's eps is 1e-5.
__attribute__((target("avx2,fma"))) void layer_norm_row(const float* x, const float* w, const float* b, float* y,
                                                        int64_t C, float eps) {
  const int64_t whole = C / 8 * 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < whole; c += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + c));
  float sum = sum8(acc);
  for (int64_t c = whole; c < C; ++c) sum += x[c];
  const float mean = sum / static_cast<float>(C);
  const __m256 m = _mm256_set1_ps(mean);
  acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < whole; c += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + c), m);
    acc = _mm256_fmadd_ps(d, d, acc);
  }
  float sq = sum8(acc);
  for (int64_t c = whole; c < C; ++c) sq = __builtin_fmaf(x[c] - mean, x[c] - mean, sq);
  const float rstd = 1.0f / std::sqrt(sq / static_cast<float>(C) + eps);
  const __m256 r = _mm256_set1_ps(rstd);
  for (int64_t c = 0; c < whole; c += 8) {
    const __m256 n = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + c), m), r);
    _mm256_storeu_ps(y + c, _mm256_fmadd_ps(n, _mm256_loadu_ps(w + c), _mm256_loadu_ps(b + c)));
  }
  for (int64_t c = whole; c < C; ++c) y[c] = __builtin_fmaf((x[c] - mean) * rstd, w[c], b[c]);
}

// GPT-2's GELU, the tanh approximation 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), in place. Since
// 1 + tanh(u) = 2 / (1 + exp(-2u)), it is x / (1 + exp(-2u)): one exp and one division, and no cancellation where
// tanh(u) is near -1. -2u is clamped to [-87, 88], where the result is x or a value below 1e-37 |x| anyway.
__attribute__((target("avx2,fma"))) void gelu_to(const float* x, float* y, int64_t n) {
  const __m256 k = _mm256_set1_ps(-2.0f * 0.7978845608028654f), c = _mm256_set1_ps(0.044715f);
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(c, v), _mm256_mul_ps(v, v), v);  // x + 0.044715 x^3
    const __m256 t = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(k, inner)));  // -2u
    _mm256_storeu_ps(y + i, _mm256_div_ps(v, _mm256_add_ps(one, exp8(t))));
  }
  if (i < n) {  // the tail through the same vector code, padded with zeros
    alignas(32) float tail[8] = {};
    std::copy(x + i, x + n, tail);
    gelu_to(tail, tail, 8);
    std::copy(tail, tail + (n - i), y + i);
  }
}

void gelu_inplace(float* x, int64_t n) { gelu_to(x, x, n); }

// ---- greedy picks: each row's argmax and logsumexp -------------------------------------------------------------
// A greedy step needs each row's argmax (its token) and logsumexp (that token's logprob), not its V logits. They are
// reduced SUB vocabulary rows at a time, each piece to a Pick while its logits are in L1 (decode.cpp's
// dot_rows_slice), and the pieces merged in vocabulary order. The pieces are fixed, SUB-aligned ranges, so a row's
// argmax and logsumexp do not depend on the thread count or on the other rows, and reduce_rows gives the same bits
// over logits made elsewhere (the packed heads, torch's head for steered rows, a prompt's last row).

constexpr int64_t SUB = 256;  // vocabulary rows per piece (a multiple of decode.cpp's VB)

struct Pick {              // one row over one piece of the vocabulary
  float max = -INFINITY;   // its largest logit (NaN where one is NaN)
  float sum = 0.0f;        // sum of exp(logit - max), each term at least exp(-87)
  float best = -INFINITY;  // the largest logit other than the banned token's
  int64_t at = -1;         // that logit's vocabulary index, the first of equal maxima; -1: none above -inf
};

// The Pick of y[0, n), vocabulary rows [v0, v0 + n). The argmax is found after the max, by a scan to the first equal
// value, unless the banned token holds the max (then by a scan of the rest), so the common case is two vector passes.
__attribute__((target("avx2,fma"))) Pick reduce_piece(const float* y, int64_t n, int64_t v0, int64_t banned) {
  Pick p;
  const int64_t whole = n / 8 * 8;
  __m256 m8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(y + i);
    m8 = _mm256_max_ps(m8, v);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  float m = -INFINITY;
  for (float v : lanes) m = std::max(m, v);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (int64_t i = whole; i < n; ++i) {
    m = std::max(m, y[i]);
    nan |= std::isnan(y[i]);
  }
  if (nan) {
    p.max = p.best = NAN;
    return p;
  }
  p.max = m;
  const int64_t b = banned - v0;  // the banned token's place in this piece, if it is here
  if (m > -INFINITY && !(0 <= b && b < n && y[b] == m)) {
    int64_t i = 0;
    while (y[i] != m) ++i;
    p.best = m, p.at = v0 + i;
  } else {
    for (int64_t i = 0; i < n; ++i)
      if (i != b && y[i] > p.best) p.best = y[i], p.at = v0 + i;
  }
  if (!std::isfinite(m)) return p;  // all -inf (sum 0), or +inf (the logsumexp is inf)
  const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 8)
    acc = _mm256_add_ps(acc, exp8(_mm256_max_ps(lo, _mm256_sub_ps(_mm256_loadu_ps(y + i), mv))));
  p.sum = sum8(acc);
  for (int64_t i = whole; i < n; ++i) p.sum += std::exp(std::max(-87.0f, y[i] - m));
  return p;
}

// Each row's argmax, its logit and the logsumexp, as vectors (Python lists through the binding, what the scheduler
// reads): a decode step returns here right after the head has streamed through the caches, where creating a tensor
// and reading it back cost far more than building a list.
using Selected = std::tuple<std::vector<int64_t>, std::vector<float>, std::vector<double>>;

// picks [P pieces][M rows], in vocabulary order -> each row's argmax (-1: none), that logit, and the logsumexp over
// all its logits: the largest max, then the pieces' sums rescaled to it, in float64.
Selected merge_picks(const std::vector<Pick>& picks, int64_t M, int64_t P) {
  std::vector<int64_t> at(M);
  std::vector<float> best(M);
  std::vector<double> lse(M);
  for (int64_t r = 0; r < M; ++r) {
    int64_t a = -1;
    float b = -INFINITY, m = -INFINITY;
    bool nan = false;
    for (int64_t i = 0; i < P; ++i) {
      const Pick& p = picks[i * M + r];
      nan |= std::isnan(p.max);
      m = std::max(m, p.max);
      if (p.at >= 0 && p.best > b) b = p.best, a = p.at;
    }
    double l = m;
    if (nan) {
      a = -1, b = NAN, l = NAN;
    } else if (std::isfinite(m)) {
      double sum = 0.0;
      for (int64_t i = 0; i < P; ++i) sum += double(picks[i * M + r].sum) * std::exp(double(picks[i * M + r].max) - m);
      l = m + std::log(sum);
    }
    at[r] = a, best[r] = b, lse[r] = l;
  }
  return {at, best, lse};
}

}  // namespace

// Each row's argmax (skipping banned[m]; -1: none), its logit and the logsumexp, of logits computed elsewhere [M, V]
// (rows may be strided, columns contiguous): the same pieces and merge as RowHead::select, so the same bits.
Selected reduce_rows(torch::Tensor logits, std::vector<int64_t> banned) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && (logits.size(1) <= 1 || logits.stride(1) == 1),
              "reduce_rows: expected float32 [M, V] with contiguous rows");
  TORCH_CHECK(static_cast<int64_t>(banned.size()) == logits.size(0), "reduce_rows: expected one banned token a row");
  const int64_t M = logits.size(0), V = logits.size(1), P = (V + SUB - 1) / SUB;
  std::vector<Pick> picks(P * M);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < P; ++i)
      picks[i * M + r] = reduce_piece(logits.data_ptr<float>() + r * logits.stride(0) + i * SUB,
                                      std::min(SUB, V - i * SUB), i * SUB, banned[r]);
  return merge_picks(picks, M, P);
}

namespace {

// The bit widths a projection or head may have: 0 float32 or bfloat16 (decode.cpp); 28 and 12 float32 and bfloat16
// with packed exponents (packed.cpp: weight the units, scales the side list); 8, 6, 4 quantized (quant.cpp).
bool float_bits(int64_t bits) { return bits == 0 || bits == 28 || bits == 12; }
bool known_bits(int64_t bits) { return float_bits(bits) || bits == 8 || bits == 6 || bits == 4; }

// One projection's tensors: a float32/bfloat16 weight (K, N) (or its packed units and side list, bits 28/12), or a
// quantized int8/int6/int4 one with its scales (bits 8/6/4), the bias, and the LoRA stack (a, b, scale) where it has
// one.
struct Projection {
  torch::Tensor weight, scales, bias, lora_a, lora_b, lora_scale;
  int64_t bits;

  // y [R, N] = x [R, K] @ W + b (+ each row's LoRA update), on the caller's buffers
  void operator()(const float* x, int64_t R, int64_t K, float* y, const torch::Tensor& index, bool avx512,
                  bool vnni) const {
    const int64_t N = bias.numel();
    if (bits == 0)
      conv1d_rows_into(x, R, K, weight, bias, avx512, y);
    else if (float_bits(bits))
      conv1d_packed_into(x, R, K, weight, scales, bias, bits, avx512, y);
    else
      packed_rows_into(x, R, K, weight, scales, bias, N, bits, vnni, y);
    if (lora_a.defined())  // lora.cpp's tensors over the same buffers
      lora_rows(torch::from_blob(const_cast<float*>(x), {R, K}, torch::kFloat), lora_a, lora_b, lora_scale, index,
                torch::from_blob(y, {R, N}, torch::kFloat));
  }
};

}  // namespace

// y [R, C] = layer_norm(x [R, C]) row by row.
static void norm_rows(const float* x, int64_t R, int64_t C, const torch::Tensor& w, const torch::Tensor& b, float eps,
                      float* y) {
  const float *wp = w.data_ptr<float>(), *bp = b.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) layer_norm_row(x + r * C, wp, bp, y + r * C, C, eps);
}

static void norm_rows(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, float eps, torch::Tensor& y) {
  norm_rows(x.data_ptr<float>(), x.size(0), x.size(1), w, b, eps, y.data_ptr<float>());
}

// The tensors of one block, held once for all the passes (core/rows.py's native_block builds it).
class RowBlock {
 public:
  // params: ln_1 weight and bias, ln_2 weight and bias, then for c_attn, attn_c_proj, c_fc, mlp_c_proj in turn:
  // weight, scales (empty: float), bias, lora a, b, scale (empty: none). bits: each projection's (known_bits).
  RowBlock(std::vector<torch::Tensor> params, std::vector<int64_t> bits, int64_t layer, int64_t n_head, double eps,
           bool avx512, bool vnni)
      : layer_(layer), n_head_(n_head), eps_(static_cast<float>(eps)), avx512_(avx512), vnni_(vnni) {
    TORCH_CHECK(params.size() == 4 + 4 * 6 && bits.size() == 4, "RowBlock: expected 28 tensors and 4 bit widths");
    ln_ = {params[0], params[1], params[2], params[3]};
    for (const auto& t : ln_)
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1, "RowBlock: layer norms must be float32 [C]");
    for (int j = 0; j < 4; ++j) {
      const auto* p = params.data() + 4 + 6 * j;
      TORCH_CHECK(known_bits(bits[j]), "RowBlock: bits must be 0, 28, 12, 8, 6 or 4");
      proj_[j] = {p[0], p[1], p[2], p[3].numel() ? p[3] : torch::Tensor(), p[4], p[5], bits[j]};
      lora_ = lora_ || proj_[j].lora_a.defined();
    }
    // the buffers of operator() are cut to these widths: C, and the MLP's (4C in GPT-2, n_inner where a config sets it)
    const int64_t C = ln_[0].numel();
    TORCH_CHECK(C > 0 && n_head > 0 && C % n_head == 0 && layer >= 0 && ln_[1].numel() == C && ln_[2].numel() == C &&
                    ln_[3].numel() == C, "RowBlock: layer norms must be [C] with C a multiple of n_head, layer >= 0");
    TORCH_CHECK(proj_[0].bias.numel() == 3 * C && proj_[1].bias.numel() == C && proj_[2].bias.numel() > 0 &&
                    proj_[3].bias.numel() == C, "RowBlock: biases must be [3C], [C], [the MLP's width] and [C]");
  }

  // x [..., R, C] -> the same shape; k_cache, v_cache [n_layer, slots, nh, L, hs] (this block reads and writes its
  // layer's); slots, positions: R each (each row's cache slot and position; lists from Python, core/rows.py's
  // RowLayout, since a tensor made per step costs more than this call's element-wise work); adapters [R] int64 (each
  // row's LoRA adapter, -1 none), empty: adapter 0 for every row.
  torch::Tensor operator()(torch::Tensor x_in, torch::Tensor k_cache, torch::Tensor v_cache,
                           std::vector<int64_t> slots, std::vector<int64_t> positions, torch::Tensor adapters) const {
    const int64_t C = ln_[0].numel(), hs = C / n_head_;
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1 && x_in.size(-1) == C, "RowBlock: x must be float32 [..., C]");
    TORCH_CHECK(k_cache.dim() == 5 && layer_ < k_cache.size(0) && k_cache.sizes() == v_cache.sizes() &&
                    k_cache.size(2) == n_head_ && k_cache.size(4) == hs && k_cache.scalar_type() == at::kFloat &&
                    v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "RowBlock: caches must be contiguous float32 [n_layer, slots, nh, L, hs]");
    const torch::Tensor x = x_in.reshape({-1, C}).contiguous();  // [R, C]
    const int64_t R = x.size(0);
    TORCH_CHECK(static_cast<int64_t>(slots.size()) == R && static_cast<int64_t>(positions.size()) == R,
                "RowBlock: expected a slot and a position for each of the ", R, " rows");
    // each row's adapter, for the projections with LoRA (none: adapter 0 for every row, the single-adapter model)
    const torch::Tensor index = adapters.numel() || !lora_ ? adapters : torch::zeros({R}, torch::kLong);
    auto out = torch::empty_like(x);  // [R, C]: the residual stream after this block
    // The rest on plain buffers: [R, C] a layer norm's output, [R, 3C] Q, K, V side by side (split_qkv), [R, C] the
    // attention's output (heads merged), [R, I] the MLP's hidden layer, [R, C] a projection's output. Each is written
    // whole before it is read.
    const int64_t I = proj_[2].bias.numel();  // the MLP's width
    const std::unique_ptr<float[]> buffers(new float[R * (6 * C + I)]);
    float *h = buffers.get(), *qkv = h + R * C, *a = qkv + 3 * R * C, *f = a + R * C, *y = f + R * I;
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t n_slots = k_cache.size(1), L = k_cache.size(3), layer = n_slots * n_head_ * L * hs;
    norm_rows(xp, R, C, ln_[0], ln_[1], eps_, h);
    proj_[0](h, R, C, qkv, index, avx512_, vnni_);
    decode_attention_into(qkv, qkv + C, qkv + 2 * C, 3 * C, R, n_head_, hs, k_cache.data_ptr<float>() + layer_ * layer,
                          v_cache.data_ptr<float>() + layer_ * layer, n_slots, L, slots.data(), positions.data(),
                          avx512_, a);
    proj_[1](a, R, C, y, index, avx512_, vnni_);
    add(xp, y, op, R * C);  // x + attn
    norm_rows(op, R, C, ln_[2], ln_[3], eps_, h);
    proj_[2](h, R, C, f, index, avx512_, vnni_);
    gelu_inplace(f, R * I);
    proj_[3](f, R, I, y, index, avx512_, vnni_);
    add(op, y, op, R * C);  // + mlp
    return out.view(x_in.sizes());
  }

 private:
  static void add(const float* x, const float* y, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
  }

  std::array<torch::Tensor, 4> ln_;
  std::array<Projection, 4> proj_;
  int64_t layer_, n_head_;
  float eps_;
  bool avx512_, vnni_, lora_ = false;
};

// The final layer norm and the tied head over the rows of a decode-sized pass: logits [R, V] = ln_f(x) wte^T, with
// wte (V, C) in float32 or bfloat16 (decode.cpp's dot_rows), with packed exponents (bits 28/12: packed.cpp's
// dot_packed, the head its units and scales its side list) or quantized as (C, V) (bits 8/6/4: quant.cpp), as
// model.logits() computes them for these rows, in one call.
class RowHead {
 public:
  RowHead(torch::Tensor ln_w, torch::Tensor ln_b, torch::Tensor head, torch::Tensor scales, int64_t bits, int64_t vocab,
          double eps, bool avx512, bool vnni)
      : ln_w_(ln_w), ln_b_(ln_b), head_(head), scales_(scales), bits_(bits), vocab_(vocab),
        eps_(static_cast<float>(eps)), avx512_(avx512), vnni_(vnni) {
    TORCH_CHECK(ln_w.scalar_type() == at::kFloat && ln_b.scalar_type() == at::kFloat && ln_w.is_contiguous() &&
                    ln_b.is_contiguous(), "RowHead: the layer norm must be float32 [C]");
    TORCH_CHECK(known_bits(bits), "RowHead: bits must be 0, 28, 12, 8, 6 or 4");
  }

  // x [R, C] -> logits [R, V].
  torch::Tensor operator()(torch::Tensor x) const {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == ln_w_.numel(), "RowHead: x must be float32 [R, C]");
    x = x.contiguous();
    auto h = torch::empty_like(x);  // [R, C]
    norm_rows(x, ln_w_, ln_b_, eps_, h);
    if (bits_ == 0) return dot_rows(h, head_, avx512_);
    if (float_bits(bits_)) return dot_packed(h, head_, scales_, vocab_, bits_, avx512_);
    return packed_rows(h, head_, scales_, torch::empty({0}, x.options()), vocab_, bits_, vnni_);
  }

  // What a pass's rows need of the head, without writing every row's logits: each row's argmax skipping banned[r]
  // (<|endoftext|> under ignore_eos; -1: none), that logit and the logsumexp of all V, and the logits of the rows
  // with keep[r] >= 0 as out[keep[r]] (out [kept, V]; keep numbers the kept rows in order): the greedy picks above,
  // on the head's logits a piece at a time (decode.cpp's dot_rows_slice, packed.cpp's dot_packed_slice); a quantized
  // head's logits are made whole first (its kernel runs whole panels of the vocabulary) and reduced the same way.
  std::tuple<std::vector<int64_t>, std::vector<float>, std::vector<double>, torch::Tensor> select(
      torch::Tensor x, std::vector<int64_t> banned, std::vector<int64_t> keep, int64_t kept) const {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == ln_w_.numel(), "RowHead: x must be float32 [R, C]");
    const int64_t R = x.size(0), P = (vocab_ + SUB - 1) / SUB;
    TORCH_CHECK(static_cast<int64_t>(banned.size()) == R && static_cast<int64_t>(keep.size()) == R,
                "RowHead.select: expected a banned token and a keep place for each of the ", R, " rows");
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(keep[r] < kept, "RowHead.select: keep numbers past kept");
    x = x.contiguous();
    auto h = torch::empty_like(x);  // [R, C]
    norm_rows(x, ln_w_, ln_b_, eps_, h);
    if (!float_bits(bits_)) {
      const torch::Tensor all = packed_rows(h, head_, scales_, torch::empty({0}, x.options()), vocab_, bits_, vnni_);
      auto [at, best, lse] = reduce_rows(all, banned);
      std::vector<int64_t> rows;
      for (int64_t r = 0; r < R; ++r)
        if (keep[r] >= 0) rows.push_back(r);
      const auto index = torch::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, torch::kLong);
      return {at, best, lse, all.index_select(0, index)};
    }
    const int64_t *bp = banned.data(), *kp = keep.data();
    auto out = torch::empty({kept, vocab_}, x.options());
    float* op = out.data_ptr<float>();
    std::vector<Pick> picks(P * R);
    TORCH_CHECK(bits_ != 0 || (head_.dim() == 2 && head_.size(1) == h.size(1) && head_.is_contiguous() &&
                                (head_.scalar_type() == at::kFloat || head_.scalar_type() == at::kBFloat16)),
                "RowHead.select: the head must be a contiguous float32 or bfloat16 [V, C]");
    at::parallel_for(0, P, 2, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(R * SUB);  // one piece's logits [R, SUB], in L1
      for (int64_t i = begin; i < end; ++i) {
        const int64_t v0 = i * SUB, n = std::min(SUB, vocab_ - v0);
        if (bits_ == 0)
          dot_rows_slice(h, head_, v0, n, buf.data(), SUB, avx512_);
        else
          dot_packed_slice(h, head_, scales_, vocab_, bits_, v0, n, buf.data(), SUB, avx512_);
        for (int64_t r = 0; r < R; ++r) {
          picks[i * R + r] = reduce_piece(buf.data() + r * SUB, n, v0, bp[r]);
          if (kp[r] >= 0) std::memcpy(op + kp[r] * vocab_ + v0, buf.data() + r * SUB, n * sizeof(float));
        }
      }
    });
    auto [at, best, lse] = merge_picks(picks, R, P);
    return {at, best, lse, out};
  }

 private:
  torch::Tensor ln_w_, ln_b_, head_, scales_;
  int64_t bits_, vocab_;
  float eps_;
  bool avx512_, vnni_;
};

// GELU of a whole tensor (a prompt's MLP), the same function as the blocks' above: elementwise, split over the
// threads in chunks, so each element's bits are those of a decode step's; one exp and a division where torch's
// kernel evaluates tanh.
torch::Tensor gelu(torch::Tensor x, std::optional<torch::Tensor> out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gelu: float32 only");
  x = x.contiguous();
  auto y = out ? *out : torch::empty_like(x);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.sizes() == x.sizes(),
              "gelu: out must be a contiguous float32 tensor of x's shape");
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t chunk = 16384;
  at::parallel_for(0, (x.numel() + chunk - 1) / chunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) gelu_to(xp + i * chunk, yp + i * chunk, std::min(chunk, x.numel() - i * chunk));
  });
  return y;
}

// A pass's first residual rows in one call: y[0, r] = table[ids[r]] + wpe[positions[r]], float32 [1, R, C] (the
// pass's residual stream, core/rows.py). table: wte (V, C) in float32 or bfloat16 (widened exactly, as model.embed's
// .float()), or a quantized model's rows already read from the file; wpe float32 (n_positions, C). One addition an
// element, model.embed's `tokens + pos`, so the same bits. ids and positions are lists, as RowBlock's slots and
// positions are, and for the same reason: this runs first in a decode step, on caches the last step's head has just
// flushed, where each small torch op (making the ids' tensor, two lookups, the add) costs tens of microseconds.
torch::Tensor embed_rows(torch::Tensor table, std::vector<int64_t> ids, torch::Tensor wpe,
                         std::vector<int64_t> positions) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() &&
                  (table.scalar_type() == at::kFloat || table.scalar_type() == at::kBFloat16),
              "embed_rows: the table must be a contiguous float32 or bfloat16 [V, C]");
  TORCH_CHECK(wpe.dim() == 2 && wpe.is_contiguous() && wpe.scalar_type() == at::kFloat && wpe.size(1) == table.size(1),
              "embed_rows: wpe must be a contiguous float32 [n_positions, C] of the table's C");
  TORCH_CHECK(ids.size() == positions.size(), "embed_rows: expected as many positions as ids");
  const int64_t R = static_cast<int64_t>(ids.size()), V = table.size(0), P = wpe.size(0), C = table.size(1);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(0 <= ids[r] && ids[r] < V, "embed_rows: token id ", ids[r], " is out of range for ", V, " rows");
    TORCH_CHECK(0 <= positions[r] && positions[r] < P, "embed_rows: position ", positions[r], " is out of range for ",
                P, " positions");
  }
  auto y = torch::empty({1, R, C}, wpe.options());
  float* yp = y.data_ptr<float>();
  const float* pp = wpe.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* pos = pp + positions[r] * C;
    float* out = yp + r * C;
    if (table.scalar_type() == at::kFloat) {
      const float* tok = table.data_ptr<float>() + ids[r] * C;
      for (int64_t c = 0; c < C; ++c) out[c] = tok[c] + pos[c];
    } else {  // bfloat16 is a float32's top half
      const uint16_t* tok = reinterpret_cast<const uint16_t*>(table.data_ptr<at::BFloat16>()) + ids[r] * C;
      for (int64_t c = 0; c < C; ++c) {
        const uint32_t bits = static_cast<uint32_t>(tok[c]) << 16;
        float t;
        std::memcpy(&t, &bits, sizeof t);
        out[c] = t + pos[c];
      }
    }
  }
  return y;
}

void bind_row_block(py::module& m) {
  py::class_<RowBlock>(m, "RowBlock")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, int64_t, int64_t, double, bool, bool>())
      .def("__call__", &RowBlock::operator(), "x [..., C] -> [..., C] through the block (see block.cpp)",
           py::call_guard<py::gil_scoped_release>());
  py::class_<RowHead>(m, "RowHead")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, double, bool, bool>())
      .def("__call__", &RowHead::operator(), "x [R, C] -> logits [R, V] (see block.cpp)",
           py::call_guard<py::gil_scoped_release>())
      .def("select", &RowHead::select, "x [R, C], banned [R], keep [R], kept -> (argmax, its logit, lse, kept "
           "logits) (see block.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("embed_rows", &embed_rows, "table[ids] + wpe[positions] as float32 [1, R, C] (block.cpp)", py::arg("table"),
        py::arg("ids"), py::arg("wpe"), py::arg("positions"), py::call_guard<py::gil_scoped_release>());
  m.def("gelu", &gelu, "GPT-2's GELU (tanh form) of a float32 tensor, into out where given (block.cpp)", py::arg("x"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
}

// The end of the engine's reading path (greedy.py -> loop.py -> scheduler.py -> runner.py -> here). The kernels these
// calls use: decode.cpp (float32/bfloat16 projections and the head), packed.cpp (the same with packed exponents),
// quant.cpp (int8/int4), attention.cpp.
