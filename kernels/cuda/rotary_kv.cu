// Rotary embedding of q and k (in place), fused with writing k and v to the paged KV cache:
// cadenza.cupy_ops.rotary_kv.
//
// Launch: grid (T), one block per token; block (32 * W) threads, W warps. A token has
// Hq + 2 * Hkv rows of head_dim values (its q heads, k heads, v heads); warp w takes rows w, w + W,
// ... and its 32 lanes stride over a row's elements. A row is one warp's alone, so the only
// cross-thread steps are the int8 kernel's, within a warp (an absmax shuffle, a __syncwarp): no
// shared memory, no block barrier.
//
// Rounding copies PyTorch's eager ops bit for bit, as models/rotary.py's apply_rotary runs them:
// cos and sin are rounded to the activation dtype first (transformers casts them), and each of
// x * cos, rotate_half(x) * sin and their sum is computed in float and rounded to the activation
// dtype, with no FMA contraction (__fmul_rn / __fadd_rn). The cache gets the rotated k rounded to
// the activation dtype, then converted to the cache's dtype, as `k.to(cache.dtype)` does.
//
// 16-bit values are handled as their bits (unsigned short) and converted here, so no CUDA header
// is needed: NVRTC compiles this as is.

#define FULL_MASK 0xffffffffu

// The activation and cache dtypes: storage type, and conversion from/to float (round to nearest
// even, as PyTorch converts).
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(T x) { return x; }
    static __device__ __forceinline__ T store(float f) { return f; }
};

struct F16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(T x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
    static __device__ __forceinline__ T store(float f) {
        T x;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f));
        return x;
    }
};

struct BF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(T x) { return __uint_as_float(((unsigned int)x) << 16); }
    static __device__ __forceinline__ T store(float f) {
        const unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (T)0x7fc0;  // NaN, as c10::BFloat16 makes it
        return (T)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
    }
};

template <class A>
__device__ __forceinline__ float round_to(float f) {
    return A::load(A::store(f));
}

// Rotates one row x[0 .. 2 * half) in place (NeoX: x[i] pairs with x[i + half]); lanes stride over
// the pairs. Where `out` is not null, the rotated row also goes there in the cache dtype C. Returns
// the largest |value| this lane wrote (for the int8 scale).
template <class A, class C>
__device__ float rotate_row(typename A::T* x, const float* cos_row, const float* sin_row, int half, int lane,
                            typename C::T* out) {
    float absmax = 0.0f;
    for (int i = lane; i < half; i += 32) {
        const float x1 = A::load(x[i]), x2 = A::load(x[i + half]);
        const float c1 = round_to<A>(cos_row[i]), c2 = round_to<A>(cos_row[i + half]);
        const float s1 = round_to<A>(sin_row[i]), s2 = round_to<A>(sin_row[i + half]);
        // out = x * cos + cat(-x2, x1) * sin, each op rounded as PyTorch's separate kernels round it.
        const float o1 = round_to<A>(__fadd_rn(round_to<A>(__fmul_rn(x1, c1)), round_to<A>(__fmul_rn(-x2, s1))));
        const float o2 = round_to<A>(__fadd_rn(round_to<A>(__fmul_rn(x2, c2)), round_to<A>(__fmul_rn(x1, s2))));
        x[i] = A::store(o1);
        x[i + half] = A::store(o2);
        if (out) {
            out[i] = C::store(o1);
            out[i + half] = C::store(o2);
        }
        absmax = fmaxf(absmax, fmaxf(fabsf(o1), fabsf(o2)));
    }
    return absmax;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// What a token's block shares: where its q, k, v rows are, and its cos/sin rows and cache slot.
struct Token {
    long long slot;  // flat cache slot, or -1: a padding row, whose k and v are not written
    const float* cos_row;
    const float* sin_row;
};

__device__ __forceinline__ Token token_at(const long long* positions, const long long* slot_mapping,
                                          const float* cos_table, const float* sin_table, long long num_positions,
                                          long long num_slots, int head_dim) {
    Token t;
    long long pos = positions[blockIdx.x];
    // Positions must lie in the table; one outside is clamped, so a bad one never reads past it.
    pos = pos < 0 ? 0 : (pos >= num_positions ? num_positions - 1 : pos);
    t.cos_row = cos_table + pos * head_dim;
    t.sin_row = sin_table + pos * head_dim;
    const long long slot = slot_mapping[blockIdx.x];
    t.slot = (slot >= 0 && slot < num_slots) ? slot : -1;  // outside the cache: never written
    return t;
}

// q [T, Hq, D], k and v [T, Hkv, D] in the activation dtype A, each with its own token and head
// strides (elements; D contiguous); positions and slot_mapping int64 [T]; cos/sin float32
// [num_positions, D] contiguous; cache [2, num_slots, Hkv, D] contiguous in dtype C.
template <class A, class C>
__device__ void rotary_kv(typename A::T* q, long long q_st, long long q_sh, typename A::T* k, long long k_st,
                          long long k_sh, const typename A::T* v, long long v_st, long long v_sh,
                          const long long* positions, const float* cos_table, const float* sin_table,
                          long long num_positions, typename C::T* cache, long long num_slots,
                          const long long* slot_mapping, int num_q_heads, int num_kv_heads, int head_dim) {
    const Token t = token_at(positions, slot_mapping, cos_table, sin_table, num_positions, num_slots, head_dim);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int half = head_dim / 2;
    const long long token = blockIdx.x;
    const long long plane = num_slots * num_kv_heads * head_dim;  // cache[0] is the keys, cache[1] the values
    for (int r = warp; r < num_q_heads + 2 * num_kv_heads; r += warps) {
        if (r < num_q_heads) {
            rotate_row<A, C>(q + token * q_st + r * q_sh, t.cos_row, t.sin_row, half, lane, 0);
        } else if (r < num_q_heads + num_kv_heads) {
            const int h = r - num_q_heads;
            typename C::T* out = t.slot >= 0 ? cache + (t.slot * num_kv_heads + h) * head_dim : 0;
            rotate_row<A, C>(k + token * k_st + h * k_sh, t.cos_row, t.sin_row, half, lane, out);
        } else if (t.slot >= 0) {
            const int h = r - num_q_heads - num_kv_heads;
            const typename A::T* row = v + token * v_st + h * v_sh;
            typename C::T* out = cache + plane + (t.slot * num_kv_heads + h) * head_dim;
            for (int d = lane; d < head_dim; d += 32) out[d] = C::store(A::load(row[d]));
        }
    }
}

// One (token, kv head) row quantized as attention_backends/base.py's quantize_int8 does on CUDA:
// scale = fp16(min(absmax * (1/127), 65504)) (PyTorch's CUDA division by a Python number multiplies
// by its float reciprocal), value = clamp(rint(x / scale), -127, 127), x / 1 where the scale is 0.
// `absmax` is the whole row's (every lane has it); lanes stride over the row.
template <class A>
__device__ void quantize_row(const typename A::T* row, float absmax, signed char* data, unsigned short* scale,
                             int head_dim, int lane) {
    float s = __fmul_rn(absmax, 1.0f / 127.0f);
    s = s > 65504.0f ? 65504.0f : s;  // a comparison, not fminf: a NaN stays NaN, as clamp keeps it
    const unsigned short s16 = F16::store(s);
    const float stored = F16::load(s16);
    const float divisor = stored == 0.0f ? 1.0f : stored;
    for (int d = lane; d < head_dim; d += 32) {
        float x = rintf(__fdiv_rn(A::load(row[d]), divisor));
        x = x < -127.0f ? -127.0f : (x > 127.0f ? 127.0f : x);
        data[d] = (signed char)x;
    }
    if (lane == 0) *scale = s16;
}

// As rotary_kv, into an int8 cache: data int8 [2, num_slots, Hkv, D], scales float16 [2, num_slots, Hkv].
template <class A>
__device__ void rotary_kv_int8(typename A::T* q, long long q_st, long long q_sh, typename A::T* k, long long k_st,
                               long long k_sh, const typename A::T* v, long long v_st, long long v_sh,
                               const long long* positions, const float* cos_table, const float* sin_table,
                               long long num_positions, signed char* data, unsigned short* scales,
                               long long num_slots, const long long* slot_mapping, int num_q_heads,
                               int num_kv_heads, int head_dim) {
    const Token t = token_at(positions, slot_mapping, cos_table, sin_table, num_positions, num_slots, head_dim);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int half = head_dim / 2;
    const long long token = blockIdx.x;
    const long long data_plane = num_slots * num_kv_heads * head_dim, scale_plane = num_slots * num_kv_heads;
    for (int r = warp; r < num_q_heads + 2 * num_kv_heads; r += warps) {
        if (r < num_q_heads) {
            rotate_row<A, F32>(q + token * q_st + r * q_sh, t.cos_row, t.sin_row, half, lane, 0);
        } else if (r < num_q_heads + num_kv_heads) {
            const int h = r - num_q_heads;
            typename A::T* row = k + token * k_st + h * k_sh;
            // Every lane reaches the shuffle (t.slot is the same for the whole block).
            const float absmax = warp_max(rotate_row<A, F32>(row, t.cos_row, t.sin_row, half, lane, 0));
            // quantize_row's lane l reads d = l, l + 32, ...: elements other lanes rotated unless
            // half is a multiple of 32. __syncwarp orders those writes before the reads.
            __syncwarp();
            if (t.slot >= 0)
                quantize_row<A>(row, absmax, data + (t.slot * num_kv_heads + h) * head_dim,
                                scales + t.slot * num_kv_heads + h, head_dim, lane);
        } else if (t.slot >= 0) {
            const int h = r - num_q_heads - num_kv_heads;
            const typename A::T* row = v + token * v_st + h * v_sh;
            float absmax = 0.0f;
            for (int d = lane; d < head_dim; d += 32) absmax = fmaxf(absmax, fabsf(A::load(row[d])));
            absmax = warp_max(absmax);
            quantize_row<A>(row, absmax, data + data_plane + (t.slot * num_kv_heads + h) * head_dim,
                            scales + scale_plane + t.slot * num_kv_heads + h, head_dim, lane);
        }
    }
}

// The exported kernels, one per (activation dtype, cache dtype): rotary_kv_<act>_<cache> and
// rotary_kv_int8_<act>, act and cache among f32, f16, bf16.
#define ROTARY_KV(NAME, A, C)                                                                                   \
    extern "C" __global__ void NAME(A::T* q, long long q_st, long long q_sh, A::T* k, long long k_st,            \
                                    long long k_sh, const A::T* v, long long v_st, long long v_sh,               \
                                    const long long* positions, const float* cos_table, const float* sin_table, \
                                    long long num_positions, C::T* cache, long long num_slots,                   \
                                    const long long* slot_mapping, int num_q_heads, int num_kv_heads,            \
                                    int head_dim) {                                                              \
        rotary_kv<A, C>(q, q_st, q_sh, k, k_st, k_sh, v, v_st, v_sh, positions, cos_table, sin_table,            \
                        num_positions, cache, num_slots, slot_mapping, num_q_heads, num_kv_heads, head_dim);     \
    }

#define ROTARY_KV_INT8(NAME, A)                                                                                 \
    extern "C" __global__ void NAME(A::T* q, long long q_st, long long q_sh, A::T* k, long long k_st,            \
                                    long long k_sh, const A::T* v, long long v_st, long long v_sh,               \
                                    const long long* positions, const float* cos_table, const float* sin_table, \
                                    long long num_positions, signed char* data, unsigned short* scales,          \
                                    long long num_slots, const long long* slot_mapping, int num_q_heads,         \
                                    int num_kv_heads, int head_dim) {                                            \
        rotary_kv_int8<A>(q, q_st, q_sh, k, k_st, k_sh, v, v_st, v_sh, positions, cos_table, sin_table,          \
                          num_positions, data, scales, num_slots, slot_mapping, num_q_heads, num_kv_heads,       \
                          head_dim);                                                                             \
    }

ROTARY_KV(rotary_kv_f32_f32, F32, F32)
ROTARY_KV(rotary_kv_f32_f16, F32, F16)
ROTARY_KV(rotary_kv_f32_bf16, F32, BF16)
ROTARY_KV(rotary_kv_f16_f32, F16, F32)
ROTARY_KV(rotary_kv_f16_f16, F16, F16)
ROTARY_KV(rotary_kv_f16_bf16, F16, BF16)
ROTARY_KV(rotary_kv_bf16_f32, BF16, F32)
ROTARY_KV(rotary_kv_bf16_f16, BF16, F16)
ROTARY_KV(rotary_kv_bf16_bf16, BF16, BF16)
ROTARY_KV_INT8(rotary_kv_int8_f32, F32)
ROTARY_KV_INT8(rotary_kv_int8_f16, F16)
ROTARY_KV_INT8(rotary_kv_int8_bf16, BF16)
