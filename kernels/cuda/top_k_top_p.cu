// Top-k then top-p (nucleus) masking of float32 logits, in place: cadenza.cupy_ops.top_k_top_p.
//
// Launch: grid (B), one block per row; block (THREADS_MAX or fewer, a multiple of 32). Every loop
// over the vocabulary is block-strided and bounds-checked, so any block size in 32..1024 and any
// vocabulary size works. Shared memory is static (about 2 KiB).
//
// Semantics (those of samplers/logits_processors.py's TopKTopPProcessor): a row keeps its logits
// >= the k-th largest (ties at the k-th all survive; k <= 0 or k >= V: off), then of those, each
// logit x whose larger kept logits carry less than top_p of their softmax mass (top_p >= 1: off);
// every other logit becomes -inf. The row's largest logit always survives. Ties at the nucleus'
// edge survive together (the sort the torch version does keeps them in an arbitrary order).
//
// How: no sort. The k-th largest value is found by radix select over order-preserving 32-bit keys
// of the floats, 8 bits a pass from the top (4 passes of histogramming, each keeping only the
// bucket holding the k-th). The nucleus' smallest kept key is found the same way, histogramming
// softmax mass as well as counts per bucket and walking buckets from the top while the mass above
// stays under top_p. Then one pass writes -inf below the cut. NaN logits are not supported.
//
// No headers: NVRTC compiles this as is.

#define BINS 256
#define FULL_MASK 0xffffffffu

// Order-preserving key: for floats a < b, key(a) < key(b). -0.0 is folded onto +0.0, so the two
// compare equal as they do as floats. Key 0 is below every float's key (it would be a NaN's).
__device__ __forceinline__ unsigned int order_key(float x) {
    if (x == 0.0f) x = 0.0f;
    unsigned int u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// The block-wide maximum of v; every thread gets it. scratch: shared, one float a warp.
__device__ float block_max(float v, float* scratch) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float result = scratch[0];
    for (int w = 1; w < warps; ++w) result = fmaxf(result, scratch[w]);
    return result;
}

// The key of the row's k-th largest logit, counting repeats (1 <= k <= vocab).
__device__ unsigned int kth_largest_key(const float* row, int vocab, int k, unsigned int* hist,
                                        unsigned int* shared_prefix, int* shared_remaining) {
    unsigned int prefix = 0, prefix_mask = 0;
    int remaining = k;  // the k-th largest is the remaining-th largest key among those under prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < BINS; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const unsigned int key = order_key(row[i]);
            if ((key & prefix_mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // Walk down from the top bucket, skipping buckets that hold fewer keys than remain.
            // The buckets under prefix hold at least `remaining` keys, so bucket 0 is never passed.
            int b = BINS - 1;
            while (b > 0 && hist[b] < (unsigned int)remaining) {
                remaining -= (int)hist[b];
                --b;
            }
            *shared_prefix = prefix | ((unsigned int)b << shift);
            *shared_remaining = remaining;
        }
        __syncthreads();
        prefix = *shared_prefix;
        remaining = *shared_remaining;
        prefix_mask |= 0xffu << shift;
    }
    return prefix;
}

// The smallest key the nucleus keeps. Only logits with key >= floor_key take part (those top-k
// kept); a logit's mass is exp(x - row_max). A key is kept iff the mass of the keys above it is
// below top_p times the total; keys in a bucket are kept down to the bucket's lowest key only if
// the mass above the whole bucket is below it, so each pass keeps the lowest bucket that
// qualifies. The top bucket always qualifies: the row's largest logit is always kept.
__device__ unsigned int nucleus_floor_key(const float* row, int vocab, float row_max, unsigned int floor_key,
                                          float top_p, unsigned int* hist, float* mass,
                                          unsigned int* shared_prefix, float* shared_above, float* shared_target) {
    unsigned int prefix = 0, prefix_mask = 0;
    float above = 0.0f;  // the mass of the taking-part keys above every key under prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
            hist[b] = 0;
            mass[b] = 0.0f;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float x = row[i];
            const unsigned int key = order_key(x);
            if (key >= floor_key && (key & prefix_mask) == prefix) {
                const unsigned int b = (key >> shift) & 0xffu;
                atomicAdd(&hist[b], 1u);
                atomicAdd(&mass[b], expf(x - row_max));
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            if (shift == 24) {
                // The first pass sees every taking-part logit: their total, summed top-down in the
                // order the walks below sum, so a walk over everything reaches exactly this total.
                float total = 0.0f;
                for (int b = BINS - 1; b >= 0; --b) total += mass[b];
                *shared_target = top_p * total;
            }
            const float target = *shared_target;
            int chosen = -1;
            float chosen_above = above, acc = above;
            for (int b = BINS - 1; b >= 0; --b) {
                if (hist[b] == 0) continue;
                if (chosen >= 0 && !(acc < target)) break;
                chosen = b;  // the mass above this bucket is below the target (or it is the top one)
                chosen_above = acc;
                acc += mass[b];
            }
            *shared_prefix = prefix | ((unsigned int)chosen << shift);
            *shared_above = chosen_above;
        }
        __syncthreads();
        prefix = *shared_prefix;
        above = *shared_above;
        prefix_mask |= 0xffu << shift;
    }
    return prefix;
}

// logits [B, vocab] float32, row r at logits + r * row_stride (elements; the vocabulary is
// contiguous); top_k int32 [B]; top_p float32 [B].
extern "C" __global__ void top_k_top_p_f32(float* logits, long long row_stride, int vocab,
                                           const int* top_k, const float* top_p) {
    __shared__ unsigned int hist[BINS];
    __shared__ float mass[BINS];
    __shared__ float scratch[32];
    __shared__ unsigned int shared_prefix;
    __shared__ int shared_remaining;
    __shared__ float shared_above, shared_target;

    float* row = logits + (long long)blockIdx.x * row_stride;
    const int k = top_k[blockIdx.x];
    const float p = top_p[blockIdx.x];
    const bool use_k = k > 0 && k < vocab;
    const bool use_p = p < 1.0f;
    if (!use_k && !use_p) return;  // the same for the whole block: no barrier is left waiting

    unsigned int cut = 0;  // keep the keys >= cut; 0 keeps everything
    if (use_k) cut = kth_largest_key(row, vocab, k, hist, &shared_prefix, &shared_remaining);
    if (use_p) {
        float local = neg_inf();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) local = fmaxf(local, row[i]);
        const float row_max = block_max(local, scratch);
        // An all -inf row (or one holding +inf) has no softmax; it is left to top-k alone.
        if (row_max > neg_inf() && row_max < -neg_inf())
            cut = nucleus_floor_key(row, vocab, row_max, cut, p, hist, mass, &shared_prefix, &shared_above,
                                    &shared_target);
    }
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (order_key(row[i]) < cut) row[i] = neg_inf();
}
