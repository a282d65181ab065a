// One AdamW update of one float32 parameter tensor, in one pass over memory.
//
// Why: the update is bound by memory. It must read p, g, m, v and write p, m, v: 28 bytes per parameter, about
// 3.5 GB per step for GPT-2 small. torch's single-tensor AdamW (its CPU default) makes a pass per op, six or more,
// with a temporary the size of the parameter for the denominator. Here each element is loaded once, updated in
// registers, stored once; the loop is plain C++ that the compiler vectorises, split across torch's threads.
// The arithmetic is train/optim.py's adamw_reference, line for line, in float32 (the reference computes the same
// expressions as separate torch ops, so the two agree to rounding, not bit for bit).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

void adamw(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, double lr, double beta1, double beta2,
           double eps, double wd, double bias1, double bias2, double grad_scale) {
  for (const auto* t : {&p, &g, &m, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == p.numel(),
                "adamw: p, g, m and v must be contiguous float32 tensors of one size");
  float* P = p.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const float gs = grad_scale, b1 = 1.0 - beta1, b2 = beta2, ob2 = 1.0 - beta2, keep = 1.0 - lr * wd;
  const float step = lr / bias1, root2 = std::sqrt(bias2), e = eps;
  at::parallel_for(0, p.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const float gi = G[i] * gs;
      const float mi = M[i] + b1 * (gi - M[i]);  // lerp(m, g, 1 - beta1)
      const float vi = V[i] * b2 + ob2 * (gi * gi);
      M[i] = mi;
      V[i] = vi;
      P[i] = P[i] * keep - step * (mi / (std::sqrt(vi) / root2 + e));
    }
  });
}

