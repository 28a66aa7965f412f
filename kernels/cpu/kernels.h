// What every unit of cadenza's CPU kernels shares, and nothing of torch: errors, threads, and the
// plain C++ shapes the binding (cpu_kernels.cpp) hands the kernels instead of tensors.
//
// The kernels' own units (linear.cpp, small_ops.cpp, paged_attention.cpp, quant.cpp,
// quant_packed.cpp, decode_layer.cpp) include only the standard library, the intrinsics and the
// headers beside them; each X.h declares what X.cpp defines, over raw pointers and sizes. The
// binding alone includes torch: it checks the tensors (dtype, shape, strides), passes their
// pointers here, and binds the results to Python. torch's headers were most of the build (about
// 20 of the 30-34 s one unit under <torch/extension.h> took on 2 cores): now the binding alone
// includes them, fewer of them (13 s), while the kernels compile beside it (10 s in all).
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>

namespace cadenza {

// A failed check: std::runtime_error, which Python sees as RuntimeError (as it saw TORCH_CHECK's).
template <class... Parts>
[[noreturn]] inline void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

#define CADENZA_CHECK(cond, ...)                       \
  do {                                                 \
    if (!(cond)) ::cadenza::fail(__VA_ARGS__);         \
  } while (false)

// Threads are ATen's intra-op pool (at::parallel_for), which the binding lends through these two
// functions: the kernels run on the OpenMP team PyTorch's own ops use, so no second team appears.
using RangeBody = void (*)(const void* body, int64_t begin, int64_t end);
void parallel_for_range(int64_t begin, int64_t end, int64_t grain, RangeBody run, const void* body);
int64_t num_threads();

// body(b0, b1) over chunks of [begin, end), as at::parallel_for calls it.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
  const RangeBody run = [](const void* f, int64_t b0, int64_t b1) { (*static_cast<const F*>(f))(b0, b1); };
  parallel_for_range(begin, end, grain, run, &body);
}

// A matrix of `rows` x `cols` values, rows `stride` values apart, each row contiguous.
template <class T>
struct Rows {
  T* data;
  int64_t rows, cols, stride;
  T* row(int64_t i) const { return data + i * stride; }
};
using In = Rows<const float>;
using Out = Rows<float>;

// One linear's weight: bfloat16 [rows, cols] (qtype -1), or raw GGUF blocks [rows, cols bytes] of
// GGML type qtype (quant.h), contiguous; bias float32 [rows] or nullptr.
struct Weight {
  const void* data;
  int64_t rows, cols, qtype;
  const float* bias;
};

}  // namespace cadenza
