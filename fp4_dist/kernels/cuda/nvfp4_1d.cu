// The nvfp4 compute mode's operands: activations and gradients in NVFP4 with one E4M3 scale per 1 x 16 block, the
// bits of `fp4_dist.kernels.nvfp4_1d_reference` (round to nearest even or stochastic, with or without the 16-point
// random Hadamard transform), and the unscaled values e2m1 * float(scale) in bf16 that the emulated GEMM reads.
//
// The quantized tensor Q [rows, out_cols] is a strided view of the source: element (q, j) is src[q * s_q + j * s_j]
// for j < len and zero past it (a ragged last block, or the tokens padded to 16 | T16). Rows of x are (s_q, s_j) =
// (x's row stride, 1); the wgrad operand pad16(t)^T of t [T, C] is (1, t's row stride) with len = T and out_cols =
// T16, read in place. A thread owns one 16-element block (q, b); with `kFlagQFast` consecutive threads take
// consecutive q (t's columns: coalesced reads of the transposed view), else consecutive b (x's rows).
//
// Per block, all fp32, one IEEE operation at a time (-fmad=false -prec-div=true, no fast math):
//   w_j  = v_j, or with the transform round_to_dtype(sum_i v_i * H[i][j]) (products added to +0 in order i = 0..15,
//          H = diag(RHT_SIGNS) @ H16 / 4: the reference's `rht_16`)
//   A    = *amax (the tensor's, after the transform: `amax_1x16_kernel` first)
//   S    = min(2688 / A, FLT_MAX), 1 if A == 0;      Sdec = 1 / S
//   a_b  = max|w_j| (NaN wins);  s_b = e4m3_rne_satfinite(min(a_b * (S * fp32(1/6)), FLT_MAX))
//   e_b  = min(1 / (float(s_b) * Sdec), FLT_MAX);    y_j = w_j * e_b
//   code = E2M1 round to nearest even of y_j, or stochastic with the byte r = sr_byte(seed, q * 16 nb + 16 b + j)
//          (t = |y| + r * step / 256 floored to the grid at t's spacing, at most 6; NaN gives 6); sign when y < 0
// Packed two per byte (even column low), data [rows, ceil(out_cols / 2)], scales [rows, nb = ceil(out_cols / 16)],
// both written whole. A NaN anywhere makes A NaN, every scale 0x7F and every code that of NaN: the reference's.
#include "common.cuh"

namespace fp4d {

constexpr i64 kFlagQFast = 1;   // thread u takes block (u % rows, u / rows), else (u / nb, u % nb)
constexpr i64 kFlagRht = 2;     // the 16-point random Hadamard transform of each block first
constexpr i64 kFlagSr = 4;      // stochastic rounding (quantize only)
constexpr u32 kRhtSigns = 0xD7E8u;  // bit i set where RHT_SIGNS[i] == -1 (TransformerEngine's wgrad sign vector)
constexpr u32 kNanBits = 0x7fc00000u;

// Sources: element i as fp32 (exact), 16 of them from a 16-byte aligned address in 16-byte loads, and the rounding
// of a transformed value back to the source dtype (`rht_16` returns x's dtype).
struct SrcBf16 {
    using Round = RoundBf16;
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ float at(i64 base, i64 i) {
        return __uint_as_float(static_cast<u32>(reinterpret_cast<const u16*>(base)[i]) << 16);
    }
    static __device__ __forceinline__ void load16(i64 base, i64 i, float (&v)[16]) {
        const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + i);
        const uint4 a = p[0], b = p[1];
        const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            v[2 * j] = bf16_lo(w[j]);
            v[2 * j + 1] = bf16_hi(w[j]);
        }
    }
};

struct SrcFp16 {
    using Round = RoundFp16;
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ float half(u32 h) {
        float y;
        asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(static_cast<u16>(h)));
        return y;
    }
    static __device__ __forceinline__ float at(i64 base, i64 i) { return half(reinterpret_cast<const u16*>(base)[i]); }
    static __device__ __forceinline__ void load16(i64 base, i64 i, float (&v)[16]) {
        const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + i);
        const uint4 a = p[0], b = p[1];
        const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            v[2 * j] = half(w[j] & 0xffffu);
            v[2 * j + 1] = half(w[j] >> 16);
        }
    }
};

struct SrcFp32 : LoadFp32 {
    using Round = RoundFp32;
    static constexpr int kBytes = 4;
};

// max that returns NaN if either input is NaN, as torch's amax does (fmaxf would drop it).
__device__ __forceinline__ float max_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// The block (q, b) of thread unit u.
struct Block {
    i64 q, b;
};

__device__ __forceinline__ Block block_of(i64 u, i64 rows, i64 nb, i64 flags) {
    return (flags & kFlagQFast) ? Block{u % rows, u / rows} : Block{u / nb, u % nb};
}

// The 16 values w_j of block (q, b): the source's (zero past len), through the transform when kFlagRht.
template <class L>
__device__ __forceinline__ void load_block(i64 src, Block blk, i64 len, i64 s_q, i64 s_j, i64 flags, float (&v)[16]) {
    const i64 j0 = blk.b * kTile;
    const i64 first = blk.q * s_q + j0 * s_j;
    if (s_j == 1 && j0 + kTile <= len && ((src + first * L::kBytes) & 15) == 0) {
        L::load16(src, first, v);
    } else {
#pragma unroll
        for (int j = 0; j < kTile; ++j) v[j] = j0 + j < len ? L::at(src, first + j * s_j) : 0.0f;
    }
    if (flags & kFlagRht) {
        float w[kTile];
#pragma unroll
        for (int k = 0; k < kTile; ++k) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < kTile; ++i) {
                // H[i][k] = sign_i * (-1)^popcount(i & k) / 4: the product is exact (a power-of-two factor)
                const bool neg = (((kRhtSigns >> i) & 1u) ^ (__popc(i & k) & 1u)) != 0u;
                acc = __fadd_rn(acc, __fmul_rn(v[i], neg ? -0.25f : 0.25f));
            }
            w[k] = L::Round::apply(acc);
        }
#pragma unroll
        for (int k = 0; k < kTile; ++k) v[k] = w[k];
    }
}

__device__ __forceinline__ float block_amax(const float (&v)[16]) {
    float top = 0.0f;
#pragma unroll
    for (int j = 0; j < kTile; ++j) top = max_nan(top, fabsf(v[j]));
    return top;
}

// The tensor amax max|w| over every block of Q into *amax (fp32 [1], zero before the launch; NaN wins, stored as
// the canonical quiet NaN). A resident grid, each thread looping over units, one atomic per block: the fp32 bits
// of non-negative values order as unsigned integers, and the quiet NaN's above +inf's.
template <class L>
__global__ void __launch_bounds__(kThreads) amax_1x16_kernel(i64 src, i64 rows, i64 len, i64 out_cols, i64 s_q,
                                                             i64 s_j, i64 flags, i64 amax) {
    const i64 nb = (out_cols + kTile - 1) / kTile, units = rows * nb;
    float top = 0.0f;
    for (i64 u = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x; u < units;
         u += static_cast<i64>(gridDim.x) * kThreads) {
        float v[kTile];
        load_block<L>(src, block_of(u, rows, nb, flags), len, s_q, s_j, flags, v);
        top = max_nan(top, block_amax(v));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) top = max_nan(top, __shfl_xor_sync(0xffffffffu, top, off));
    __shared__ float warp_top[kThreads / 32];
    if ((threadIdx.x & 31) == 0) warp_top[threadIdx.x >> 5] = top;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kThreads / 32; ++w) top = max_nan(top, warp_top[w]);
        const u32 bits = top != top ? kNanBits : __float_as_uint(top);
        if (bits != 0u) atomicMax(reinterpret_cast<unsigned int*>(amax), bits);
    }
}

// splitmix64's output function at counter i + 1 of stream `seed`, its top byte: the 8 random bits of element i
// (`nvfp4_1d_reference.stochastic_bits`, the same integer steps in torch int64).
__device__ __forceinline__ u32 sr_byte(unsigned long long seed, unsigned long long i) {
    unsigned long long z = seed + (i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<u32>(z >> 56);
}

__device__ __forceinline__ float e2m1_spacing(float a) { return a >= 4.0f ? 2.0f : (a >= 2.0f ? 1.0f : 0.5f); }

// `stochastic_e2m1_codes` of one value: r * step / 256 is exact (step a power of two), so one rounded add; t / st
// and the floor are exact, and the floored value lies on the E2M1 grid, whose RNE code is its own.
__device__ __forceinline__ u32 sr_code(float y, u32 r) {
    const float a = fabsf(y);
    const float t = __fadd_rn(a, __fmul_rn(static_cast<float>(r), __fmul_rn(e2m1_spacing(a), 0.00390625f)));
    const float st = e2m1_spacing(t);
    float q = __fmul_rn(floorf(__fdiv_rn(t, st)), st);
    q = clamp_max(q, 6.0f);
    q = (y != y) ? 6.0f : q;
    return (E2M1Min::code(q) & 7u) | (y < 0.0f ? 8u : 0u);
}

// One thread per block (q, b): its scale byte and its 8 packed bytes (fewer at a ragged row end).
template <class L>
__global__ void __launch_bounds__(kThreads) quantize_1x16_kernel(i64 src, i64 rows, i64 len, i64 out_cols, i64 s_q,
                                                                 i64 s_j, i64 flags, i64 seed, i64 amax, i64 data,
                                                                 i64 scales) {
    const i64 nb = (out_cols + kTile - 1) / kTile;
    const i64 u = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x;
    if (u >= rows * nb) return;
    const Block blk = block_of(u, rows, nb, flags);
    float v[kTile];
    load_block<L>(src, blk, len, s_q, s_j, flags, v);

    const float a = *reinterpret_cast<const float*>(amax);
    const float s_enc = a == 0.0f ? 1.0f : clamp_max(2688.0f / a, kFltMax);
    const float s_dec = 1.0f / s_enc;
    const float r6 = __uint_as_float(0x3E2AAAABu);  // fp32(1/6), correctly rounded
    const u32 s_b = e4m3_rne_satfinite(clamp_max(block_amax(v) * (s_enc * r6), kFltMax));
    const float e_b = clamp_max(1.0f / (e4m3_to_float(s_b) * s_dec), kFltMax);

    const unsigned long long first = static_cast<unsigned long long>(blk.q * nb * kTile + blk.b * kTile);
    u32 word[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
        const float y = v[j] * e_b;
        const u32 c = (flags & kFlagSr) ? sr_code(y, sr_byte(static_cast<unsigned long long>(seed), first + j))
                                        : E2M1Min::code(y);
        word[j / 8] |= c << (4 * (j % 8));
    }
    const i64 row_bytes = (out_cols + 1) / 2;
    u8* out = reinterpret_cast<u8*>(data) + blk.q * row_bytes + blk.b * 8;
    const i64 n = row_bytes - blk.b * 8 < 8 ? row_bytes - blk.b * 8 : 8;
    if (n == 8 && (reinterpret_cast<i64>(out) & 7) == 0) {
        *reinterpret_cast<uint2*>(out) = make_uint2(word[0], word[1]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // unrolled: constant indices keep `word` in registers
            if (i < n) out[i] = static_cast<u8>(word[i / 4] >> (8 * (i % 4)));
        }
    }
    reinterpret_cast<u8*>(scales)[blk.q * nb + blk.b] = static_cast<u8>(s_b);
}

// The unscaled values e2m1(code) * float(scale) of an NVFP4 1 x 16 tensor [rows, cols] into bf16 [rows, cols]
// (contiguous), one thread per block. Each product has at most 6 significant bits and lies in [2^-10, 2688]: exact
// in fp32 and again in bf16 (the Python side checks that claim over every code and scale). A scale of 0x7F (NaN)
// gives NaN.
__global__ void __launch_bounds__(kThreads) unscaled_bf16_kernel(i64 data, i64 data_stride, i64 scales,
                                                                 i64 scale_stride, i64 rows, i64 cols, i64 out) {
    const i64 nb = (cols + kTile - 1) / kTile;
    const i64 u = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x;
    if (u >= rows * nb) return;
    const i64 q = u / nb, b = u % nb;
    const float s = e4m3_to_float(reinterpret_cast<const u8*>(scales)[q * scale_stride + b]);
    const u8* in = reinterpret_cast<const u8*>(data) + q * data_stride + b * 8;
    const i64 c0 = b * kTile;
    const int n = cols - c0 < kTile ? static_cast<int>(cols - c0) : kTile;
    u32 half[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 byte = 2 * i < n ? in[i] : 0u;
        float pair[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 code = (byte >> (4 * h)) & 15u;
            const u32 m = code & 7u;
            // E2M1 magnitudes 0, .5 by code; from code 2 on 2^((m >> 1) - 1) * (1 + (m & 1) / 2): 1, 1.5, 2, 3, 4, 6
            const float e2m1 = m < 2u ? 0.5f * static_cast<float>(m)
                                      : __uint_as_float(((126u + (m >> 1)) << 23) | ((m & 1u) << 22));
            const float value = (code & 8u) ? -e2m1 : e2m1;
            pair[h] = value * s;
        }
        u32 p;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(pair[1]), "f"(pair[0]));  // first source: upper half
        half[i] = p;
    }
    u16* dst = reinterpret_cast<u16*>(out) + q * cols + c0;
    if (n == kTile && (reinterpret_cast<i64>(dst) & 15) == 0) {
        uint4* d4 = reinterpret_cast<uint4*>(dst);
        d4[0] = make_uint4(half[0], half[1], half[2], half[3]);
        d4[1] = make_uint4(half[4], half[5], half[6], half[7]);
    } else {
#pragma unroll
        for (int j = 0; j < kTile; ++j) {
            if (j < n) dst[j] = static_cast<u16>(half[j / 2] >> (16 * (j % 2)));
        }
    }
}

template __global__ void amax_1x16_kernel<SrcBf16>(i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void amax_1x16_kernel<SrcFp16>(i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void amax_1x16_kernel<SrcFp32>(i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void quantize_1x16_kernel<SrcBf16>(i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void quantize_1x16_kernel<SrcFp16>(i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void quantize_1x16_kernel<SrcFp32>(i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64);

}  // namespace fp4d
