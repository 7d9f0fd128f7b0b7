// 1 x 128 FP8 quantization of activations and gradients (the FP8 compute mode), bit for bit the rule of
// kernels/fp8_rows_reference.py: each group of 128 along a row of x [rows, cols] (the last one ragged) gets the
// scale 2^k, k the smallest integer with amax <= 448 * 2^k (0 for an all-zero group, at least -126), and each
// element the E4M3 code of |x * 2^-k| (round to nearest even, saturating) with the sign of x < 0. A group holding
// inf or NaN gets a NaN scale (its codes are those of k = 0).
//
// x is read through two strides, so the transpose of a row-major tensor (the weight gradient's operands, grouped
// along the tokens) is quantized without a copy of it; its reads are then strided. One warp per group; bits are
// written row-major [rows, cols], scales [rows, groups].
#include "common.cuh"

namespace fp4d {

struct LoadBf16 {
    static __device__ __forceinline__ float at(i64 base, i64 i) {
        return __uint_as_float(static_cast<u32>(reinterpret_cast<const u16*>(base)[i]) << 16);
    }
};

struct LoadFp16 {
    static __device__ __forceinline__ float at(i64 base, i64 i) {
        float y;
        asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(reinterpret_cast<const u16*>(base)[i]));
        return y;
    }
};

struct LoadFp32 {
    static __device__ __forceinline__ float at(i64 base, i64 i) { return reinterpret_cast<const float*>(base)[i]; }
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
        float top = 0.0f;
        bool finite = true;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const i64 c = c0 + lane + 32 * i;
            v[i] = c < cols ? L::at(x, r * stride_r + c * stride_c) : 0.0f;
            const float a = fabsf(v[i]);
            finite = finite && a <= kFltMax;
            top = a > top ? a : top;
        }
        finite = __all_sync(0xffffffffu, finite);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
        const int k = finite ? group_shift(top) : 0;
        const float down = pow2_bits(-k);
        u8* out = reinterpret_cast<u8*>(bits) + r * cols;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const i64 c = c0 + lane + 32 * i;
            if (c < cols) {
                const float y = v[i] * down;
                out[c] = static_cast<u8>(e4m3_rne_satfinite(fabsf(y)) | (v[i] < 0.0f ? 0x80u : 0u));
            }
        }
        if (lane == 0) {
            reinterpret_cast<float*>(scales)[g] = finite ? pow2_bits(k) : __uint_as_float(0x7fc00000u);
        }
    }
}

template __global__ void rows_1x128_kernel<LoadBf16>(i64, i64, i64, i64, i64, i64, i64);
template __global__ void rows_1x128_kernel<LoadFp16>(i64, i64, i64, i64, i64, i64, i64);
template __global__ void rows_1x128_kernel<LoadFp32>(i64, i64, i64, i64, i64, i64, i64);

}  // namespace fp4d
