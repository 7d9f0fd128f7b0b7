// 1 x 128 FP8 quantization of activations and gradients (the FP8 compute mode), bit for bit the rule of
// kernels/fp8_rows_reference.py: each group of 128 along a row of x [rows, cols] (the last one ragged) gets the
// scale 2^k, k the smallest integer with amax <= 448 * 2^k (0 for an all-zero group, at least -126), and each
// element the E4M3 code of |x * 2^-k| (round to nearest even, saturating) with the sign of x < 0. A group holding
// inf or NaN gets a NaN scale (its codes are those of k = 0).
//
// x is read through two strides, so the transpose of a row-major tensor (the weight gradient's operands, grouped
// along the tokens) is quantized without a copy of it; its reads are then strided. One warp per group; bits are
// written row-major [rows, cols], scales [rows, groups] outer-dim-major (scale (r, g) at g * rows + r: the layout
// cuBLAS's 1 x 128 recipe reads, so the GEMM takes them without a copy).
#include "common.cuh"

namespace fp4d {

// Loaders: at(base, i) reads element i; load16(base, i, v) reads elements i..i+15 in 16-byte loads (i a multiple
// of 16 and the address 16-byte aligned: the caller's promise).
// 16 two-byte elements from element i, in two 16-byte loads, as 8 words (element 2j in the low half of word j).
__device__ __forceinline__ void sixteen_halves(i64 base, i64 i, u32 (&w)[8]) {
    const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + i);
    const uint4 a = p[0], b = p[1];
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
}

struct LoadBf16 {
    static __device__ __forceinline__ float widen(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }
    static __device__ __forceinline__ float at(i64 base, i64 i) {
        return __uint_as_float(static_cast<u32>(reinterpret_cast<const u16*>(base)[i]) << 16);
    }
    static __device__ __forceinline__ void load16(i64 base, i64 i, float* v) {
        u32 w[8];
        sixteen_halves(base, i, w);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            v[2 * j] = bf16_lo(w[j]);
            v[2 * j + 1] = bf16_hi(w[j]);
        }
    }
};

struct LoadFp16 {
    static __device__ __forceinline__ float half(u32 h) {
        float y;
        asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(static_cast<u16>(h)));
        return y;
    }
    static __device__ __forceinline__ float widen(u16 h) { return half(h); }
    static __device__ __forceinline__ float at(i64 base, i64 i) { return half(reinterpret_cast<const u16*>(base)[i]); }
    static __device__ __forceinline__ void load16(i64 base, i64 i, float* v) {
        u32 w[8];
        sixteen_halves(base, i, w);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            v[2 * j] = half(w[j] & 0xffffu);
            v[2 * j + 1] = half(w[j] >> 16);
        }
    }
};

struct LoadFp32 {
    static __device__ __forceinline__ float at(i64 base, i64 i) { return reinterpret_cast<const float*>(base)[i]; }
    static __device__ __forceinline__ void load16(i64 base, i64 i, float* v) {
        const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const float*>(base) + i);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint4 a = p[j];
            v[4 * j] = __uint_as_float(a.x);
            v[4 * j + 1] = __uint_as_float(a.y);
            v[4 * j + 2] = __uint_as_float(a.z);
            v[4 * j + 3] = __uint_as_float(a.w);
        }
    }
};

// fp32 2^e from its bits, as the reference's pow2 builds it (for e outside [-126, 127] the same bits as there).
__device__ __forceinline__ float pow2_bits(int e) { return __uint_as_float(static_cast<u32>(e + 127) << 23); }

// The reference's smallest_shift (sig 8): frexp's exponent - 10, raised at most twice by fp32 compares (which
// overflow to inf as torch's do), 0 for a zero top; then at least -126.
__device__ __forceinline__ int group_shift(float top) {
    if (!(top > 0.0f)) return 0;
    int e;
    frexpf(top, &e);
    int k = e - 10;
    for (int i = 0; i < 2; ++i) {
        if (top * 8.0f > 3584.0f * pow2_bits(k)) k += 1;
    }
    return k < -126 ? -126 : k;
}

// The E4M3 codes of two non-negative floats, e4m3_rne_satfinite of each, a's in the low byte. From sm_89 on one
// hardware conversion: its round-to-nearest-even and saturation give the same codes (NaN 0x7F, inf and anything
// from 464 up 0x7E, subnormals on the 2^-9 grid), in one instruction against some twenty each.
__device__ __forceinline__ u32 e4m3_pair(float a, float b) {
#if __CUDA_ARCH__ >= 890
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(b), "f"(a));  // the first source: the high byte
    return d;
#else
    return e4m3_rne_satfinite(a) | (e4m3_rne_satfinite(b) << 8);
#endif
}

__device__ __forceinline__ u32 sign_bit(float v) { return v < 0.0f ? 0x80u : 0u; }  // -0.0 and NaN: none

// One 128-group held by a warp, its element lane + 32 i in v[i] (zeros past the group's end): the codes of the first
// `valid` elements into out[lane + 32 i], the scale (by lane 0) into *scale.
__device__ __forceinline__ void quantize_warp_group(const float (&v)[4], i64 valid, u8* out, float* scale) {
    const int lane = threadIdx.x & 31;
    float top = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float a = fabsf(v[i]);
        finite = finite && a <= kFltMax;
        top = a > top ? a : top;
    }
    finite = __all_sync(0xffffffffu, finite);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    const int k = finite ? group_shift(top) : 0;
    const float down = pow2_bits(-k);
    const u32 pairs[2] = {e4m3_pair(fabsf(v[0] * down), fabsf(v[1] * down)),
                          e4m3_pair(fabsf(v[2] * down), fabsf(v[3] * down))};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (lane + 32 * i < valid) {
            out[lane + 32 * i] = static_cast<u8>(((pairs[i / 2] >> (8 * (i % 2))) & 0xFFu) | sign_bit(v[i]));
        }
    }
    if (lane == 0) *scale = finite ? pow2_bits(k) : __uint_as_float(0x7fc00000u);
}

template <class L>
__global__ void __launch_bounds__(kThreads) rows_1x128_kernel(i64 x, i64 rows, i64 cols, i64 stride_r,
                                                              i64 stride_c, i64 bits, i64 scales) {
    const int lane = threadIdx.x & 31;
    const i64 groups = (cols + 127) / 128;
    const i64 n = rows * groups;
    const i64 warps = static_cast<i64>(gridDim.x) * (kThreads / 32);
    for (i64 g = static_cast<i64>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5); g < n; g += warps) {
        const i64 r = g / groups, c0 = (g % groups) * 128;
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const i64 c = c0 + lane + 32 * i;
            v[i] = c < cols ? L::at(x, r * stride_r + c * stride_c) : 0.0f;
        }
        quantize_warp_group(v, cols - c0, reinterpret_cast<u8*>(bits) + r * cols + c0,
                            reinterpret_cast<float*>(scales) + (g % groups) * rows + r);
    }
}

// The row-major fast path: each thread quantizes 16 consecutive elements (16-byte loads and one 16-byte store), 8
// threads a group, their amax met by shuffles. Needs stride_c = 1, cols % 16 == 0 and 16-byte aligned rows (the
// launcher checks). Lanes of a ragged last group past cols idle.
template <class L>
__global__ void __launch_bounds__(kThreads) rows_1x128_vec_kernel(i64 x, i64 rows, i64 cols, i64 stride_r, i64 bits,
                                                                  i64 scales) {
    constexpr int kEls = 16;
    const i64 groups = (cols + 127) / 128;
    const i64 u = static_cast<i64>(blockIdx.x) * kThreads + threadIdx.x;
    const i64 g = u / 8;  // the group: 8 threads each (lanes 8i..8i+7 of a warp)
    const bool live = g < rows * groups;
    const i64 r = live ? g / groups : 0;
    const i64 c = (g % groups) * 128 + (u % 8) * kEls;
    const bool mine = live && c < cols;
    float v[kEls];
    if (mine) {
        L::load16(x, r * stride_r + c, v);
    } else {
#pragma unroll
        for (int i = 0; i < kEls; ++i) v[i] = 0.0f;
    }
    float top = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < kEls; ++i) {
        const float a = fabsf(v[i]);
        finite = finite && a <= kFltMax;
        top = a > top ? a : top;
    }
    int all_finite = finite ? 1 : 0;
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
        all_finite &= __shfl_xor_sync(0xffffffffu, all_finite, off);
    }
    if (!mine) return;
    const int k = all_finite ? group_shift(top) : 0;
    const float down = pow2_bits(-k);
    u32 word[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const float* e = v + 4 * w;
        word[w] = e4m3_pair(fabsf(e[0] * down), fabsf(e[1] * down)) |
                  (e4m3_pair(fabsf(e[2] * down), fabsf(e[3] * down)) << 16);
        word[w] |= sign_bit(e[0]) | (sign_bit(e[1]) << 8) | (sign_bit(e[2]) << 16) | (sign_bit(e[3]) << 24);
    }
    *reinterpret_cast<uint4*>(reinterpret_cast<u8*>(bits) + r * cols + c) = make_uint4(word[0], word[1], word[2],
                                                                                     word[3]);
    if (u % 8 == 0) {
        reinterpret_cast<float*>(scales)[(g % groups) * rows + r] =
            all_finite ? pow2_bits(k) : __uint_as_float(0x7fc00000u);
    }
}

// The transposed path: the 1 x 128 quantization of y^T for a row-major y [tokens, cols] (the weight gradient's
// operands, grouped along the tokens), bits [cols, tokens] and scales [cols, ceil(tokens / 128)]. A block
// stages a 128-token x 64-column tile of y in shared memory (coalesced reads along y's rows), then each warp
// quantizes 8 of its columns, one 128-token group each, and writes them along the output's rows. Scales
// outer-dim-major, as above: scale (c, g) at g * cols + c.
template <class L>
__global__ void __launch_bounds__(kThreads) cols_1x128_kernel(i64 y, i64 tokens, i64 cols, i64 stride_t, i64 bits,
                                                              i64 scales) {
    constexpr int kCols = 64;
    __shared__ float tile[kCols][128 + 1];
    const i64 tiles_c = (cols + kCols - 1) / kCols;
    const i64 t0 = (blockIdx.x / tiles_c) * 128, c0 = (blockIdx.x % tiles_c) * kCols;
    const int cl = threadIdx.x % kCols;
#pragma unroll 8
    for (int tl = threadIdx.x / kCols; tl < 128; tl += kThreads / kCols) {
        const i64 t = t0 + tl, c = c0 + cl;
        tile[cl][tl] = t < tokens && c < cols ? L::at(y, t * stride_t + c) : 0.0f;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int j = 0; j < kCols / (kThreads / 32); ++j) {
        const int col = warp * (kCols / (kThreads / 32)) + j;
        const i64 c = c0 + col;
        if (c >= cols) break;  // the same for the whole warp
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = tile[col][lane + 32 * i];
        quantize_warp_group(v, tokens - t0, reinterpret_cast<u8*>(bits) + c * tokens + t0,
                            reinterpret_cast<float*>(scales) + (t0 / 128) * cols + c);
    }
}

// Both quantizations of a row-major x [rows, cols] of 2-byte values (bf16, fp16) in one read: 1 x 128 groups along
// its rows (bits [rows, cols], scales outer-dim-major [rows, ceil(cols / 128)]) and along its columns, i.e. of
// x^T (bits [cols, rows], scales outer-dim-major [cols, ceil(rows / 128)]): an activation's forward and weight-
// gradient operands, or an output gradient's dgrad and weight-gradient ones. A block stages a 128 x 128 tile in
// shared memory (its 2-byte values as they are: 33 KB), then each warp quantizes 16 of its rows and 16 of its
// columns, each one group. A whole tile of a 16-byte aligned x is read in 16-byte loads, all eight of a thread's in
// flight at once; a ragged or unaligned one element by element.
template <class L>
__global__ void __launch_bounds__(kThreads) both_1x128_kernel(i64 x, i64 rows, i64 cols, i64 stride_r, i64 bits,
                                                              i64 scales, i64 bits_t, i64 scales_t) {
    __shared__ __align__(16) u16 tile[128][128 + 2];
    const i64 tiles_c = (cols + 127) / 128;
    const i64 r0 = (blockIdx.x / tiles_c) * 128, c0 = (blockIdx.x % tiles_c) * 128;
    if (r0 + 128 <= rows && c0 + 128 <= cols && (x & 15) == 0 && (stride_r & 7) == 0) {
        const int chunk = threadIdx.x % 16, rl = threadIdx.x / 16;  // 8 elements of one row, rows rl + 16 j
        const u16* src = reinterpret_cast<const u16*>(x) + (r0 + rl) * stride_r + c0 + 8 * chunk;
        uint4 q[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = *reinterpret_cast<const uint4*>(src + 16 * j * stride_r);
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // a row is 260 bytes: 4-byte aligned, so four word stores
            u32* dst = reinterpret_cast<u32*>(&tile[rl + 16 * j][8 * chunk]);
            dst[0] = q[j].x, dst[1] = q[j].y, dst[2] = q[j].z, dst[3] = q[j].w;
        }
    } else {
        const int cl = threadIdx.x % 128;
#pragma unroll 8
        for (int rl = threadIdx.x / 128; rl < 128; rl += kThreads / 128) {
            const i64 r = r0 + rl, c = c0 + cl;
            tile[rl][cl] = r < rows && c < cols ? reinterpret_cast<const u16*>(x)[r * stride_r + c] : u16(0);
        }
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int kPerWarp = 128 / (kThreads / 32);  // 16
    for (int j = 0; j < kPerWarp; ++j) {
        const int rl = warp * kPerWarp + j;
        if (r0 + rl >= rows) break;  // the same for the whole warp
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = L::widen(tile[rl][lane + 32 * i]);
        quantize_warp_group(v, cols - c0, reinterpret_cast<u8*>(bits) + (r0 + rl) * cols + c0,
                            reinterpret_cast<float*>(scales) + (c0 / 128) * rows + r0 + rl);
    }
    for (int j = 0; j < kPerWarp; ++j) {
        const int col = warp * kPerWarp + j;
        if (c0 + col >= cols) break;
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = L::widen(tile[lane + 32 * i][col]);
        quantize_warp_group(v, rows - r0, reinterpret_cast<u8*>(bits_t) + (c0 + col) * rows + r0,
                            reinterpret_cast<float*>(scales_t) + (r0 / 128) * cols + c0 + col);
    }
}

template __global__ void rows_1x128_kernel<LoadBf16>(i64, i64, i64, i64, i64, i64, i64);
template __global__ void rows_1x128_kernel<LoadFp16>(i64, i64, i64, i64, i64, i64, i64);
template __global__ void rows_1x128_kernel<LoadFp32>(i64, i64, i64, i64, i64, i64, i64);

template __global__ void rows_1x128_vec_kernel<LoadBf16>(i64, i64, i64, i64, i64, i64);
template __global__ void rows_1x128_vec_kernel<LoadFp16>(i64, i64, i64, i64, i64, i64);
template __global__ void rows_1x128_vec_kernel<LoadFp32>(i64, i64, i64, i64, i64, i64);
template __global__ void cols_1x128_kernel<LoadBf16>(i64, i64, i64, i64, i64, i64);
template __global__ void cols_1x128_kernel<LoadFp16>(i64, i64, i64, i64, i64, i64);
template __global__ void cols_1x128_kernel<LoadFp32>(i64, i64, i64, i64, i64, i64);

template __global__ void both_1x128_kernel<LoadBf16>(i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void both_1x128_kernel<LoadFp16>(i64, i64, i64, i64, i64, i64, i64, i64);

}  // namespace fp4d
