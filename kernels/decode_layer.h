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
#include "small_ops.h"

namespace cadenza {

class DecoderLayerKernel {
 public:
  // Weights are the model's own tensors (bf16 [out, in] projections, float32 norms and biases),
  // held by reference: nothing is copied.
  DecoderLayerKernel(torch::Tensor input_norm, torch::Tensor qkv_weight, c10::optional<torch::Tensor> qkv_bias,
                     torch::Tensor o_weight, c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm,
                     torch::Tensor gate_up_weight, c10::optional<torch::Tensor> gate_up_bias,
                     torch::Tensor down_weight, c10::optional<torch::Tensor> down_bias, torch::Tensor cos_table,
                     torch::Tensor sin_table, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : input_norm_(std::move(input_norm)), qkv_weight_(std::move(qkv_weight)), qkv_bias_(std::move(qkv_bias)),
        o_weight_(std::move(o_weight)), o_bias_(std::move(o_bias)), post_norm_(std::move(post_norm)),
        gate_up_weight_(std::move(gate_up_weight)), gate_up_bias_(std::move(gate_up_bias)),
        down_weight_(std::move(down_weight)), down_bias_(std::move(down_bias)), cos_table_(std::move(cos_table)),
        sin_table_(std::move(sin_table)), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        eps_(eps) {
    const int64_t hidden = input_norm_.numel(), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    TORCH_CHECK(qkv_weight_.dim() == 2 && qkv_weight_.size(0) == q_size + 2 * kv_size && qkv_weight_.size(1) == hidden,
                "qkv weight must be [q_size + 2 * kv_size, hidden]");
    TORCH_CHECK(o_weight_.dim() == 2 && o_weight_.size(0) == hidden && o_weight_.size(1) == q_size,
                "o_proj weight must be [hidden, q_size]");
    TORCH_CHECK(gate_up_weight_.dim() == 2 && gate_up_weight_.size(1) == hidden && gate_up_weight_.size(0) % 2 == 0,
                "gate_up weight must be [2 * intermediate, hidden]");
    TORCH_CHECK(down_weight_.dim() == 2 && down_weight_.size(0) == hidden &&
                    2 * down_weight_.size(1) == gate_up_weight_.size(0),
                "down_proj weight must be [hidden, intermediate]");
    TORCH_CHECK(post_norm_.numel() == hidden, "the two norms must have one weight per hidden feature");
    // Every product is checked once here rather than on each call.
    const auto probe = torch::empty({1, hidden}, input_norm_.options());
    check_linear(probe, qkv_weight_, qkv_bias_);
    check_linear(probe, gate_up_weight_, gate_up_bias_);
    check_linear(torch::empty({1, q_size}, probe.options()), o_weight_, o_bias_);
    check_linear(torch::empty({1, down_weight_.size(1)}, probe.options()), down_weight_, down_bias_);
  }

  // (q [T, H, D], k [T, KVH, D], v [T, KVH, D]): views of one fresh fused projection of h [T, hidden].
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> attention_input(const torch::Tensor& h,
                                                                          const torch::Tensor& positions) const {
    check_hidden(h);
    const int64_t T = h.size(0);
    const torch::Tensor qkv = linear_unchecked(rms_norm(h, input_norm_, eps_), qkv_weight_, qkv_bias_);
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
    linear_impl(attn_rows, o_weight_, o_bias_, h, true);
    const torch::Tensor gate_up = linear_unchecked(rms_norm(h, post_norm_, eps_), gate_up_weight_, gate_up_bias_);
    const torch::Tensor hidden = silu_mul(gate_up);
    linear_impl(hidden, down_weight_, down_bias_, h, true);
  }

 private:
  void check_hidden(const torch::Tensor& h) const {
    check_f32_rows(h, "h");
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) == input_norm_.numel(),
                "h must be a contiguous float32 [tokens, hidden] tensor");
  }

  torch::Tensor input_norm_, qkv_weight_;
  c10::optional<torch::Tensor> qkv_bias_;
  torch::Tensor o_weight_;
  c10::optional<torch::Tensor> o_bias_;
  torch::Tensor post_norm_, gate_up_weight_;
  c10::optional<torch::Tensor> gate_up_bias_;
  torch::Tensor down_weight_;
  c10::optional<torch::Tensor> down_bias_;
  torch::Tensor cos_table_, sin_table_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
};

}  // namespace cadenza
