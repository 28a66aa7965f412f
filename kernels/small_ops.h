// The small fused ops of a decoder layer: RMSNorm, rotary embedding in place, SiLU * up.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "linear.h"
#include "simd.h"

namespace cadenza {

// RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * weight, rows in parallel.
inline torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_f32_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  check_f32_rows(weight, "weight");
  const int64_t K = x.size(-1), rows = x.numel() / K;
  TORCH_CHECK(weight.numel() == K, "weight has ", weight.numel(), " elements, x rows have ", K);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * K;
      float* orow = op + r * K;
      const float inv = 1.0f / std::sqrt(dot(xr, xr, K) / static_cast<float>(K) + static_cast<float>(eps));
      const __m256 iv = _mm256_set1_ps(inv);
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(orow + k, _mm256_mul_ps(_mm256_loadu_ps(wp + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), iv)));
      for (; k < K; ++k) orow[k] = wp[k] * (xr[k] * inv);
    }
  });
  return out;
}

// In-place rotary embedding in the half-split (NeoX) layout on x [T, heads, D] (head stride D),
// with cos/sin looked up from [max_positions, D] tables at `positions` [T].
inline void rotary_(torch::Tensor x, const torch::Tensor& positions, const torch::Tensor& cos_table,
                    const torch::Tensor& sin_table) {
  check_f32_rows(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(1) == x.size(2), "x must be [tokens, heads, head_dim] with packed heads");
  TORCH_CHECK(cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.scalar_type() == torch::kFloat32 &&
                  sin_table.scalar_type() == torch::kFloat32 && cos_table.size(1) == x.size(2),
              "cos/sin tables must be contiguous float32 [positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be contiguous int64 [tokens]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, ts = x.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_table.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " out of range");
  float* xp = x.data_ptr<float>();
  const float* cp = cos_table.data_ptr<float>();
  const float* sp = sin_table.data_ptr<float>();
  at::parallel_for(0, T * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H;
      float* v = xp + t * ts + h * D;
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      int64_t j = 0;
      for (; j + 8 <= half; j += 8) {
        const __m256 a = _mm256_loadu_ps(v + j), b = _mm256_loadu_ps(v + half + j);
        // x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1): two products, then a sum,
        // the reference's rounding.
        const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + j)), _mm256_mul_ps(b, _mm256_loadu_ps(s + j)));
        const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + j)),
                                        _mm256_mul_ps(a, _mm256_loadu_ps(s + half + j)));
        _mm256_storeu_ps(v + j, lo);
        _mm256_storeu_ps(v + half + j, hi);
      }
      for (; j < half; ++j) {
        const float a = v[j], b = v[half + j];
        v[j] = a * c[j] - b * s[j];
        v[half + j] = b * c[half + j] + a * s[half + j];
      }
    }
  });
}

// SiLU(gate) * up for gate_up [M, 2I] -> [M, I].
inline torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_f32_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * intermediate]");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gp + m * gs;
      const float* u = g + I;
      float* o = op + m * I;
      int64_t i = 0;
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
      for (; i < I; ++i) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
  });
  return out;
}
}  // namespace cadenza
