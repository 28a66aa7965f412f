// A mixture-of-experts MLP over few tokens (decode), after the router: each expert that a token
// picked runs once over all of its tokens, its hidden activations scaled by each token's routing
// weight, and its down projection added into the tokens' residual rows.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace cadenza {

// The experts' activation of gate_up: SiLU(gate) * up, or (swiglu_limit > 0) gpt-oss's clamped
// SwiGLU (small_ops.h swiglu_clamped).
struct ExpertActivation {
  float swiglu_alpha = 0.0f, swiglu_limit = 0.0f;
};

// residual [T, H] += sum over j < top_k of weights[t, j] * expert_{ids[t, j]}(x[t]), where expert e
// is down[e] act(gate_up[e] x) + down_bias[e]: gate_up[e] [2I, H] (its bias, if any, in the
// Weight) and down[e] [H, I] raw GGUF blocks (quant.h, packed or not), down_bias[e] [H] or
// nullptr (down_bias itself nullptr: none has one). ids and weights are [T, top_k], row-major.
// Experts run in order of their first token, each product parallel over its rows. In a step of a
// few tokens (decode) each token then adds its top_k outputs in the order of its picks, bit for bit
// the same whatever else the step holds; a longer step adds each expert's outputs as it finishes.
void moe_experts_add(In x, const int64_t* ids, const float* weights, int64_t top_k, const Weight* gate_up,
                     const Weight* down, const float* const* down_bias, int64_t num_experts, ExpertActivation act,
                     Out residual);

}  // namespace cadenza
