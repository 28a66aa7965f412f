// One decoder layer of a Llama-family model for steps of a few tokens, in two calls around the
// attention backend: `attention_input` (input norm, fused q/k/v projection, rotary on q and k)
// and `finish_` (output projection and residual, post-attention norm, gate/up, SiLU * up, down
// projection and residual).
//
// A decode step spends more time crossing from Python into each small op than computing it
// (about 20 calls and views a layer); here a layer is two calls. The attention itself stays the
// deployment's attention backend, called from Python between the two.
#pragma once

#include <torch/extension.h>

#include <tuple>

#include "linear.h"
#include "paged_attention.h"
#include "quant.h"
#include "small_ops.h"

namespace cadenza {

// One projection of the layer: a bf16 weight [out, in] (qtype -1), or raw GGUF blocks
// [out, bytes per row] of GGML type qtype (quant.h).
struct Projection {
  torch::Tensor w;
  c10::optional<torch::Tensor> bias;
  int64_t qtype;

  int64_t out_features() const { return w.size(0); }
  int64_t in_features() const { return qtype < 0 ? w.size(1) : quant_in_features(w, qtype); }

  void check(int64_t in_features) const {
    const auto probe = torch::empty({1, in_features}, torch::dtype(torch::kFloat32));
    if (qtype < 0) {
      check_linear(probe, w, bias);
    } else {
      auto out = torch::empty({1, w.size(0)}, probe.options());
      quant_matmul_(out, probe.zero_(), w, qtype, bias, false);  // checks shapes and the bias
    }
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (qtype < 0) return linear_unchecked(x, w, bias);
    auto out = torch::empty({x.size(0), w.size(0)}, x.options());
    quant_matmul_(out, x, w, qtype, bias, false);
    return out;
  }

  void add_into(torch::Tensor& out, const torch::Tensor& x) const {  // out += x @ W^T (+ bias)
    if (qtype < 0) linear_impl(x, w, bias, out, true);
    else quant_matmul_(out, x, w, qtype, bias, true);
  }
};

class DecoderLayerKernel {
 public:
  // Weights are the model's own tensors (bf16 [out, in] projections or raw GGUF blocks, see
  // `Projection`; float32 norms and biases), held by reference: nothing is copied. The *_type
  // arguments are each projection's GGML type, -1 for bf16.
  DecoderLayerKernel(torch::Tensor input_norm, torch::Tensor qkv_weight, c10::optional<torch::Tensor> qkv_bias,
                     torch::Tensor o_weight, c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm,
                     torch::Tensor gate_up_weight, c10::optional<torch::Tensor> gate_up_bias,
                     torch::Tensor down_weight, c10::optional<torch::Tensor> down_bias, torch::Tensor cos_table,
                     torch::Tensor sin_table, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                     int64_t qkv_type, int64_t o_type, int64_t gate_up_type, int64_t down_type)
      : input_norm_(std::move(input_norm)), qkv_{std::move(qkv_weight), std::move(qkv_bias), qkv_type},
        o_{std::move(o_weight), std::move(o_bias), o_type}, post_norm_(std::move(post_norm)),
        gate_up_{std::move(gate_up_weight), std::move(gate_up_bias), gate_up_type},
        down_{std::move(down_weight), std::move(down_bias), down_type}, cos_table_(std::move(cos_table)),
        sin_table_(std::move(sin_table)), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        eps_(eps) {
    const int64_t hidden = input_norm_.numel(), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    TORCH_CHECK(qkv_.w.dim() == 2 && qkv_.out_features() == q_size + 2 * kv_size && qkv_.in_features() == hidden,
                "qkv weight must be [q_size + 2 * kv_size, hidden]");
    TORCH_CHECK(o_.w.dim() == 2 && o_.out_features() == hidden && o_.in_features() == q_size,
                "o_proj weight must be [hidden, q_size]");
    TORCH_CHECK(gate_up_.w.dim() == 2 && gate_up_.in_features() == hidden && gate_up_.out_features() % 2 == 0,
                "gate_up weight must be [2 * intermediate, hidden]");
    TORCH_CHECK(down_.w.dim() == 2 && down_.out_features() == hidden &&
                    2 * down_.in_features() == gate_up_.out_features(),
                "down_proj weight must be [hidden, intermediate]");
    TORCH_CHECK(post_norm_.numel() == hidden, "the two norms must have one weight per hidden feature");
    // Every product is checked once here rather than on each call.
    qkv_.check(hidden);
    gate_up_.check(hidden);
    o_.check(q_size);
    down_.check(down_.in_features());
  }

  // (q [T, H, D], k [T, KVH, D], v [T, KVH, D]): views of one fresh fused projection of h [T, hidden].
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> attention_input(const torch::Tensor& h,
                                                                          const torch::Tensor& positions) const {
    check_hidden(h);
    const int64_t T = h.size(0);
    const torch::Tensor qkv = qkv_(rms_norm(h, input_norm_, eps_));
    torch::Tensor qk = qkv.narrow(1, 0, (num_heads_ + num_kv_heads_) * head_dim_)
                           .view({T, num_heads_ + num_kv_heads_, head_dim_});
    rotary_(qk, positions, cos_table_, sin_table_);  // q and k side by side: one pass
    torch::Tensor v = qkv.narrow(1, (num_heads_ + num_kv_heads_) * head_dim_, num_kv_heads_ * head_dim_)
                          .view({T, num_kv_heads_, head_dim_});
    return {qk.narrow(1, 0, num_heads_), qk.narrow(1, num_heads_, num_kv_heads_), v};
  }

  // h += o_proj(attn); h += down(SiLU(gate) * up) of post_norm(h): the residual stream, in place.
  void finish_(torch::Tensor h, const torch::Tensor& attn) const {
    check_hidden(h);
    const torch::Tensor attn_rows = attn.reshape({h.size(0), num_heads_ * head_dim_});
    check_f32_rows(attn_rows, "attn");
    o_.add_into(h, attn_rows);
    const torch::Tensor gate_up = gate_up_(rms_norm(h, post_norm_, eps_));
    const torch::Tensor hidden = silu_mul(gate_up);
    down_.add_into(h, hidden);
  }

 private:
  void check_hidden(const torch::Tensor& h) const {
    check_f32_rows(h, "h");
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) == input_norm_.numel(),
                "h must be a contiguous float32 [tokens, hidden] tensor");
  }

  torch::Tensor input_norm_;
  Projection qkv_, o_;
  torch::Tensor post_norm_;
  Projection gate_up_, down_;
  torch::Tensor cos_table_, sin_table_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
};

// A step of few rows through every layer in one call: per layer, `attention_input`, the new keys
// and values into the layer's paged cache, paged decode attention and `finish_` -- the calls the
// Python loop makes for a decode step, in the same order, so results are bit for bit the same.
// Every query row attends as a decode: row i reads its own block table row_tables[i] up to
// row_lens[i] keys (a chunk's row j at context c: c + j + 1), so the rows of a speculative step
// or a short prefill equal the decode steps they stand for. One crossing from Python a step
// instead of four a layer: the glue cost ~0.5 ms a step on the default model, and each crossing
// took the GIL back from the event loop. kv_scales: empty for float32 caches, else the int8
// caches' float16 scales.
inline void decode_stack_(const std::vector<const DecoderLayerKernel*>& layers, torch::Tensor h,
                          const torch::Tensor& positions, const std::vector<torch::Tensor>& kv_caches,
                          const std::vector<torch::Tensor>& kv_scales, const torch::Tensor& slot_mapping,
                          const torch::Tensor& row_tables, const torch::Tensor& row_lens, double scale,
                          int64_t window) {
  TORCH_CHECK(layers.size() == kv_caches.size(), "one KV cache per layer");
  const bool int8 = !kv_scales.empty();
  TORCH_CHECK(!int8 || kv_scales.size() == kv_caches.size(), "one scale tensor per int8 KV cache");
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK(layers[i] != nullptr, "layer ", i, " has no kernel");
    auto [q, k, v] = layers[i]->attention_input(h, positions);
    torch::Tensor attn;
    if (int8) {
      write_kv_int8_(kv_caches[i], kv_scales[i], k, v, slot_mapping);
      attn = paged_decode_attention_int8(q, kv_caches[i], kv_scales[i], row_tables, row_lens, scale, window);
    } else {
      write_kv_(kv_caches[i], k, v, slot_mapping);
      attn = paged_decode_attention(q, kv_caches[i], row_tables, row_lens, scale, window);
    }
    layers[i]->finish_(h, attn);
  }
}

}  // namespace cadenza
