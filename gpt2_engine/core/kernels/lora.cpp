// The LoRA term of a pass in which every row may use its own adapter: y[m] += scale[i] * ((x[m] A[i]) B[i]),
// i = index[m] (-1: the base model, nothing added).
//
// Why a kernel: multi-adapter serving promises that a request's output equals its adapter served alone, bit for
// bit, whatever shares its pass. A torch matmul over the rows of one adapter rounds differently with the number of
// rows (MKL picks other blockings), so here each row is reduced on its own, in a fixed order: h_j = sum_k x_k A_kj
// with k ascending, then t_n = sum_j h_j B_jn with j ascending, then y_n += scale * t_n (PEFT's order: the scale
// after the product). The inner loops run over j and n, so the compiler vectorises them without reordering a sum.
// The work is small (r * (in + out) per row against in * out for the base projection): rows are split over threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

void lora_rows(torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor scale, torch::Tensor index,
               torch::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && y.dim() == 2, "lora_rows: x [R, K], a [n, K, r], b [n, r, N], y [R, N]");
  for (const auto* t : {&x, &a, &b, &scale, &y})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "lora_rows: contiguous float32 tensors expected");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous(), "lora_rows: index must be contiguous int64");
  const int64_t R = x.size(0), K = x.size(1), n = a.size(0), r = a.size(2), N = b.size(2);
  TORCH_CHECK(a.size(1) == K && b.size(0) == n && b.size(1) == r && y.size(0) == R && y.size(1) == N &&
              index.numel() == R && scale.numel() == n, "lora_rows: shapes do not match");
  const float* X = x.data_ptr<float>();
  const float* A = a.data_ptr<float>();
  const float* B = b.data_ptr<float>();
  const float* S = scale.data_ptr<float>();
  const int64_t* I = index.data_ptr<int64_t>();
  float* Y = y.data_ptr<float>();
  for (int64_t m = 0; m < R; ++m) TORCH_CHECK(I[m] >= -1 && I[m] < n, "lora_rows: adapter index out of range");
  at::parallel_for(0, R, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> h(r), t(N);
    for (int64_t m = lo; m < hi; ++m) {
      const int64_t i = I[m];
      if (i < 0) continue;
      const float* xm = X + m * K;
      const float* Ai = A + i * K * r;
      const float* Bi = B + i * r * N;
      std::fill(h.begin(), h.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float xk = xm[k];
        const float* row = Ai + k * r;
        for (int64_t j = 0; j < r; ++j) h[j] += xk * row[j];
      }
      std::fill(t.begin(), t.end(), 0.0f);
      for (int64_t j = 0; j < r; ++j) {
        const float hj = h[j];
        const float* row = Bi + j * N;
        for (int64_t c = 0; c < N; ++c) t[c] += hj * row[c];
      }
      float* ym = Y + m * N;
      const float s = S[i];
      for (int64_t c = 0; c < N; ++c) ym[c] += t[c] * s;
    }
  });
}
