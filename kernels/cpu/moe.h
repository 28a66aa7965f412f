// A mixture-of-experts MLP over few tokens (decode), after the router: each expert that a token
// picked runs once over all of its tokens, its hidden activations scaled by each token's routing
// weight, and its down projection added into the tokens' residual rows.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace cadenza {

// residual [T, H] += sum over j < top_k of weights[t, j] * expert_{ids[t, j]}(x[t]), where expert e
// is down[e] (silu(gate) * up of gate_up[e] x): gate_up[e] [2I, H] and down[e] [H, I] raw GGUF
// blocks (quant.h, packed or not). ids and weights are [T, top_k], row-major. Experts run in
// order of their first token; each product is parallel over its rows.
void moe_experts_add(In x, const int64_t* ids, const float* weights, int64_t top_k, const Weight* gate_up,
                     const Weight* down, int64_t num_experts, Out residual);

}  // namespace cadenza
