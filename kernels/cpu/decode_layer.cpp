// The decoder layer and the whole decode step of decode_layer.h, over the other units' kernels.
#include "decode_layer.h"

#include <cstdlib>
#include <memory>
#include <new>

#include "linear.h"
#include "quant.h"

namespace cadenza {
namespace {

// A thread's scratch rows, kept from call to call (a step's few rows of one activation: at most a
// few MB), 64-byte aligned as PyTorch's allocations are.
class Scratch {
 public:
  float* get(int64_t count) {
    if (count > size_) {
      const size_t bytes = (static_cast<size_t>(count) * sizeof(float) + 63) / 64 * 64;
      storage_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      if (!storage_) throw std::bad_alloc();
      size_ = count;
    }
    return storage_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> storage_;
  int64_t size_ = 0;
};

// out (+)= x @ W^T (+ bias) through the kernel of W's kind.
void project(const Weight& w, In x, Out out, bool accumulate) {
  if (w.qtype < 0) linear_bf16(x, static_cast<const uint16_t*>(w.data), w.rows, w.bias, out, accumulate);
  else quant_matmul(x, w, out, accumulate);
}

// A contiguous [rows, cols] matrix at p, to read or to write.
In in_rows(const float* p, int64_t rows, int64_t cols) { return In{p, rows, cols, cols}; }
Out out_rows(float* p, int64_t rows, int64_t cols) { return Out{p, rows, cols, cols}; }

}  // namespace

void layer_attention_input(const DecoderLayer& layer, const float* h, int64_t T, const int64_t* positions, float* qkv) {
  thread_local Scratch normed;
  const int64_t hidden = layer.hidden, width = layer.qkv_features();
  float* x = normed.get(T * hidden);
  rms_norm(in_rows(h, T, hidden), layer.input_norm, layer.eps, out_rows(x, T, hidden));
  project(layer.qkv, in_rows(x, T, hidden), Out{qkv, T, layer.qkv.rows, width}, false);
  for (int64_t k = 0, at = layer.qkv.rows; k < layer.num_qkv_more; at += layer.qkv_more[k].rows, ++k)
    project(layer.qkv_more[k], in_rows(x, T, hidden), Out{qkv + at, T, layer.qkv_more[k].rows, width}, false);
  if (layer.q_norm != nullptr) {  // each head of each row, in place (rms_norm reads a row before it writes it)
    const int64_t H = layer.num_heads, KVH = layer.num_kv_heads, D = layer.head_dim;
    for (int64_t t = 0; t < T; ++t) {
      float* q = qkv + t * width;
      rms_norm(In{q, H, D, D}, layer.q_norm, layer.eps, Out{q, H, D, D});
      rms_norm(In{q + H * D, KVH, D, D}, layer.k_norm, layer.eps, Out{q + H * D, KVH, D, D});
    }
  }
  // q and k side by side: one pass (none in a NoPE layer; each head's leading dims under partial rotary)
  if (layer.rotary_dims > 0)
    rotary(qkv, T, layer.num_heads + layer.num_kv_heads, layer.rotary_dims, width, positions, layer.rotary,
           layer.head_dim);
}

void layer_finish(const DecoderLayer& layer, float* h, int64_t T, In attn) {
  thread_local Scratch normed, gate_up, hidden, block_out;
  const int64_t H = layer.hidden, I2 = layer.gate_up.rows;
  // h += scale * out_norm(w x): straight into h where there is neither a norm nor a scale.
  const auto add_block = [&](const Weight& w, In x, const float* out_norm) {
    if (out_norm == nullptr && layer.residual_scale == 1.0f) {
      project(w, x, out_rows(h, T, H), true);
      return;
    }
    float* y = block_out.get(T * H);
    project(w, x, out_rows(y, T, H), false);
    if (out_norm != nullptr) rms_norm(in_rows(y, T, H), out_norm, layer.eps, out_rows(y, T, H));
    const float s = layer.residual_scale;
    for (int64_t i = 0; i < T * H; ++i) h[i] += s * y[i];
  };
  add_block(layer.o, attn, layer.attn_out_norm);
  if (layer.gate_up.data == nullptr) return;  // the attention half only (a mixture of experts' layer)
  float* x = normed.get(T * H);
  rms_norm(in_rows(h, T, H), layer.post_norm, layer.eps, out_rows(x, T, H));
  float* gu = gate_up.get(T * I2);
  project(layer.gate_up, in_rows(x, T, H), out_rows(gu, T, I2), false);
  float* act = hidden.get(T * I2 / 2);
  if (layer.activation == Activation::kGeluTanh) gelu_tanh_mul(in_rows(gu, T, I2), out_rows(act, T, I2 / 2));
  else silu_mul(in_rows(gu, T, I2), out_rows(act, T, I2 / 2));
  add_block(layer.down, in_rows(act, T, I2 / 2), layer.mlp_out_norm);
}

void decode_stack(const DecoderLayer* const* layers, const KvCache* caches, int64_t num_layers, float* h, int64_t T,
                  const int64_t* positions, const int64_t* slots, const BlockTables& tables, double scale,
                  int64_t window) {
  thread_local Scratch qkv_rows, attn_rows;
  for (int64_t i = 0; i < num_layers; ++i) {
    const DecoderLayer& layer = *layers[i];
    const int64_t H = layer.num_heads, KVH = layer.num_kv_heads, D = layer.head_dim, width = layer.qkv_features();
    float* qkv = qkv_rows.get(T * width);
    layer_attention_input(layer, h, T, positions, qkv);
    write_kv(caches[i], Heads{qkv + H * D, T, KVH, D, width}, Heads{qkv + (H + KVH) * D, T, KVH, D, width}, slots);
    float* attn = attn_rows.get(T * H * D);
    paged_decode_attention(Heads{qkv, T, H, D, width}, caches[i], tables, scale, window, attn);
    layer_finish(layer, h, T, in_rows(attn, T, H * D));
  }
}

}  // namespace cadenza
