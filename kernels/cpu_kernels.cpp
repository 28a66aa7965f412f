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

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

inline __m256 load_bf16x8(const uint16_t* p) {
  // bf16 is the top half of a float32: widen to 32 bits and shift left by 16 (exact).
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for float32 lanes: Cephes' expf (range reduction by ln 2 and a degree-5 polynomial),
// within 2 ulp of std::exp over the range softmax and SiLU use.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504019f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

inline float exp1(float x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, exp8(_mm256_set1_ps(x)));
  return lanes[0];
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {  // y += alpha * x
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

void check_f32_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// ---- bf16-weight linear: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) (+ residual[m, n]) ----

// R weight rows at a time share each load of x; M activation rows share each load of weights.
template <int M, int R>
void linear_rows(const float* x, int64_t x_stride, const uint16_t* w, int64_t K, const float* bias, float* out,
                 int64_t out_stride, bool accumulate, int64_t n) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const uint16_t* wr = w + n * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
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
void linear_range(const float* x, int64_t x_stride, const uint16_t* w, int64_t K, const float* bias, float* out,
                  int64_t out_stride, bool accumulate, int64_t n0, int64_t n1) {
  constexpr int R = rows_per_pass<M>();
  int64_t n = n0;
  for (; n + R <= n1; n += R) linear_rows<M, R>(x, x_stride, w, K, bias, out, out_stride, accumulate, n);
  for (; n < n1; ++n) linear_rows<M, 1>(x, x_stride, w, K, bias, out, out_stride, accumulate, n);
}

// Output features per tile: the tile's weights (at most 32 x K bf16) stay in L2 while every group
// of 4 activation rows passes over them, so DRAM sees each weight once whatever M is.
constexpr int64_t kTileRows = 32;

void linear_impl(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                 torch::Tensor& out, bool accumulate) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  // Each thread takes a contiguous run of tiles: one forward stream through W.
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, n1 = std::min(N, n0 + kTileRows);
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = xp + m * xs;
        float* om = op + m * os;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: linear_range<1>(xm, xs, wp, K, bp, om, os, accumulate, n0, n1); break;
          case 2: linear_range<2>(xm, xs, wp, K, bp, om, os, accumulate, n0, n1); break;
          case 3: linear_range<3>(xm, xs, wp, K, bp, om, os, accumulate, n0, n1); break;
          default: linear_range<4>(xm, xs, wp, K, bp, om, os, accumulate, n0, n1); break;
        }
      }
    }
  });
}

void check_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
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

}  // namespace

// x [M, K] float32 @ w [N, K] bfloat16 ^T (+ bias) -> [M, N] float32.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  check_linear(x, w, bias);
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  linear_impl(x, w, bias, out, false);
  return out;
}

// residual [M, N] += x @ w^T (+ bias), in place; returns residual.
torch::Tensor linear_bf16_add_(torch::Tensor residual, const torch::Tensor& x, const torch::Tensor& w,
                               const c10::optional<torch::Tensor>& bias) {
  check_linear(x, w, bias);
  check_f32_rows(residual, "residual");
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == x.size(0) && residual.size(1) == w.size(0),
              "residual must be [rows, out_features]");
  linear_impl(x, w, bias, residual, true);
  return residual;
}

// RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * weight, rows in parallel.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
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
void rotary_(torch::Tensor x, const torch::Tensor& positions, const torch::Tensor& cos_table,
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
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
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

// Decode attention straight from the paged cache: one query token per sequence.
// q [B, H, D]; kv_cache [2, num_blocks, block_size, KVH, D]; block_tables [B, max_blocks];
// seq_lens [B] (keys in the cache, the new token's included). Keys at positions
// [max(0, seq_len - window), seq_len) are attended (window <= 0: all). Returns [B, H, D].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                     int64_t window) {
  check_f32_rows(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(1) == q.size(2), "q must be [seqs, heads, head_dim] with packed heads");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32 && kv_cache.is_contiguous() && kv_cache.dim() == 5,
              "kv_cache must be a contiguous float32 [2, blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int64 [seqs, max_blocks], contiguous in its last dimension");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(), "seq_lens must be contiguous int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "q and kv_cache disagree on heads or head_dim");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.numel() == B, "block_tables and seq_lens need one row per sequence");
  const int64_t G = H / KVH, max_blocks = block_tables.size(1), bts = block_tables.stride(0), qs = q.stride(0);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * BS, "seq_len ", lens[b], " does not fit the block table");
    for (int64_t j = 0; j < (lens[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(tables[b * bts + j] >= 0 && tables[b * bts + j] < NB, "block id out of range");
  }
  auto out = torch::empty({B, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* keys = kv_cache.data_ptr<float>();
  const float* values = keys + NB * BS * KVH * D;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, kvh = i % KVH, len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - start;
      const int64_t* table = tables + b * bts;
      scores.resize(static_cast<size_t>(G * n));
      // Scores for the group's G query heads, reading each key once.
      for (int64_t t = start; t < len; ++t) {
        const float* key = keys + ((table[t / BS] * BS + t % BS) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * n + (t - start)] = dot(qp + b * qs + (kvh * G + g) * D, key, D) * fscale;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * n;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
        float mx = hmax(mv);
        for (; j < n; ++j) mx = std::max(mx, s[j]);
        const __m256 m8 = _mm256_set1_ps(mx);
        __m256 sv = _mm256_setzero_ps();
        for (j = 0; j + 8 <= n; j += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
          _mm256_storeu_ps(s + j, e);
          sv = _mm256_add_ps(sv, e);
        }
        float sum = hsum(sv);
        for (; j < n; ++j) {
          s[j] = exp1(s[j] - mx);
          sum += s[j];
        }
        const float inv = 1.0f / sum;
        for (j = 0; j < n; ++j) s[j] *= inv;
        float* o = op + (b * H + kvh * G + g) * D;
        std::fill(o, o + D, 0.0f);
      }
      for (int64_t t = start; t < len; ++t) {
        const float* value = values + ((table[t / BS] * BS + t % BS) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + (t - start)], value, op + (b * H + kvh * G + g) * D, D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: let the event loop's thread run while they compute.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("linear_bf16", &linear_bf16, "x float32 @ w bfloat16^T (+ bias) -> float32", release());
  m.def("linear_bf16_add_", &linear_bf16_add_, "residual += x @ w^T (+ bias), in place", release());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, float32", release());
  m.def("rotary_", &rotary_, "in-place NeoX rotary embedding from cos/sin tables", release());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up for a fused [rows, 2 * I] gate_up", release());
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token-per-sequence attention over a paged KV cache", release());
}
