// cadenza's CPU kernels for x86-64 with AVX2 and FMA, bound to Python: the hot ops of a decode step.
//
// PyTorch's bfloat16 matrix-vector product on CPUs without native bf16 reads weights at about
// half the memory bandwidth, and a decode step spends more time dispatching small ops than
// computing them. These kernels read bf16 weights once at full speed with float32 arithmetic,
// and fuse the small ops (norm, rotary, paged attention, SiLU) into one call each.
//
// Every kernel takes and returns float32 activations; results match the PyTorch reference ops up
// to float32 rounding (accumulation order differs). Threads: ATen's intra-op pool (at::parallel_for,
// lent to the kernels below), built with the same OpenMP runtime PyTorch ships, so no second
// thread team appears.
//
// This is the one unit that includes torch, and only the headers it uses (<torch/extension.h>
// alone took 20 s to compile): each function checks its tensors (dtype, shape, strides, the
// messages Python sees) and hands their pointers to the kernels, plain C++ in the units beside it
// (kernels.h): linear.cpp, small_ops.cpp, paged_attention.cpp, decode_layer.cpp, quant.cpp (GGUF
// blocks) and the products over GGUF blocks re-laid a group of rows at a time: quant_packed.cpp
// (16 rows, AVX-512 VNNI) or quant_packed8.cpp (8 rows, AVX2 or AVX-VNNI), as the build variant says.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <sched.h>

#include <atomic>
#include <optional>
#include <tuple>
#include <vector>

#include "decode_layer.h"
#include "kernels.h"
#include "linear.h"
#include "moe.h"
#include "paged_attention.h"
#include "quant.h"
#include "small_ops.h"

namespace cadenza {

void parallel_for_range(int64_t begin, int64_t end, int64_t grain, RangeBody run, const void* body) {
  at::parallel_for(begin, end, grain, [run, body](int64_t b0, int64_t b1) { run(body, b0, b1); });
}

int64_t num_threads() { return at::get_num_threads(); }

}  // namespace cadenza

namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

// ---- tensors to the kernels' shapes (after the checks below)

cadenza::In in_rows(const Tensor& t) { return {t.data_ptr<float>(), t.size(0), t.size(1), t.stride(0)}; }
cadenza::Out out_rows(const Tensor& t) { return {t.data_ptr<float>(), t.size(0), t.size(1), t.stride(0)}; }
cadenza::Heads heads(const Tensor& t) { return {t.data_ptr<float>(), t.size(0), t.size(1), t.size(2), t.stride(0)}; }
const float* bias_of(const OptionalTensor& bias) { return bias.has_value() ? bias->data_ptr<float>() : nullptr; }
cadenza::Weight weight(const Tensor& w, int64_t qtype, const OptionalTensor& bias) {
  return {w.data_ptr(), w.size(0), w.size(1), qtype, bias_of(bias)};
}

// ---- checks

void check_f32_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

void check_bias(const OptionalTensor& bias, int64_t out_features) {
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_features,
                "bias must be a contiguous float32 [out_features] tensor");
  }
}

void check_linear(const Tensor& x, const Tensor& w, const OptionalTensor& bias) {
  check_f32_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2,
              "weight must be a contiguous bfloat16 [out_features, in_features] tensor");
  TORCH_CHECK(w.size(1) == x.size(1), "x has ", x.size(1), " features, the weight expects ", w.size(1));
  check_bias(bias, w.size(0));
}

void check_blocks(const Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
              "quantized weight must be a contiguous uint8 CPU tensor [out_features, bytes_per_row]");
}

void check_rotary_tables(const Tensor& cos_table, const Tensor& sin_table, int64_t head_dim) {
  TORCH_CHECK(cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.scalar_type() == at::kFloat &&
                  sin_table.scalar_type() == at::kFloat && cos_table.size(1) == head_dim,
              "cos/sin tables must be contiguous float32 [positions, head_dim]");
}

void check_positions(const Tensor& positions, int64_t tokens) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == tokens,
              "positions must be contiguous int64 [tokens]");
}

// A float cache: kv_cache [2, num_blocks, block_size, KVH, D] in float32, bfloat16 or float16.
cadenza::KvCache float_cache(const Tensor& kv_cache) {
  const auto t = kv_cache.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) && kv_cache.is_contiguous() &&
                  kv_cache.dim() == 5,
              "kv_cache must be a contiguous float32, bfloat16 or float16 [2, blocks, block_size, kv_heads, head_dim] tensor");
  const auto type = t == at::kBFloat16 ? cadenza::KvType::kBFloat16
                    : t == at::kHalf   ? cadenza::KvType::kFloat16
                                       : cadenza::KvType::kFloat32;
  return {kv_cache.data_ptr(), nullptr, type, kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), kv_cache.size(4)};
}

// The int8 cache: kv_data [2, num_blocks, block_size, KVH, D] int8 and kv_scales
// [2, num_blocks, block_size, KVH] float16.
cadenza::KvCache int8_cache(const Tensor& data, const Tensor& scales) {
  TORCH_CHECK(data.scalar_type() == at::kChar && data.is_contiguous() && data.dim() == 5,
              "kv_data must be a contiguous int8 [2, blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.sizes() == data.sizes().slice(0, 4),
              "kv_scales must be a contiguous float16 [2, blocks, block_size, kv_heads] tensor");
  return {data.data_ptr(), static_cast<uint16_t*>(scales.data_ptr()), cadenza::KvType::kInt8,
          data.size(1), data.size(2), data.size(3), data.size(4)};
}

// Queries [B, H, Dq] against a cache of KVH heads of D, read through block_tables and seq_lens.
void check_decode_shapes(int64_t B, int64_t H, int64_t Dq, const Tensor& block_tables, const Tensor& seq_lens,
                         const cadenza::KvCache& cache) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int64 [seqs, max_blocks], contiguous in its last dimension");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens must be contiguous int64");
  TORCH_CHECK(cache.head_dim == Dq && H % cache.kv_heads == 0, "q and kv_cache disagree on heads or head_dim");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.numel() == B, "block_tables and seq_lens need one row per sequence");
}

void check_decode_args(const Tensor& q, const Tensor& block_tables, const Tensor& seq_lens,
                       const cadenza::KvCache& cache) {
  check_f32_rows(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(1) == q.size(2), "q must be [seqs, heads, head_dim] with packed heads");
  check_decode_shapes(q.size(0), q.size(1), q.size(2), block_tables, seq_lens, cache);
}

cadenza::BlockTables tables_of(const Tensor& block_tables, const Tensor& seq_lens) {
  return {block_tables.data_ptr<int64_t>(), block_tables.size(0), block_tables.size(1), block_tables.stride(0),
          seq_lens.data_ptr<int64_t>()};
}

void check_kv_heads(bool fits) {
  TORCH_CHECK(fits, "k and v must be [tokens, kv_heads, head_dim] with packed heads, matching the cache");
}

void check_slot_mapping(const Tensor& slot_mapping, int64_t tokens) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == tokens,
              "slot_mapping must be contiguous int64 [tokens]");
}

// k, v [T, KVH, D] with packed heads, matching the cache, and a slot per token.
void check_kv_write(const Tensor& k, const Tensor& v, const cadenza::KvCache& cache, const Tensor& slot_mapping) {
  check_f32_rows(k, "k");
  check_f32_rows(v, "v");
  const int64_t T = k.size(0), KVH = cache.kv_heads, D = cache.head_dim;
  check_kv_heads(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == KVH && k.size(2) == D && k.stride(1) == D &&
                 v.stride(1) == D);
  check_slot_mapping(slot_mapping, T);
}

// ---- the functions Python calls

// x [M, K] float32 @ w [N, K] bfloat16 ^T (+ bias) -> [M, N] float32.
Tensor linear_bf16(const Tensor& x, const Tensor& w, const OptionalTensor& bias) {
  check_linear(x, w, bias);
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  cadenza::linear_bf16(in_rows(x), static_cast<const uint16_t*>(w.data_ptr()), w.size(0), bias_of(bias), out_rows(out),
                       false);
  return out;
}

// residual [M, N] += x @ w^T (+ bias), in place; returns residual.
Tensor linear_bf16_add_(Tensor residual, const Tensor& x, const Tensor& w, const OptionalTensor& bias) {
  check_linear(x, w, bias);
  check_f32_rows(residual, "residual");
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == x.size(0) && residual.size(1) == w.size(0),
              "residual must be [rows, out_features]");
  cadenza::linear_bf16(in_rows(x), static_cast<const uint16_t*>(w.data_ptr()), w.size(0), bias_of(bias),
                       out_rows(residual), true);
  return residual;
}

int64_t quant_in_features(const Tensor& w, int64_t qtype) {
  check_blocks(w);
  return cadenza::quant_in_features(w.size(0), w.size(1), qtype);
}

// out [M, N] (+)= x [M, K] @ W^T (+ bias) for raw GGUF blocks W: the checks.
void check_quant_matmul(const Tensor& out, const Tensor& x, const Tensor& w, int64_t qtype,
                        const OptionalTensor& bias) {
  check_f32_rows(x, "x");
  check_f32_rows(out, "out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x and out must be 2-D");
  const int64_t K = quant_in_features(w, qtype), M = x.size(0), N = w.size(0);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight expects ", K);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be [rows, out_features]");
  check_bias(bias, N);
}

// out [M, N] (+)= x [M, K] @ W^T (+ bias); out may be a column slice of a wider tensor.
void quant_matmul_(Tensor out, const Tensor& x, const Tensor& w, int64_t qtype, const OptionalTensor& bias,
                   bool accumulate) {
  check_quant_matmul(out, x, w, qtype, bias);
  cadenza::quant_matmul(in_rows(x), weight(w, qtype, bias), out_rows(out), accumulate);
}

// x [M, K] float32 @ W^T (+ bias) -> [M, N] float32.
Tensor quant_linear(const Tensor& x, const Tensor& w, int64_t qtype, const OptionalTensor& bias) {
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  quant_matmul_(out, x, w, qtype, bias, false);
  return out;
}

// residual [M, N] += x @ W^T (+ bias), in place; returns residual.
Tensor quant_linear_add_(Tensor residual, const Tensor& x, const Tensor& w, int64_t qtype, const OptionalTensor& bias) {
  quant_matmul_(residual, x, w, qtype, bias, true);
  return residual;
}

// Rows `ids` [T] of W, de-quantized: float32 [T, in_features] (an embedding lookup).
Tensor quant_rows(const Tensor& w, int64_t qtype, const Tensor& ids) {
  const int64_t K = quant_in_features(w, qtype);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be a 1-D int64 tensor");
  const Tensor idc = ids.contiguous();
  auto out = at::empty({idc.numel(), K}, at::dtype(at::kFloat));
  cadenza::quant_rows(weight(w, qtype, std::nullopt), idc.data_ptr<int64_t>(), idc.numel(), out.data_ptr<float>());
  return out;
}

// The whole weight de-quantized into out, float32 or bfloat16 [N, in_features]; returns out.
Tensor quant_dequantize_(Tensor out, const Tensor& w, int64_t qtype) {
  const int64_t K = quant_in_features(w, qtype), N = w.size(0);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || out.scalar_type() == at::kFloat) && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
                  out.size(1) == K,
              "out must be a contiguous float32 or bfloat16 [out_features, in_features] tensor");
  cadenza::quant_dequantize(weight(w, qtype, std::nullopt), out.data_ptr(), bf16);
  return out;
}

Tensor quant_dequantize(const Tensor& w, int64_t qtype) {
  return quant_dequantize_(at::empty({w.size(0), quant_in_features(w, qtype)}, at::dtype(at::kFloat)), w, qtype);
}

// The weight w [N, row_bytes] of GGML type qtype, packed (same shape; N a multiple of pack_rows()).
Tensor quant_pack(const Tensor& w, int64_t qtype) {
  check_blocks(w);
  auto out = at::empty_like(w);
  cadenza::quant_pack(static_cast<const uint8_t*>(w.data_ptr()), w.size(0), w.size(1), qtype,
                      static_cast<uint8_t*>(out.data_ptr()));
  return out;
}

// The xor of x's bytes (whole 64 KiB chunks), read by every thread at once: the memory read rate.
int64_t stream_read(const Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x must be a contiguous CPU tensor");
  return static_cast<int64_t>(cadenza::stream_read(static_cast<const uint8_t*>(x.data_ptr()), x.nbytes()));
}

// RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * weight, rows in parallel.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_f32_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  check_f32_rows(weight, "weight");
  const int64_t K = x.size(-1), rows = x.numel() / K;
  TORCH_CHECK(weight.numel() == K, "weight has ", weight.numel(), " elements, x rows have ", K);
  auto out = at::empty_like(x);
  cadenza::rms_norm({x.data_ptr<float>(), rows, K, K}, weight.data_ptr<float>(), eps,
                    {out.data_ptr<float>(), rows, K, K});
  return out;
}

// In-place rotary embedding in the half-split (NeoX) layout on x [T, heads, D] (head stride D),
// with cos/sin looked up from [max_positions, D] tables at `positions` [T].
void rotary_(Tensor x, const Tensor& positions, const Tensor& cos_table, const Tensor& sin_table) {
  check_f32_rows(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(1) == x.size(2), "x must be [tokens, heads, head_dim] with packed heads");
  check_rotary_tables(cos_table, sin_table, x.size(2));
  check_positions(positions, x.size(0));
  cadenza::rotary(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0), positions.data_ptr<int64_t>(),
                  {cos_table.data_ptr<float>(), sin_table.data_ptr<float>(), cos_table.size(0)});
}

// SiLU(gate) * up for gate_up [M, 2I] -> [M, I].
Tensor silu_mul(const Tensor& gate_up) {
  check_f32_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * intermediate]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  cadenza::silu_mul(in_rows(gate_up), out_rows(out));
  return out;
}

// The same for a bfloat16 gate_up (rows of unit stride), into a bfloat16 [M, I].
Tensor silu_mul_bf16(const Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                  gate_up.stride(1) == 1,
              "gate_up must be bfloat16 [rows, 2 * intermediate] with rows of unit stride");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  cadenza::silu_mul_bf16(reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), gate_up.size(0), out.size(1),
                         gate_up.stride(0), reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0));
  return out;
}

// Attention sinks (gpt-oss): float32 [H], or None.
const float* sinks_of(const std::optional<Tensor>& sinks, const Tensor& q) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == q.size(1) &&
                  sinks->is_contiguous(),
              "sinks must be float32 [heads], contiguous");
  return sinks->data_ptr<float>();
}

// q [B, H, D]; kv_cache [2, num_blocks, block_size, KVH, D]; block_tables [B, max_blocks]; seq_lens
// [B] (keys in the cache, the new token's included); sinks [H] or None. Returns [B, H, D].
Tensor paged_decode_attention(const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables, const Tensor& seq_lens,
                              double scale, int64_t window, const std::optional<Tensor>& sinks) {
  const cadenza::KvCache cache = float_cache(kv_cache);
  check_decode_args(q, block_tables, seq_lens, cache);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  cadenza::paged_decode_attention(heads(q), cache, tables_of(block_tables, seq_lens), scale, window,
                                  out.data_ptr<float>(), sinks_of(sinks, q));
  return out;
}

Tensor paged_decode_attention_int8(const Tensor& q, const Tensor& kv_data, const Tensor& kv_scales,
                                   const Tensor& block_tables, const Tensor& seq_lens, double scale, int64_t window,
                                   const std::optional<Tensor>& sinks) {
  const cadenza::KvCache cache = int8_cache(kv_data, kv_scales);
  check_decode_args(q, block_tables, seq_lens, cache);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  cadenza::paged_decode_attention(heads(q), cache, tables_of(block_tables, seq_lens), scale, window,
                                  out.data_ptr<float>(), sinks_of(sinks, q));
  return out;
}

// Store the step's keys and values k, v [T, KVH, D] (packed heads, any row stride: views of the
// fused projection) at their cache slots.
void write_kv_(Tensor kv_cache, const Tensor& k, const Tensor& v, const Tensor& slot_mapping) {
  const cadenza::KvCache cache = float_cache(kv_cache);
  check_kv_write(k, v, cache, slot_mapping);
  cadenza::write_kv(cache, heads(k), heads(v), slot_mapping.data_ptr<int64_t>());
}

void write_kv_int8_(Tensor kv_data, Tensor kv_scales, const Tensor& k, const Tensor& v, const Tensor& slot_mapping) {
  const cadenza::KvCache cache = int8_cache(kv_data, kv_scales);
  check_kv_write(k, v, cache, slot_mapping);
  cadenza::write_kv(cache, heads(k), heads(v), slot_mapping.data_ptr<int64_t>());
}

// One projection of a layer: a bf16 weight [out, in] (qtype -1), or raw GGUF blocks.
struct Projection {
  Tensor w;
  OptionalTensor bias;
  int64_t qtype;

  int64_t out_features() const { return w.size(0); }
  int64_t in_features() const { return qtype < 0 ? w.size(1) : quant_in_features(w, qtype); }

  void check(int64_t in_features) const {
    const auto probe = at::empty({1, in_features}, at::dtype(at::kFloat));
    if (qtype < 0) check_linear(probe, w, bias);
    else check_quant_matmul(at::empty({1, w.size(0)}, probe.options()), probe, w, qtype, bias);
  }

  cadenza::Weight plain() const { return weight(w, qtype, bias); }
};

// A mixture's experts (moe.h), held by reference and checked once: each expert's gate_up [2I, H]
// and down [H, I] raw GGUF blocks of its own type (packed or not), with float32 biases [2I] and
// [H] where given (gpt-oss), and the clamped SwiGLU where swiglu_limit > 0.
class MoEKernel {
 public:
  MoEKernel(std::vector<Tensor> gate_up, std::vector<int64_t> gate_up_types, std::vector<Tensor> down,
            std::vector<int64_t> down_types, int64_t hidden, std::optional<std::vector<Tensor>> gate_up_bias,
            std::optional<std::vector<Tensor>> down_bias, double swiglu_alpha, double swiglu_limit)
      : gate_up_(std::move(gate_up)), down_(std::move(down)), hidden_(hidden),
        gate_up_bias_(gate_up_bias.value_or(std::vector<Tensor>{})), down_bias_(down_bias.value_or(std::vector<Tensor>{})),
        act_{static_cast<float>(swiglu_alpha), static_cast<float>(swiglu_limit)} {
    TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size() && gate_up_types.size() == gate_up_.size() &&
                    down_types.size() == down_.size(),
                "one gate_up, one down and their types for each expert");
    TORCH_CHECK(gate_up_bias_.empty() || gate_up_bias_.size() == gate_up_.size(), "one gate_up bias for each expert");
    TORCH_CHECK(down_bias_.empty() || down_bias_.size() == down_.size(), "one down bias for each expert");
    for (size_t e = 0; e < gate_up_.size(); ++e) {
      const OptionalTensor up_bias = gate_up_bias_.empty() ? OptionalTensor{} : OptionalTensor{gate_up_bias_[e]};
      const Projection up{gate_up_[e], up_bias, gate_up_types[e]}, dn{down_[e], std::nullopt, down_types[e]};
      if (!down_bias_.empty()) {
        const Tensor& b = down_bias_[e];
        TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.dim() == 1 && b.size(0) == hidden,
                    "expert ", e, ": the down bias must be float32 [", hidden, "]");
        down_bias_ptrs_.push_back(b.data_ptr<float>());
      }
      TORCH_CHECK(gate_up_types[e] >= 0 && down_types[e] >= 0, "experts must be raw GGUF blocks");
      up.check(hidden);
      dn.check(up.out_features() / 2);
      TORCH_CHECK(dn.out_features() == hidden && up.out_features() % 2 == 0, "expert ", e, ": gate_up [2I, ", hidden,
                  "] and down [", hidden, ", I]");
      weights_up_.push_back(up.plain());
      weights_down_.push_back(dn.plain());
    }
  }

  // residual [T, H] += the mixture's output for x [T, H], given the router's picks ids [T, k]
  // (int64) and their weights [T, k] (float32).
  Tensor add_(Tensor residual, const Tensor& x, const Tensor& ids, const Tensor& weights) const {
    check_f32_rows(x, "x");
    check_f32_rows(residual, "residual");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && residual.sizes() == x.sizes(), "x and residual must be [T, ",
                hidden_, "]");
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 2 && ids.size(0) == x.size(0),
                "ids must be a contiguous int64 [T, k] tensor");
    TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes(),
                "weights must be a contiguous float32 tensor shaped as ids");
    cadenza::moe_experts_add(in_rows(x), ids.data_ptr<int64_t>(), weights.data_ptr<float>(), ids.size(1),
                             weights_up_.data(), weights_down_.data(),
                             down_bias_ptrs_.empty() ? nullptr : down_bias_ptrs_.data(),
                             static_cast<int64_t>(weights_up_.size()), act_, out_rows(residual));
    return residual;
  }

 private:
  std::vector<Tensor> gate_up_, down_;
  std::vector<cadenza::Weight> weights_up_, weights_down_;
  int64_t hidden_;
  std::vector<Tensor> gate_up_bias_, down_bias_;  // held: the weights and pointers below point into them
  std::vector<const float*> down_bias_ptrs_;
  cadenza::ExpertActivation act_;
};

// A decoder layer's tensors, held by reference (nothing is copied) and checked once; the kernel
// (decode_layer.h) reads them through their pointers, taken on each call as PyTorch's ops would.
class DecoderLayerKernel {
 public:
  // Weights are the model's own tensors (bf16 [out, in] projections or raw GGUF blocks, see
  // `Projection`; float32 norms and biases). The *_type arguments are each projection's GGML
  // type, -1 for bf16.
  DecoderLayerKernel(Tensor input_norm, Tensor qkv_weight, OptionalTensor qkv_bias, Tensor o_weight,
                     OptionalTensor o_bias, Tensor post_norm, OptionalTensor gate_up_weight, OptionalTensor gate_up_bias,
                     OptionalTensor down_weight, OptionalTensor down_bias, Tensor cos_table, Tensor sin_table,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, int64_t qkv_type,
                     int64_t o_type, int64_t gate_up_type, int64_t down_type, OptionalTensor q_norm,
                     OptionalTensor k_norm, int64_t rotary_dims, double residual_scale, OptionalTensor attn_out_norm,
                     OptionalTensor mlp_out_norm, int64_t activation, std::vector<Tensor> qkv_more,
                     std::vector<int64_t> qkv_more_types)
      : input_norm_(std::move(input_norm)), post_norm_(std::move(post_norm)), q_norm_(std::move(q_norm)),
        k_norm_(std::move(k_norm)), attn_out_norm_(std::move(attn_out_norm)), mlp_out_norm_(std::move(mlp_out_norm)),
        cos_table_(std::move(cos_table)),
        sin_table_(std::move(sin_table)), qkv_{std::move(qkv_weight), std::move(qkv_bias), qkv_type},
        o_{std::move(o_weight), std::move(o_bias), o_type},
        gate_up_{gate_up_weight.has_value() ? *gate_up_weight : at::empty({0, 0}), std::move(gate_up_bias), gate_up_type},
        down_{down_weight.has_value() ? *down_weight : at::empty({0, 0}), std::move(down_bias), down_type},
        has_mlp_(gate_up_weight.has_value()), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        rotary_dims_(rotary_dims < 0 ? head_dim : rotary_dims), residual_scale_(static_cast<float>(residual_scale)),
        activation_(activation) {
    TORCH_CHECK(rotary_dims_ >= 0 && rotary_dims_ <= head_dim && rotary_dims_ % 2 == 0,
                "rotary_dims must be even and at most head_dim (0: no rotary)");
    TORCH_CHECK(activation == 0 || activation == 1, "activation must be 0 (SiLU) or 1 (GELU tanh)");
    const int64_t hidden = input_norm_.numel(), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    TORCH_CHECK(qkv_more.size() == qkv_more_types.size(), "one type for each further qkv part");
    // A fused projection stored in parts: each part's rows after the last's, its bias the slice of
    // qkv_bias at its rows.
    const OptionalTensor whole_bias = qkv_.bias;
    int64_t rows = qkv_.out_features();
    if (!qkv_more.empty() && whole_bias.has_value()) qkv_.bias = whole_bias->narrow(0, 0, rows);
    for (size_t k = 0; k < qkv_more.size(); ++k) {
      const int64_t part_rows = qkv_more[k].size(0);
      OptionalTensor bias;
      if (whole_bias.has_value()) bias = whole_bias->narrow(0, rows, part_rows);
      qkv_more_.push_back(Projection{qkv_more[k], bias, qkv_more_types[k]});
      rows += part_rows;
    }
    TORCH_CHECK(qkv_.w.dim() == 2 && rows == q_size + 2 * kv_size && qkv_.in_features() == hidden,
                "qkv weight (its parts together) must be [q_size + 2 * kv_size, hidden]");
    TORCH_CHECK(o_.w.dim() == 2 && o_.out_features() == hidden && o_.in_features() == q_size,
                "o_proj weight must be [hidden, q_size]");
    TORCH_CHECK(gate_up_weight.has_value() == down_weight.has_value(), "gate_up and down come together or not at all");
    if (has_mlp_) {
      TORCH_CHECK(gate_up_.w.dim() == 2 && gate_up_.in_features() == hidden && gate_up_.out_features() % 2 == 0,
                  "gate_up weight must be [2 * intermediate, hidden]");
      TORCH_CHECK(down_.w.dim() == 2 && down_.out_features() == hidden &&
                      2 * down_.in_features() == gate_up_.out_features(),
                  "down_proj weight must be [hidden, intermediate]");
    }
    TORCH_CHECK(post_norm_.numel() == hidden, "the two norms must have one weight per hidden feature");
    for (const OptionalTensor* norm : {&attn_out_norm_, &mlp_out_norm_}) {
      if (norm->has_value())
        TORCH_CHECK((*norm)->scalar_type() == at::kFloat && (*norm)->is_contiguous() && (*norm)->numel() == hidden,
                    "output norms must be contiguous float32 [hidden] tensors");
    }
    TORCH_CHECK(q_norm_.has_value() == k_norm_.has_value(), "q and k norms come together or not at all");
    if (q_norm_.has_value()) {
      for (const Tensor* norm : {&*q_norm_, &*k_norm_}) {
        TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == head_dim,
                    "q and k norms must be contiguous float32 [head_dim] tensors");
      }
    }
    // Every product is checked once here rather than on each call.
    qkv_.check(hidden);
    for (const Projection& part : qkv_more_) {
      part.check(hidden);
      qkv_more_plain_.push_back(part.plain());
    }
    o_.check(q_size);
    if (has_mlp_) {
      gate_up_.check(hidden);
      down_.check(down_.in_features());
    }
    // The norms and tables are checked on each call (`check_attention_input`, `check_post_norm`).
  }

  // The layer as the kernel reads it: the call's checks say which parts it may read.
  cadenza::DecoderLayer layer() const {
    const auto floats = [](const Tensor& t) { return static_cast<const float*>(t.data_ptr()); };
    return {floats(input_norm_),
            floats(post_norm_),
            q_norm_.has_value() ? floats(*q_norm_) : nullptr,
            k_norm_.has_value() ? floats(*k_norm_) : nullptr,
            qkv_.plain(),
            o_.plain(),
            has_mlp_ ? gate_up_.plain() : cadenza::Weight{nullptr, 0, 0, -1, nullptr},
            has_mlp_ ? down_.plain() : cadenza::Weight{nullptr, 0, 0, -1, nullptr},
            qkv_more_plain_.empty() ? nullptr : qkv_more_plain_.data(),
            static_cast<int64_t>(qkv_more_plain_.size()),
            {floats(cos_table_), floats(sin_table_), cos_table_.dim() > 0 ? cos_table_.size(0) : 0},
            input_norm_.numel(),
            num_heads_,
            num_kv_heads_,
            head_dim_,
            eps_,
            rotary_dims_,
            residual_scale_,
            attn_out_norm_.has_value() ? floats(*attn_out_norm_) : nullptr,
            mlp_out_norm_.has_value() ? floats(*mlp_out_norm_) : nullptr,
            static_cast<cadenza::Activation>(activation_)};
  }

  // (q [T, H, D], k [T, KVH, D], v [T, KVH, D]): views of one fresh fused projection of h [T, hidden].
  std::tuple<Tensor, Tensor, Tensor> attention_input(const Tensor& h, const Tensor& positions) const {
    check_attention_input(h, positions);
    const cadenza::DecoderLayer plain = layer();
    const int64_t T = h.size(0), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
    const Tensor qkv = at::empty({T, plain.qkv_features()}, h.options());
    cadenza::layer_attention_input(plain, h.data_ptr<float>(), T, positions.data_ptr<int64_t>(), qkv.data_ptr<float>());
    const Tensor qk = qkv.narrow(1, 0, (H + KVH) * D).view({T, H + KVH, D});
    const Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
    return {qk.narrow(1, 0, H), qk.narrow(1, H, KVH), v};
  }

  // h += o_proj(attn); h += down(SiLU(gate) * up) of post_norm(h): the residual stream, in place.
  void finish_(Tensor h, const Tensor& attn) const {
    check_hidden(h);
    const Tensor attn_rows = attn.reshape({h.size(0), num_heads_ * head_dim_});
    check_f32_rows(attn_rows, "attn");
    check_post_norm();
    cadenza::layer_finish(layer(), h.data_ptr<float>(), h.size(0), in_rows(attn_rows));
  }

  void check_attention_input(const Tensor& h, const Tensor& positions) const {
    check_hidden(h);
    check_f32_rows(input_norm_, "weight");
    if (rotary_dims_ > 0) check_rotary_tables(cos_table_, sin_table_, rotary_dims_);
    check_positions(positions, h.size(0));
  }

  // The cache a step writes and reads fits this layer's heads (the checks of write_kv_ and
  // paged_decode_attention for the q, k and v of its projection).
  void check_cache(const cadenza::KvCache& cache, const Tensor& slot_mapping, const Tensor& row_tables,
                   const Tensor& row_lens, int64_t tokens) const {
    check_kv_heads(num_kv_heads_ == cache.kv_heads && head_dim_ == cache.head_dim);
    check_slot_mapping(slot_mapping, tokens);
    check_decode_shapes(tokens, num_heads_, head_dim_, row_tables, row_lens, cache);
  }

  void check_post_norm() const { check_f32_rows(post_norm_, "weight"); }

  bool has_mlp() const { return has_mlp_; }

 private:
  void check_hidden(const Tensor& h) const {
    check_f32_rows(h, "h");
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) == input_norm_.numel(),
                "h must be a contiguous float32 [tokens, hidden] tensor");
  }

  Tensor input_norm_, post_norm_;
  OptionalTensor q_norm_, k_norm_, attn_out_norm_, mlp_out_norm_;
  Tensor cos_table_, sin_table_;
  Projection qkv_, o_, gate_up_, down_;
  std::vector<Projection> qkv_more_;
  std::vector<cadenza::Weight> qkv_more_plain_;  // what layer() hands the kernel, made once
  bool has_mlp_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  int64_t rotary_dims_;
  float residual_scale_;
  int64_t activation_;
};

// A step of few rows through every layer in one call (decode_layer.h). kv_scales: empty for
// float caches, else the int8 caches' float16 scales. Every layer's tensors are checked first.
void decode_stack_(const std::vector<const DecoderLayerKernel*>& layers, Tensor h, const Tensor& positions,
                   const std::vector<Tensor>& kv_caches, const std::vector<Tensor>& kv_scales,
                   const Tensor& slot_mapping, const Tensor& row_tables, const Tensor& row_lens, double scale,
                   int64_t window) {
  TORCH_CHECK(layers.size() == kv_caches.size(), "one KV cache per layer");
  const bool int8 = !kv_scales.empty();
  TORCH_CHECK(!int8 || kv_scales.size() == kv_caches.size(), "one scale tensor per int8 KV cache");
  std::vector<cadenza::DecoderLayer> plain;
  std::vector<cadenza::KvCache> caches;
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK(layers[i] != nullptr, "layer ", i, " has no kernel");
    TORCH_CHECK(layers[i]->has_mlp(), "layer ", i, "'s kernel has no MLP (a mixture of experts): a stack needs whole layers");
    layers[i]->check_attention_input(h, positions);
    layers[i]->check_post_norm();
    caches.push_back(int8 ? int8_cache(kv_caches[i], kv_scales[i]) : float_cache(kv_caches[i]));
    layers[i]->check_cache(caches.back(), slot_mapping, row_tables, row_lens, h.size(0));
    plain.push_back(layers[i]->layer());
  }
  std::vector<const cadenza::DecoderLayer*> order;
  for (const cadenza::DecoderLayer& layer : plain) order.push_back(&layer);
  cadenza::decode_stack(order.data(), caches.data(), static_cast<int64_t>(order.size()), h.data_ptr<float>(), h.size(0),
                        positions.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(),
                        tables_of(row_tables, row_lens), scale, window);
}

// Sets the CPU mask of each thread of the calling thread's OpenMP team (ATen's intra-op pool, the
// team every kernel and torch op of this thread runs on): thread i to masks[i], a list of CPUs
// (one CPU pins it; the process's CPUs release it). Each thread sets its own mask, so this runs one
// parallel region of exactly the team's size; returns how many threads took theirs (a thread
// whose CPUs the process may not use keeps its mask).
int64_t set_team_affinity(const std::vector<std::vector<int64_t>>& masks) {
  const int64_t team = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(masks.size()) >= team, "set_team_affinity: ", masks.size(), " masks for a team of ",
              team, " threads");
  std::atomic<int64_t> set_count{0};
  at::parallel_for(0, team, 1, [&](int64_t begin, int64_t end) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (const int64_t cpu : masks[at::get_thread_num()]) {
      if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(static_cast<int>(cpu), &set);
    }
    if (CPU_COUNT(&set) > 0 && sched_setaffinity(0, sizeof(set), &set) == 0) set_count.fetch_add(1);  // 0: this thread
  });
  return set_count.load();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
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
  m.def("quant_pack", &quant_pack, "GGUF blocks re-laid pack_rows() rows at a time for the packed products", release());
  m.def("quant_packs", &cadenza::packs, "whether this build packs weights of a GGML type");
  m.def("pack_rows", &cadenza::pack_rows, "rows a packed group holds in this build: 8 or 16");
  m.def("packed_path", &cadenza::packed_path, "this build's products over packed weights, e.g. avx2-packed8");
  m.def("packed_kernels_built", [] { return true; }, "whether this build has products over packed weights (every build has)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, float32", release());
  m.def("stream_read", &stream_read, "the xor of a tensor's bytes, every thread reading at once", release());
  m.def("rotary_", &rotary_, "in-place NeoX rotary embedding from cos/sin tables", release());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up for a fused [rows, 2 * I] gate_up", release());
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu_mul of a bfloat16 gate_up, into bfloat16 (rounded as torch rounds)",
        release());
  m.def("paged_decode_attention", &paged_decode_attention,
        "one-token-per-sequence attention over a paged KV cache (with attention sinks where given)",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window"), py::arg("sinks") = py::none(), release());
  m.def("write_kv_", &write_kv_, "store keys and values at their cache slots", release());
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8,
        "one-token-per-sequence attention over a paged int8 KV cache with float16 scales",
        py::arg("q"), py::arg("kv_data"), py::arg("kv_scales"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window"), py::arg("sinks") = py::none(), release());
  m.def("write_kv_int8_", &write_kv_int8_, "quantize keys and values into their int8 cache slots", release());
  py::class_<MoEKernel>(m, "MoEKernel")
      .def(py::init<std::vector<Tensor>, std::vector<int64_t>, std::vector<Tensor>, std::vector<int64_t>, int64_t,
                    std::optional<std::vector<Tensor>>, std::optional<std::vector<Tensor>>, double, double>(),
           py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"), py::arg("down_types"), py::arg("hidden"),
           py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none(), py::arg("swiglu_alpha") = 0.0,
           py::arg("swiglu_limit") = 0.0)
      .def("add_", &MoEKernel::add_, "residual += the experts' outputs for the router's picks, in place", release());
  py::class_<DecoderLayerKernel>(m, "DecoderLayerKernel")
      .def(py::init<Tensor, Tensor, OptionalTensor, Tensor, OptionalTensor, Tensor, OptionalTensor, OptionalTensor,
                    OptionalTensor, OptionalTensor, Tensor, Tensor, int64_t, int64_t, int64_t, double, int64_t, int64_t,
                    int64_t, int64_t, OptionalTensor, OptionalTensor, int64_t, double, OptionalTensor, OptionalTensor,
                    int64_t, std::vector<Tensor>, std::vector<int64_t>>(),
           py::arg("input_norm"), py::arg("qkv_weight"), py::arg("qkv_bias"), py::arg("o_weight"), py::arg("o_bias"),
           py::arg("post_norm"), py::arg("gate_up_weight"), py::arg("gate_up_bias"), py::arg("down_weight"),
           py::arg("down_bias"), py::arg("cos_table"), py::arg("sin_table"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("qkv_type"), py::arg("o_type"),
           py::arg("gate_up_type"), py::arg("down_type"), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("rotary_dims") = -1, py::arg("residual_scale") = 1.0,
           py::arg("attn_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none(), py::arg("activation") = 0,
           py::arg("qkv_more") = std::vector<Tensor>{}, py::arg("qkv_more_types") = std::vector<int64_t>{})
      .def("attention_input", &DecoderLayerKernel::attention_input,
           "(q, k, v) of h: input norm, fused projection, rotary", release())
      .def("finish_", &DecoderLayerKernel::finish_, "h += attention output and MLP (if it has one), in place", release())
      .def_property_readonly("has_mlp", &DecoderLayerKernel::has_mlp);
  m.def("set_team_affinity", &set_team_affinity, "the CPU mask of each thread of the calling thread's OpenMP team",
        release());
  m.def("decode_stack_", &decode_stack_, "a decode step through every layer and its paged KV cache, h in place",
        release());
}
