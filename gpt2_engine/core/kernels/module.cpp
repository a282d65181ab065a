// The Python module of the native kernels: every entry point the package calls, declared here from the file that
// defines it and bound once. It sits above the kernel files (it calls them; none of them calls it), so they stay a
// tree: block.cpp runs on decode.cpp, packed.cpp, quant.cpp, attention.cpp and lora.cpp (packed.cpp on decode.cpp's
// by_pieces_into).
#include <torch/extension.h>

#include <tuple>
#include <vector>

// decode.cpp
torch::Tensor conv1d_rows(torch::Tensor x, torch::Tensor w, torch::Tensor b, bool avx512);
torch::Tensor dot_rows(torch::Tensor x, torch::Tensor w, bool avx512);
torch::Tensor unpack_panels(torch::Tensor panels);
// packed.cpp
torch::Tensor conv1d_packed(torch::Tensor x, torch::Tensor units, torch::Tensor side, torch::Tensor b, int64_t bits,
                            bool avx512);
torch::Tensor dot_packed(torch::Tensor x, torch::Tensor units, torch::Tensor side, int64_t V, int64_t bits,
                         bool avx512);
torch::Tensor unpack_packed(torch::Tensor units, torch::Tensor side, int64_t R, int64_t C, int64_t band, int64_t bits,
                            bool as_float32);
torch::Tensor exponent_counts(torch::Tensor w);
torch::Tensor pack_exponents(torch::Tensor w, int64_t band, torch::Tensor exponents, torch::Tensor units);
// attention.cpp
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                               torch::Tensor v_cache, torch::Tensor slots, torch::Tensor starts, bool avx512);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v);
// quant.cpp
torch::Tensor packed_rows(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor bias, int64_t N,
                          int64_t bits, bool vnni);
void dequantize_panels(torch::Tensor packed, torch::Tensor scales, int64_t bits, int64_t K, int64_t p0, int64_t p1,
                       torch::Tensor out);
// lora.cpp
void lora_rows(torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor scale, torch::Tensor index,
               torch::Tensor y);

// block.cpp
void bind_row_block(py::module& m);
std::tuple<std::vector<int64_t>, std::vector<float>, std::vector<double>> reduce_rows(torch::Tensor logits,
                                                                                   std::vector<int64_t> banned);

// training.cpp
void adamw(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, double lr, double beta1, double beta2,
           double eps, double wd, double bias1, double bias2, double grad_scale);

// Each call releases the GIL, as torch's own ops do: the kernels touch no Python object, and in `gpt2 serve` the
// HTTP event loop must run while the engine thread is inside them (holding it, the loop waited for Python's 5 ms
// switch interval and requests queued behind a busy step).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("conv1d_rows", &conv1d_rows, "y = x @ w + b with a row-count-independent reduction order", release());
  m.def("dot_rows", &dot_rows, "y = x @ w^T with a row-count-independent reduction order", release());
  m.def("unpack_panels", &unpack_panels, "the float32 (K, N) matrix of a weight in panels", release());
  m.def("conv1d_packed", &conv1d_packed, "conv1d_rows on a weight with packed exponents, the same bits (packed.cpp)",
        release());
  m.def("dot_packed", &dot_packed, "dot_rows on a head with packed exponents, the same bits (packed.cpp)", release());
  m.def("unpack_packed", &unpack_packed, "the float32 or bfloat16 (R, C) matrix of packed units (packed.cpp)",
        release());
  m.def("exponent_counts", &exponent_counts, "how many float32/bfloat16 values have each exponent (packed.cpp)",
        release());
  m.def("pack_exponents", &pack_exponents, "a matrix's packed units, written; its side list (packed.cpp)", release());
  m.def("reduce_rows", &reduce_rows, "each row's argmax (skipping a banned token), its logit and logsumexp "
        "(block.cpp)", release());
  m.def("decode_attention", &decode_attention, "one decode step's attention for many cache slots (attention.cpp)",
        release());
  m.def("prefill_attention", &prefill_attention, "a prompt's causal attention, AVX-512, hs 64 (attention.cpp)",
        release());
  m.def("packed_rows", &packed_rows, "y = x @ W + b for blockwise int8/int4 W with int8 activations (quant.cpp)",
        release());
  m.def("dequantize_panels", &dequantize_panels, "float32 columns of a packed int8/int4 matrix (quant.cpp)",
        release());
  m.def("lora_rows", &lora_rows, "y += scale * (x A) B with each row's own adapter, row-invariant (lora.cpp)",
        release());
  bind_row_block(m);
  m.def("adamw", &adamw, "one AdamW update of a float32 parameter in one pass (training.cpp)", release());

  // The id of what a module built at install was built from (sources.py's build_id: the sources and the torch),
  // passed by setup.py as a bare token and made a string here; kernels/__init__.py finds it in the file before it
  // imports the module. A build at first use has none: torch rebuilds it when its sources change.
#ifdef GPT2_ENGINE_BUILD
#define GPT2_ENGINE_STR2(x) #x
#define GPT2_ENGINE_STR(x) GPT2_ENGINE_STR2(x)
  m.attr("build") = GPT2_ENGINE_STR(GPT2_ENGINE_BUILD);
#endif
}
