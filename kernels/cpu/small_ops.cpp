// The small ops of small_ops.h, rows in parallel.
#include "small_ops.h"

#include <atomic>
#include <cmath>

#include "simd.h"

namespace cadenza {

void rms_norm(In x, const float* weight, double eps, Out out) {
  const int64_t K = x.cols;
  parallel_for(0, x.rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x.row(r);
      float* orow = out.row(r);
      const float inv = 1.0f / std::sqrt(dot(xr, xr, K) / static_cast<float>(K) + static_cast<float>(eps));
      const __m256 iv = _mm256_set1_ps(inv);
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(orow + k, _mm256_mul_ps(_mm256_loadu_ps(weight + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), iv)));
      for (; k < K; ++k) orow[k] = weight[k] * (xr[k] * inv);
    }
  });
}

void rotary(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride, const int64_t* positions,
            const RotaryTables& tables, int64_t head_stride) {
  const int64_t T = tokens, H = heads, D = head_dim, half = D / 2, ts = token_stride;
  const int64_t hs = head_stride > 0 ? head_stride : D;
  const int64_t* pos = positions;
  for (int64_t t = 0; t < T; ++t)
    CADENZA_CHECK(pos[t] >= 0 && pos[t] < tables.positions, "position ", pos[t], " out of range");
  parallel_for(0, T * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H;
      float* v = x + t * ts + h * hs;
      const float* c = tables.cos + pos[t] * D;
      const float* s = tables.sin + pos[t] * D;
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

namespace {

// SiLU(g) * u, 8 at a time and one at a time: the one arithmetic both silu_mul variants use.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  return _mm256_mul_ps(silu, u);
}

inline float silu_mul1(float g, float u) { return g / (1.0f + exp1(-g)) * u; }

}  // namespace

// out [rows, I] = f(gate, up) of gate_up [rows, 2I], the rows shared among the threads: `f8` on 8
// values at a time, `f1` on the rest (the same arithmetic, one lane).
template <class F8, class F1>
inline void gated_rows(In gate_up, Out out, F8 f8, F1 f1) {
  const int64_t I = gate_up.cols / 2;
  parallel_for(0, gate_up.rows, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gate_up.row(m);
      const float* u = g + I;
      float* o = out.row(m);
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, f8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      for (; i < I; ++i) o[i] = f1(g[i], u[i]);
    }
  });
}

void silu_mul(In gate_up, Out out) { gated_rows(gate_up, out, silu_mul8, silu_mul1); }

void gelu_tanh_mul(In gate_up, Out out) {
  // tanh(z) = 1 - 2 / (e^(2z) + 1), so 0.5 (1 + tanh(z)) = 1 - 1 / (e^(2z) + 1); z clamped where
  // e^(2z) would overflow (tanh is +-1 there to float precision).
  const __m256 k0 = _mm256_set1_ps(0.7978845608028654f), k1 = _mm256_set1_ps(0.044715f), one = _mm256_set1_ps(1.0f);
  const __m256 two = _mm256_set1_ps(2.0f), lim = _mm256_set1_ps(40.0f), neg_lim = _mm256_set1_ps(-40.0f);
  gated_rows(
      gate_up, out,
      [&](__m256 x, __m256 u) {
        __m256 z = _mm256_mul_ps(k0, _mm256_add_ps(x, _mm256_mul_ps(k1, _mm256_mul_ps(x, _mm256_mul_ps(x, x)))));
        z = _mm256_max_ps(_mm256_min_ps(z, lim), neg_lim);
        const __m256 half_one_plus_tanh = _mm256_sub_ps(one, _mm256_div_ps(one, _mm256_add_ps(exp8(_mm256_mul_ps(two, z)), one)));
        return _mm256_mul_ps(_mm256_mul_ps(x, half_one_plus_tanh), u);
      },
      [](float x, float u) {
        const float z = std::max(std::min(0.7978845608028654f * (x + 0.044715f * x * x * x), 40.0f), -40.0f);
        return x * (1.0f - 1.0f / (exp1(2.0f * z) + 1.0f)) * u;
      });
}

void swiglu_clamped(In gate_up, Out out, float alpha, float limit) {
  const __m256 lim = _mm256_set1_ps(limit), neg_lim = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
  const __m256 neg_alpha = _mm256_set1_ps(-alpha);
  gated_rows(
      gate_up, out,
      [&](__m256 g, __m256 u) {
        const __m256 gate = _mm256_min_ps(g, lim);
        const __m256 up = _mm256_max_ps(_mm256_min_ps(u, lim), neg_lim);
        const __m256 glu = _mm256_div_ps(gate, _mm256_add_ps(one, exp8(_mm256_mul_ps(neg_alpha, gate))));
        return _mm256_mul_ps(_mm256_add_ps(up, one), glu);
      },
      [&](float g, float u) {
        const float gate = std::min(g, limit), up = std::max(std::min(u, limit), -limit);
        return (up + 1.0f) * (gate / (1.0f + exp1(-alpha * gate)));
      });
}

void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t I, int64_t in_stride, uint16_t* out, int64_t out_stride) {
  parallel_for(0, rows, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* g = gate_up + m * in_stride;
      const uint16_t* u = g + I;
      uint16_t* o = out + m * out_stride;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), to_bf16x8(silu_mul8(load_bf16x8(g + i), load_bf16x8(u + i))));
      for (; i < I; ++i) o[i] = float_to_bf16(silu_mul1(bf16_to_float(g[i]), bf16_to_float(u[i])));
    }
  });
}

uint64_t stream_read(const uint8_t* p, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  std::atomic<uint64_t> checksum{0};
  parallel_for(0, n / kChunk, 1, [&](int64_t c0, int64_t c1) {
    // Four independent xor chains over 128 bytes a step: loads, not arithmetic, bound the loop.
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (const uint8_t* q = p + c0 * kChunk; q < p + c1 * kChunk; q += 128) {
      a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
      a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
      a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64)));
      a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 96)));
    }
    const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    const uint64_t sum = static_cast<uint64_t>(_mm256_extract_epi64(a, 0) ^ _mm256_extract_epi64(a, 1) ^
                                               _mm256_extract_epi64(a, 2) ^ _mm256_extract_epi64(a, 3));
    checksum.fetch_xor(sum, std::memory_order_relaxed);
  });
  return checksum.load();
}

}  // namespace cadenza
