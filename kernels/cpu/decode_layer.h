// One decoder layer of a Llama-family model for steps of a few tokens, in two calls around the
// attention backend: `layer_attention_input` (input norm, fused q/k/v projection, rotary on q and
// k) and `layer_finish` (output projection and residual, post-attention norm, gate/up, SiLU * up,
// down projection and residual); and `decode_stack`, a whole step through every layer.
//
// A decode step spends more time crossing from Python into each small op than computing it
// (about 20 calls and views a layer); here a layer is two calls. The attention itself stays the
// deployment's attention backend, called from Python between the two. The binding's
// `DecoderLayerKernel` holds the layer's tensors and checks them once; these take their pointers.
#pragma once

#include <cstdint>

#include "kernels.h"
#include "paged_attention.h"
#include "small_ops.h"

namespace cadenza {

// The MLP's activation of gate: SiLU (Llama and most), or GELU tanh-approximated (Gemma).
enum class Activation : int64_t { kSiLU = 0, kGeluTanh = 1 };

// A layer's weights: float32 norms [hidden], projections (bf16 or raw GGUF blocks, see `Weight`)
// qkv [(H + 2 KVH) D, hidden], o [hidden, H D], gate_up [2 I, hidden], down [hidden, I]; and
// Qwen3's RMSNorms of each query and key head [D] before rotary (nullptr: none). The family
// options of the one decoder (models/families.py) that live inside a layer:
// - rotary_dims: the leading dimensions of each head rotary turns (head_dim: all; fewer: Phi-4-mini's
//   partial rotary; 0: a NoPE layer of SmolLM3);
// - residual_scale: each block's output is scaled before its residual add (Granite);
// - attn_out_norm, mlp_out_norm: norms of the attention's and the MLP's outputs before their
//   residual adds (Gemma's "sandwich"; nullptr: none), post_norm then being the MLP's input norm;
// - activation.
struct DecoderLayer {
  const float* input_norm;
  const float* post_norm;
  const float* q_norm;
  const float* k_norm;
  Weight qkv, o, gate_up, down;
  // The fused projection's further parts, rows after qkv's, where its rows are stored in more than
  // one block type (llama-quantize's Q4_K_M: Q6_K `attn_v` beside Q4_K q and k); nullptr, 0: none.
  const Weight* qkv_more;
  int64_t num_qkv_more;
  RotaryTables rotary;
  int64_t hidden, num_heads, num_kv_heads, head_dim;
  double eps;
  int64_t rotary_dims;
  float residual_scale;
  const float* attn_out_norm;
  const float* mlp_out_norm;
  Activation activation;

  int64_t qkv_features() const { return (num_heads + 2 * num_kv_heads) * head_dim; }
};

// qkv [T, qkv_features] (contiguous) = the fused projection of input_norm(h) for h [T, hidden]
// (contiguous), its q and k heads normed (where the layer has q/k norms), then rotary at
// positions [T] applied to them.
void layer_attention_input(const DecoderLayer& layer, const float* h, int64_t T, const int64_t* positions, float* qkv);

// h += o_proj(attn); h += down(SiLU(gate) * up) of post_norm(h): the residual stream, in place
// (each block's output normed and scaled where the layer says). A layer without gate_up (its data
// nullptr: a mixture of experts, run apart) stops after o_proj.
void layer_finish(const DecoderLayer& layer, float* h, int64_t T, In attn);

// A step of few rows through every layer in one call: per layer, `layer_attention_input`, the new
// keys and values into the layer's paged cache, paged decode attention and `layer_finish` -- the
// calls the Python loop makes for a decode step, in the same order, so results are bit for bit
// the same. Every query row attends as a decode: row i reads its own block table up to its own
// length (a chunk's row j at context c: c + j + 1), so the rows of a speculative step or a short
// prefill equal the decode steps they stand for. One crossing from Python a step instead of four
// a layer: the glue cost ~0.5 ms a step on the default model, and each crossing took the GIL back
// from the event loop.
void decode_stack(const DecoderLayer* const* layers, const KvCache* caches, int64_t num_layers, float* h, int64_t T,
                  const int64_t* positions, const int64_t* slots, const BlockTables& tables, double scale,
                  int64_t window);

}  // namespace cadenza
