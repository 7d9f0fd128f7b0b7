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
// the last tile row are all padding and only write zeros. (The compact exchange kernels are further down.)
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

// S and Sdec of weight t, from which all its tile scales follow; the weight's first unit also stores the amax
// itself (the `amax` field is A, not a scale).
struct WeightScale {
    float s_enc, s_dec;
};

__device__ __forceinline__ WeightScale weight_scale(const float* __restrict__ amaxes, int t, i64 uu, i64 amax_out) {
    const float amax = amaxes[t];
    if (uu == 0 && threadIdx.x == 0) *reinterpret_cast<float*>(amax_out) = amax;
    const float s_enc = global_encode_scale(amax);
    return {s_enc, 1.0f / s_enc};
}

// s_t and e_t of one tile from its amax and the weight's S and Sdec (shared by fused_scale and owner_scales, so
// both give the same bits).
template <class N>
__device__ __forceinline__ u32 tile_scale(float a_t, float s_enc, float s_dec, float* e_t) {
    const u32 s = e4m3_rne_satfinite(clamp_max(N::decode_scale(a_t, s_enc), kFltMax));
    *e_t = clamp_max(1.0f / (e4m3_to_float(s) * s_dec), kFltMax);
    return s;
}

// Rows [16 band, 16 band + 16) x columns [c0, c0 + width) of a rowwise_scale_inv from the tile scales of that
// band staged in shared memory (zero past the last tile); rows >= m get zero. 4-byte words (cols_pad and c0
// are multiples of 4). Use it through scale_band_unit.
__device__ __forceinline__ void write_band(i64 scale_inv, i64 m, i64 cols_pad, bool aligned, i64 band, i64 c0,
                                           i64 width, const u8* __restrict__ scales) {
    const int words = static_cast<int>(width >> 2);
    u8* base = reinterpret_cast<u8*>(scale_inv);
    for (int i = threadIdx.x; i < words * kTile; i += kThreads) {
        const int rr = i / words, w = i - rr * words;
        const i64 row = band * kTile + rr;
        u32 v = 0;
        if (row < m) {
            v = static_cast<u32>(scales[4 * w]) | (static_cast<u32>(scales[4 * w + 1]) << 8) |
                (static_cast<u32>(scales[4 * w + 2]) << 16) | (static_cast<u32>(scales[4 * w + 3]) << 24);
        }
        u8* p = base + row * cols_pad + c0 + 4 * w;
        if (aligned) {
            *reinterpret_cast<u32*>(p) = v;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) p[j] = static_cast<u8>(v >> (8 * j));
        }
    }
}

// One unit of a row-expanded scale array (both kernels that write one): the 16-row band x kScaleChunk columns
// `uu` of a weight with the layout fields of `d`, each tile (band, col) of the valid region holding
// tile_byte(band, col) and every other byte zero.
template <class Desc, class TileByte>
__device__ __forceinline__ void scale_band_unit(const Desc& d, i64 uu, u8* __restrict__ staged, TileByte tile_byte) {
    const i64 band = uu / d.n_chunks;
    const i64 c0 = (uu % d.n_chunks) * kScaleChunk;
    const i64 width = min(static_cast<i64>(kScaleChunk), d.cols_pad - c0);
    __syncthreads();  // the previous unit's readers of `staged` are done
    for (int c = threadIdx.x; c < width; c += kThreads) {
        const i64 col = c0 + c;
        staged[c] = (band < d.tiles_m && col < d.tiles_k) ? tile_byte(band, col) : static_cast<u8>(0);
    }
    __syncthreads();
    write_band(d.scale_inv, d.m, d.cols_pad, d.flags & kFlagVecDst, band, c0, width, staged);
}

template <class N>
__global__ void __launch_bounds__(kThreads)
fused_scale_kernel(const ScaleDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n,
                   const float* __restrict__ amaxes, float* __restrict__ enc) {
    __shared__ u8 tile_scales[kScaleChunk];
    for (UnitWalk unit(unit_begin, n, blockIdx.x, gridDim.x); unit.next();) {
        const ScaleDesc d = descs[unit.t];
        const WeightScale w = weight_scale(amaxes, unit.t, unit.uu, d.amax_out);
        scale_band_unit(d, unit.uu, tile_scales, [=](i64 band, i64 col) {
            const i64 tile = d.tile_off + band * d.tiles_k + col;
            return static_cast<u8>(tile_scale<N>(amaxes[n + tile], w.s_enc, w.s_dec, enc + tile));
        });
    }
}

template __global__ void fused_scale_kernel<NumericsTe>(const ScaleDesc*, const i64*, int, const float*, float*);
template __global__ void fused_scale_kernel<NumericsTe214>(const ScaleDesc*, const i64*, int, const float*, float*);

// ---------------------------------------------------------------------------------------------------------
// The compact scale exchange (ZeRO, fp4_dist.cast.sharded). Every tile has one owner: the rank that owns
// its first element. A rank's amaxes are complete on every tile its shard touches (tiles it owns whole, and
// tiles cut by a rank boundary, whose amaxes were all-reduced), so it can:
//   owner_scales:  encode multipliers of the tiles its shard touches (for partial_cast), the scale bytes of
//                  the tiles it owns, packed in weight order (for the all-gather), and amax_out of every weight;
//   expand_scales: after the all-gather of every rank's compact bytes, each weight's rowwise_scale_inv.
// Same formulas as fused_scale (tile_scale), so the bytes equal those of the full exchange.

template <class N>
__global__ void __launch_bounds__(kThreads)
owner_scale_kernel(const OwnerDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n,
                   const float* __restrict__ amaxes, float* __restrict__ enc, u8* __restrict__ compact) {
    for (UnitWalk unit(unit_begin, n, blockIdx.x, gridDim.x); unit.next();) {
        const OwnerDesc d = descs[unit.t];
        const WeightScale w = weight_scale(amaxes, unit.t, unit.uu, d.amax_out);
        for (int j = threadIdx.x; j < kOwnerChunk; j += kThreads) {
            const i64 tile = d.enc_lo + unit.uu * kOwnerChunk + j;
            if (tile >= d.enc_hi) break;
            const u32 s = tile_scale<N>(amaxes[n + d.tile_off + tile], w.s_enc, w.s_dec, enc + d.tile_off + tile);
            if (tile >= d.own_lo && tile < d.own_hi) compact[d.own_base + (tile - d.own_lo)] = static_cast<u8>(s);
        }
    }
}

template __global__ void owner_scale_kernel<NumericsTe>(const OwnerDesc*, const i64*, int, const float*, float*, u8*);
template __global__ void owner_scale_kernel<NumericsTe214>(const OwnerDesc*, const i64*, int, const float*, float*, u8*);

// Byte of tile t: the last segment with tile_start <= t (segments are few: one per rank owning part of the
// weight) gives its offset into the gathered bytes.
__device__ __forceinline__ u8 gathered_scale(const i64* __restrict__ segs, i64 begin, i64 count, i64 t,
                                             const u8* __restrict__ gathered) {
    i64 lo = 0, hi = count - 1;
    while (lo < hi) {
        const i64 mid = (lo + hi + 1) >> 1;
        if (segs[2 * (begin + mid)] <= t) lo = mid; else hi = mid - 1;
    }
    return gathered[t + segs[2 * (begin + lo) + 1]];
}

__global__ void __launch_bounds__(kThreads)
expand_scales_kernel(const ExpandDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n,
                     const i64* __restrict__ segs, const u8* __restrict__ gathered) {
    __shared__ u8 tile_scales[kScaleChunk];
    for (UnitWalk unit(unit_begin, n, blockIdx.x, gridDim.x); unit.next();) {
        const ExpandDesc d = descs[unit.t];
        scale_band_unit(d, unit.uu, tile_scales, [=](i64 band, i64 col) {
            return gathered_scale(segs, d.seg_begin, d.seg_count, band * d.tiles_k + col, gathered);
        });
    }
}

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
