// The bf16 linear of linear.h: R weight rows at a time share each load of x, M activation rows
// share each load of weights.
#include "linear.h"

#include "simd.h"

namespace cadenza {
namespace {

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

}  // namespace

void linear_bf16(In x, const uint16_t* w, int64_t N, const float* bias, Out out, bool accumulate) {
  const int64_t M = x.rows, K = x.cols, xs = x.stride, os = out.stride;
  for_each_tile(N, M, kTileRows, [&](int64_t n0, int64_t n1, int64_t m, int64_t rows) {
    const float* xm = x.row(m);
    float* om = out.row(m);
    switch (rows) {
      case 1: linear_range<1>(xm, xs, w, K, bias, om, os, accumulate, n0, n1); break;
      case 2: linear_range<2>(xm, xs, w, K, bias, om, os, accumulate, n0, n1); break;
      case 3: linear_range<3>(xm, xs, w, K, bias, om, os, accumulate, n0, n1); break;
      default: linear_range<4>(xm, xs, w, K, bias, om, os, accumulate, n0, n1); break;
    }
  });
}

}  // namespace cadenza
