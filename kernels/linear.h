// bf16-weight linear for float32 activations: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])
// (+ residual[m, n]). Float32 accumulation: the exact float32 product of the bf16 weights.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "simd.h"

namespace cadenza {

inline void check_f32_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// R weight rows at a time share each load of x; M activation rows share each load of weights.
template <int M, int R>
inline void linear_rows(const float* x, int64_t x_stride, const uint16_t* w, int64_t K, const float* bias,
                        float* out, int64_t out_stride, bool accumulate, int64_t n) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const uint16_t* wr = w + n * K;
  // The next R rows follow these in memory: fetch them while these compute. Without it a core
  // waits on DRAM at each new group of short rows (measured +25-80% GB/s on 2 threads, AVX2).
  // Prefetches never fault, so running past the weight's end is harmless.
  const char* next = reinterpret_cast<const char*>(wr + R * K);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    _mm_prefetch(next + k * R * 2, _MM_HINT_T0);  // R*16 bytes of the next group per 16 bytes of a row
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_bf16x8(wr + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * x_stride + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * x_stride + kk] * bf16_to_float(wr[r * K + kk]);
      if (bias != nullptr) s += bias[n + r];
      float* o = out + m * out_stride + n + r;
      *o = accumulate ? *o + s : s;
    }
  }
}

// 16 ymm registers hold R x M accumulators, R weight vectors and one x vector.
template <int M>
constexpr int rows_per_pass() { return M >= 3 ? 3 : 4; }

template <int M>
inline void linear_range(const float* x, int64_t x_stride, const uint16_t* w, int64_t K, const float* bias, float* out,
                         int64_t out_stride, bool accumulate, int64_t n0, int64_t n1) {
  constexpr int R = rows_per_pass<M>();
  int64_t n = n0;
  for (; n + R <= n1; n += R) linear_rows<M, R>(x, x_stride, w, K, bias, out, out_stride, accumulate, n);
  for (; n < n1; ++n) linear_rows<M, 1>(x, x_stride, w, K, bias, out, out_stride, accumulate, n);
}

// Output features per tile: the tile's weights (at most 32 x K bf16) stay in L2 while every group
// of 4 activation rows passes over them, so DRAM sees each weight once whatever M is.
constexpr int64_t kTileRows = 32;

// Calls body(n0, n1, m, rows) for every tile [n0, n1) of `tile_rows` output features of N and every
// group of `rows` (at most `pass_rows`) activation rows starting at m, over the intra-op threads. Threads
// claim runs of tiles from a shared counter rather than a fixed half each: a thread that starts
// late (woken from its spin, or sharing its core) would otherwise leave the other waiting at the
// end of every product (a fifth of a batch-1 step was spent so). A run is one forward stream
// through the weights, long enough for the prefetcher, short enough to balance.
template <class Body>
inline void for_each_tile(int64_t N, int64_t M, int64_t tile_rows, Body&& body, int64_t pass_rows = 4) {
  // Passes of even size (9 rows at 8 a pass: 5 + 4, not 8 + 1): as many passes, and no pass of one
  // row whose multiply-adds wait on each other.
  const int64_t passes = (M + pass_rows - 1) / pass_rows;
  pass_rows = std::max<int64_t>(1, (M + passes - 1) / std::max<int64_t>(1, passes));
  const int64_t tiles = (N + tile_rows - 1) / tile_rows;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles));
  const int64_t run = std::max<int64_t>(1, tiles / (threads * 8));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t0; (t0 = next.fetch_add(run, std::memory_order_relaxed)) < tiles;) {
      for (int64_t t = t0; t < std::min(tiles, t0 + run); ++t) {
        const int64_t n0 = t * tile_rows, n1 = std::min(N, n0 + tile_rows);
        for (int64_t m = 0; m < M; m += pass_rows) body(n0, n1, m, std::min<int64_t>(pass_rows, M - m));
      }
    }
  });
}

inline void linear_impl(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                        torch::Tensor& out, bool accumulate) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  for_each_tile(N, M, kTileRows, [&](int64_t n0, int64_t n1, int64_t m, int64_t rows) {
    const float* xm = xp + m * xs;
    float* om = op + m * os;
    switch (rows) {
      case 1: linear_range<1>(xm, xs, wp, K, bp, om, os, accumulate, n0, n1); break;
      case 2: linear_range<2>(xm, xs, wp, K, bp, om, os, accumulate, n0, n1); break;
      case 3: linear_range<3>(xm, xs, wp, K, bp, om, os, accumulate, n0, n1); break;
      default: linear_range<4>(xm, xs, wp, K, bp, om, os, accumulate, n0, n1); break;
    }
  });
}

inline void check_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  check_f32_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2,
              "weight must be a contiguous bfloat16 [out_features, in_features] tensor");
  TORCH_CHECK(w.size(1) == x.size(1), "x has ", x.size(1), " features, the weight expects ", w.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == w.size(0),
                "bias must be a contiguous float32 [out_features] tensor");
  }
}

// `linear_bf16` without the input checks, for callers that validated the weights once and build
// the inputs themselves (decode_layer.h).
inline torch::Tensor linear_unchecked(const torch::Tensor& x, const torch::Tensor& w,
                                      const c10::optional<torch::Tensor>& bias) {
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  linear_impl(x, w, bias, out, false);
  return out;
}

// x [M, K] float32 @ w [N, K] bfloat16 ^T (+ bias) -> [M, N] float32.
inline torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w,
                                 const c10::optional<torch::Tensor>& bias) {
  check_linear(x, w, bias);
  return linear_unchecked(x, w, bias);
}

// residual [M, N] += x @ w^T (+ bias), in place; returns residual.
inline torch::Tensor linear_bf16_add_(torch::Tensor residual, const torch::Tensor& x, const torch::Tensor& w,
                                      const c10::optional<torch::Tensor>& bias) {
  check_linear(x, w, bias);
  check_f32_rows(residual, "residual");
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == x.size(0) && residual.size(1) == w.size(0),
              "residual must be [rows, out_features]");
  linear_impl(x, w, bias, residual, true);
  return residual;
}

}  // namespace cadenza
