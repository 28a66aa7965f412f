// cadenza's CPU kernels for x86-64 with AVX2 and FMA: the hot ops of a decode step.
//
// PyTorch's bfloat16 matrix-vector product on CPUs without native bf16 reads weights at about
// half the memory bandwidth, and a decode step spends more time dispatching small ops than
// computing them. These kernels read bf16 weights once at full speed with float32 arithmetic,
// and fuse the small ops (norm, rotary, paged attention, SiLU) into one call each.
//
// Every kernel takes and returns float32 activations; results match the PyTorch reference ops up
// to float32 rounding (accumulation order differs). Threads: ATen's intra-op pool (at::parallel_for),
// built with the same OpenMP runtime PyTorch ships, so no second thread team appears.
//
// The kernels live in the headers beside this file (one translation unit, built once):
// simd.h (AVX2 helpers), linear.h, small_ops.h, paged_attention.h, decode_layer.h, quant.h (GGUF blocks),
// quant_common.h and quant_packed.h (GGUF blocks re-laid for AVX-512 VNNI, built where the CPU has it).

#include <torch/extension.h>

#include "decode_layer.h"
#include "linear.h"
#include "paged_attention.h"
#include "quant.h"
#include "small_ops.h"

using namespace cadenza;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: let the event loop's thread run while they compute.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("linear_bf16", &linear_bf16, "x float32 @ w bfloat16^T (+ bias) -> float32", release());
  m.def("linear_bf16_add_", &linear_bf16_add_, "residual += x @ w^T (+ bias), in place", release());
  m.def("quant_linear", &quant_linear, "x float32 @ W^T, W raw GGUF blocks [out, bytes] of a GGML type", release());
  m.def("quant_linear_add_", &quant_linear_add_, "residual += x @ W^T (+ bias), W raw GGUF blocks", release());
  m.def("quant_matmul_", &quant_matmul_, "out (+)= x @ W^T (+ bias) into a [rows, out] view", release());
  m.def("quant_rows", &quant_rows, "rows of raw GGUF blocks, de-quantized to float32", release());
  m.def("quant_dequantize", &quant_dequantize, "raw GGUF blocks [out, bytes], de-quantized to float32 [out, in]", release());
  m.def("quant_dequantize_", &quant_dequantize_, "raw GGUF blocks, de-quantized into a float32 or bfloat16 [out, in] tensor", release());
  m.def("quant_in_features", &quant_in_features, "in_features of raw GGUF blocks [out, bytes] of a GGML type");
  m.def("quant_pack", &quant_pack, "GGUF blocks re-laid 16 rows at a time for the AVX-512 VNNI kernels", release());
  m.def("packed_kernels_built", &packed_kernels_built, "whether this build has the packed (AVX-512 VNNI) kernels");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, float32", release());
  m.def("rotary_", &rotary_, "in-place NeoX rotary embedding from cos/sin tables", release());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up for a fused [rows, 2 * I] gate_up", release());
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token-per-sequence attention over a paged KV cache", release());
  m.def("write_kv_", &write_kv_, "store keys and values at their cache slots", release());
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8,
        "one-token-per-sequence attention over a paged int8 KV cache with float16 scales", release());
  m.def("write_kv_int8_", &write_kv_int8_, "quantize keys and values into their int8 cache slots", release());
  py::class_<DecoderLayerKernel>(m, "DecoderLayerKernel")
      .def(py::init<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor,
                    c10::optional<torch::Tensor>, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                    torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor, torch::Tensor, int64_t, int64_t,
                    int64_t, double, int64_t, int64_t, int64_t, int64_t>())
      .def("attention_input", &DecoderLayerKernel::attention_input,
           "(q, k, v) of h: input norm, fused projection, rotary", release())
      .def("finish_", &DecoderLayerKernel::finish_, "h += attention output and MLP, in place", release());
  m.def("decode_stack_", &decode_stack_, "a decode step through every layer and its paged KV cache, h in place",
        release());
}
