// fused_scale: from the all-reduced amax buffer, every weight's E4M3 tile scales written row-expanded into its
// rowwise_scale_inv (padding zero), its amax, and the per-tile encode multipliers; all weights in one launch.
//
// Per weight (spec section 2, fp32, one IEEE operation at a time; needs -fmad=false -prec-div=true):
//   S    = min(2688 / A, FLT_MAX), 1 if A == 0        Sdec = 1 / S
//   d_t  = min(a_t * (S * R6), FLT_MAX)               (numerics "te-2.14": (a_t / 6) * S)
//   s_t  = e4m3_rne_satfinite(d_t)
//   e_t  = min(1 / (float(s_t) * Sdec), FLT_MAX)
// rowwise_scale_inv[r, c] = s_t[r / 16, c] for r < M and c < tiles_k, else 0 (the whole padded array is
// written, with its true row stride cols_pad: TransformerEngine's stride-tiles_k bug is not repeated).
//
// Work: a unit is one 16-row band of a weight's scale array and up to kScaleChunk of its columns. Bands past
// the last tile row are all padding and only write zeros.
#include "common.cuh"

namespace fp4d {

struct NumericsTe {  // TransformerEngine main
    static __device__ __forceinline__ float decode_scale(float a, float s) {
        const float r6 = __uint_as_float(0x3E2AAAABu);  // fp32(1/6), correctly rounded
        return a * (s * r6);
    }
};

struct NumericsTe214 {  // TransformerEngine v2.14
    static __device__ __forceinline__ float decode_scale(float a, float s) { return (a / 6.0f) * s; }
};

__device__ __forceinline__ float global_encode_scale(float amax) {
    const float s = clamp_max(2688.0f / amax, kFltMax);
    return amax == 0.0f ? 1.0f : s;
}

template <class N>
__global__ void __launch_bounds__(kThreads)
fused_scale_kernel(const ScaleDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n,
                   const float* __restrict__ amaxes, float* __restrict__ enc) {
    __shared__ u8 tile_scale[kScaleChunk];
    const i64 total = unit_begin[n];
    int t = 0;
    for (i64 u = blockIdx.x; u < total; u += gridDim.x) {
        t = find_tensor(unit_begin, n, u, t);
        const ScaleDesc d = descs[t];
        const i64 uu = u - unit_begin[t];
        const i64 band = uu / d.n_chunks;
        const i64 c0 = (uu % d.n_chunks) * kScaleChunk;
        const float amax = amaxes[t];
        const float s_enc = global_encode_scale(amax);
        const float s_dec = 1.0f / s_enc;
        if (uu == 0 && threadIdx.x == 0) *reinterpret_cast<float*>(d.amax_out) = amax;

        const i64 width = min(static_cast<i64>(kScaleChunk), d.cols_pad - c0);
        __syncthreads();  // the previous unit's readers of tile_scale are done
        for (int c = threadIdx.x; c < width; c += kThreads) {
            const i64 col = c0 + c;
            u32 s = 0;
            if (band < d.tiles_m && col < d.tiles_k) {
                const i64 tile = d.tile_off + band * d.tiles_k + col;
                const float a_t = amaxes[n + tile];
                s = e4m3_rne_satfinite(clamp_max(N::decode_scale(a_t, s_enc), kFltMax));
                enc[tile] = clamp_max(1.0f / (e4m3_to_float(s) * s_dec), kFltMax);
            }
            tile_scale[c] = static_cast<u8>(s);
        }
        __syncthreads();

        // 16 rows x width bytes, written as 4-byte words (cols_pad and c0 are multiples of 4).
        const int words = static_cast<int>(width >> 2);
        u8* base = reinterpret_cast<u8*>(d.scale_inv);
        for (int i = threadIdx.x; i < words * kTile; i += kThreads) {
            const int rr = i / words, w = i - rr * words;
            const i64 row = band * kTile + rr;
            u32 v = 0;
            if (row < d.m) {
                v = static_cast<u32>(tile_scale[4 * w]) | (static_cast<u32>(tile_scale[4 * w + 1]) << 8) |
                    (static_cast<u32>(tile_scale[4 * w + 2]) << 16) | (static_cast<u32>(tile_scale[4 * w + 3]) << 24);
            }
            u8* p = base + row * d.cols_pad + c0 + 4 * w;
            if (d.flags & kFlagVecDst) {
                *reinterpret_cast<u32*>(p) = v;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) p[j] = static_cast<u8>(v >> (8 * j));
            }
        }
    }
}

template __global__ void fused_scale_kernel<NumericsTe>(const ScaleDesc*, const i64*, int, const float*, float*);
template __global__ void fused_scale_kernel<NumericsTe214>(const ScaleDesc*, const i64*, int, const float*, float*);

// Test hook: E4M3 bits of non-negative fp32 values (and their decoded values), to compare the software
// rounding with torch's float8_e4m3fn conversion on many values at once.
__global__ void __launch_bounds__(kThreads)
e4m3_codes_kernel(const float* __restrict__ d, u8* __restrict__ out, float* __restrict__ decoded, i64 n) {
    for (i64 i = blockIdx.x * static_cast<i64>(kThreads) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * kThreads) {
        const u32 c = e4m3_rne_satfinite(d[i]);
        out[i] = static_cast<u8>(c);
        decoded[i] = e4m3_to_float(c);
    }
}

}  // namespace fp4d
