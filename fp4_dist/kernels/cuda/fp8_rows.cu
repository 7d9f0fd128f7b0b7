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
    static constexpr u32 kMaxFinite = 0x7F7Fu;  // the largest finite magnitude's bits: above it inf, then NaN
    static __device__ __forceinline__ float widen(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }
    static __device__ __forceinline__ void pair(u32 w, float& lo, float& hi) { lo = bf16_lo(w), hi = bf16_hi(w); }
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
    static constexpr u32 kMaxFinite = 0x7BFFu;
    static __device__ __forceinline__ float widen(u16 h) { return half(h); }
    static __device__ __forceinline__ void pair(u32 w, float& lo, float& hi) { lo = half(w & 0xffffu), hi = half(w >> 16); }
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
// gradient operands, or an output gradient's dgrad and weight-gradient ones. Every kernel below works on 128 x 128
// tiles of x, each tile's 16384 values once in shared memory (33,280 bytes, laid out as each path reads it).
struct BothArgs {
    i64 x, rows, cols, stride_r, bits, scales, bits_t, scales_t;
};

constexpr int kBothSmemWords = 128 * 65;  // the larger of the two layouts: 128 rows x 130 two-byte values

// One tile, one group per warp at a time: the tile's 2-byte values as they are in shared memory, then each warp
// quantizes 16 of its rows and 16 of its columns, each one group, byte by byte. A whole tile of a 16-byte aligned
// x is read in 16-byte loads, all eight of a thread's in flight at once; a ragged or unaligned one element by
// element. Serves every tile, ragged and unaligned ones included.
template <class L>
__device__ __forceinline__ void both_tile_warps(const BothArgs& a, i64 r0, i64 c0, u32* smem) {
    u16 (*tile)[128 + 2] = reinterpret_cast<u16 (*)[128 + 2]>(smem);
    if (r0 + 128 <= a.rows && c0 + 128 <= a.cols && (a.x & 15) == 0 && (a.stride_r & 7) == 0) {
        const int chunk = threadIdx.x % 16, rl = threadIdx.x / 16;  // 8 elements of one row, rows rl + 16 j
        const u16* src = reinterpret_cast<const u16*>(a.x) + (r0 + rl) * a.stride_r + c0 + 8 * chunk;
        uint4 q[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = *reinterpret_cast<const uint4*>(src + 16 * j * a.stride_r);
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
            tile[rl][cl] = r < a.rows && c < a.cols ? reinterpret_cast<const u16*>(a.x)[r * a.stride_r + c] : u16(0);
        }
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int kPerWarp = 128 / (kThreads / 32);  // 16
    for (int j = 0; j < kPerWarp; ++j) {
        const int rl = warp * kPerWarp + j;
        if (r0 + rl >= a.rows) break;  // the same for the whole warp
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = L::widen(tile[rl][lane + 32 * i]);
        quantize_warp_group(v, a.cols - c0, reinterpret_cast<u8*>(a.bits) + (r0 + rl) * a.cols + c0,
                            reinterpret_cast<float*>(a.scales) + (c0 / 128) * a.rows + r0 + rl);
    }
    for (int j = 0; j < kPerWarp; ++j) {
        const int col = warp * kPerWarp + j;
        if (c0 + col >= a.cols) break;
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = L::widen(tile[lane + 32 * i][col]);
        quantize_warp_group(v, a.rows - r0, reinterpret_cast<u8*>(a.bits_t) + (c0 + col) * a.rows + r0,
                            reinterpret_cast<float*>(a.scales_t) + (r0 / 128) * a.cols + c0 + col);
    }
}

// The "tile" variant: one block per tile, every tile as `both_tile_warps` does it.
template <class L>
__global__ void __launch_bounds__(kThreads) both_1x128_kernel(i64 x, i64 rows, i64 cols, i64 stride_r, i64 bits,
                                                              i64 scales, i64 bits_t, i64 scales_t) {
    __shared__ __align__(16) u32 smem[kBothSmemWords];
    const BothArgs a{x, rows, cols, stride_r, bits, scales, bits_t, scales_t};
    const i64 tiles_c = (cols + 127) / 128;
    both_tile_warps<L>(a, (blockIdx.x / tiles_c) * 128, (blockIdx.x % tiles_c) * 128, smem);
}

// ---- The "vec" path: sixteen values per thread in each direction, 16-byte loads and stores ----
//
// Each group of 128 is held by 8 consecutive lanes, 16 values each, packed two to a 32-bit word as x holds them.
// Their amax is met as 16-bit magnitudes (the value's bits without the sign: for IEEE formats their integer order
// is the order of the magnitudes, inf above every finite value and NaN above inf), two per instruction, so the
// group is finite iff its largest magnitude is at most the format's largest finite one, and its top, widened to
// fp32, is the reference's amax. Each element of a finite group is then one fma and half a conversion:
// fma(x, 2^-k, +0) is x * 2^-k rounded once (the product is exact unless it underflows, where the fma rounds it
// as the reference's fp32 product does) with the sign of x, except that x = -0 gives +0 (IEEE's -0 + +0); and the
// hardware conversion of that signed value is the reference's code of |x * 2^-k| with the sign bit of x < 0
// (round to nearest even is symmetric; a negative value that rounds to zero keeps its sign, -0 from x = -0 does
// not arise). A group holding inf or NaN takes the reference's other rule, element by element (k = 0).

// Two 16-bit unsigned maxima at once.
__device__ __forceinline__ u32 max_u16x2(u32 a, u32 b) {
#if __CUDA_ARCH__ >= 900
    u32 d;
    asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#else
    return max(a & 0xFFFFu, b & 0xFFFFu) | max(a & 0xFFFF0000u, b & 0xFFFF0000u);
#endif
}

// The 16-bit maxima met over the 8 lanes of a group (lanes 8i..8i+7 of a warp; every lane of the warp calls).
__device__ __forceinline__ u32 meet8(u32 m) {
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) m = max_u16x2(m, __shfl_xor_sync(0xffffffffu, m, off));
    return m;
}

// The E4M3 codes of two signed floats (round to nearest even, saturating), a's in the low byte, each with the
// sign bit of its float (that of -0 too).
__device__ __forceinline__ u32 e4m3_pair_signed(float a, float b) {
#if __CUDA_ARCH__ >= 890
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(b), "f"(a));  // the first source: the high byte
    return d;
#else
    return (e4m3_rne_satfinite(fabsf(a)) | ((__float_as_uint(a) >> 31) << 7)) |
           ((e4m3_rne_satfinite(fabsf(b)) | ((__float_as_uint(b) >> 31) << 7)) << 8);
#endif
}

// The scale rule of a group from its largest magnitude's bits: whether it is finite, 2^-k and the scale.
template <class L>
__device__ __forceinline__ void group_rule(u32 top_bits, bool& finite, float& down, float& scale) {
    finite = top_bits <= L::kMaxFinite;
    const int k = finite ? group_shift(L::widen(static_cast<u16>(top_bits))) : 0;
    down = pow2_bits(-k);
    scale = finite ? pow2_bits(k) : __uint_as_float(0x7fc00000u);
}

// The codes of 16 values (element 2i in the low half of w[i], 2i + 1 in the high half), in element order.
template <class L>
__device__ __forceinline__ uint4 codes16(const u32 (&w)[8], bool finite, float down) {
    u32 out[4];
    if (finite) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float e[4];
            L::pair(w[2 * q], e[0], e[1]);
            L::pair(w[2 * q + 1], e[2], e[3]);
            out[q] = e4m3_pair_signed(__fmaf_rn(e[0], down, 0.0f), __fmaf_rn(e[1], down, 0.0f)) |
                     (e4m3_pair_signed(__fmaf_rn(e[2], down, 0.0f), __fmaf_rn(e[3], down, 0.0f)) << 16);
        }
    } else {  // inf or NaN in the group: quantize_warp_group's rule (k = 0), element by element
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float e[4];
            L::pair(w[2 * q], e[0], e[1]);
            L::pair(w[2 * q + 1], e[2], e[3]);
            out[q] = e4m3_pair(fabsf(e[0] * down), fabsf(e[1] * down)) |
                     (e4m3_pair(fabsf(e[2] * down), fabsf(e[3] * down)) << 16);
            out[q] |= sign_bit(e[0]) | (sign_bit(e[1]) << 8) | (sign_bit(e[2]) << 16) | (sign_bit(e[3]) << 24);
        }
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// Whether a tile takes the vec path: whole, x 16-byte aligned with rows 16-byte apart, and every output row of the
// tile 16-byte aligned (cols and rows multiples of 16, outputs 16-byte aligned). Other tiles: both_tile_warps.
__device__ __forceinline__ bool vec_tile(const BothArgs& a, i64 r0, i64 c0) {
    return r0 + 128 <= a.rows && c0 + 128 <= a.cols && ((a.x | a.bits | a.bits_t) & 15) == 0 &&
           (a.stride_r & 7) == 0 && (a.cols & 15) == 0 && (a.rows & 15) == 0;
}

// The vec path's loads of one tile: thread t holds 16 consecutive values (columns 16 (t % 8) ..) of rows
// t / 8 + 32 j, j < 4: 128 bytes in flight per thread.
struct VecRaw {
    uint4 v[4][2];
};

__device__ __forceinline__ void vec_load(const BothArgs& a, i64 r0, i64 c0, VecRaw& raw) {
    const int t = threadIdx.x;
    const u16* src = reinterpret_cast<const u16*>(a.x) + (r0 + (t >> 3)) * a.stride_r + c0 + 16 * (t & 7);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint4* p = reinterpret_cast<const uint4*>(src + 32 * j * a.stride_r);
        raw.v[j][0] = p[0];
        raw.v[j][1] = p[1];
    }
}

// Shared memory of the vec path: the tile as 128 rows x 64 words (two values each), word w of row r stored at
// r * 64 + (w ^ 4 ((r / 16) % 8)). The swizzle moves whole 16-byte chunks, and spreads the column phase's reads
// (8 lanes down one column pair, 16 rows apart, 4 column pairs per warp) over all 32 banks.
__device__ __forceinline__ int vec_word(int r, int w) { return r * 64 + (w ^ (((r >> 4) & 7) << 2)); }

// Row phase: each row group from the registers, its values kept in shared memory for the column phase.
template <class L>
__device__ __forceinline__ void vec_rows(const BothArgs& a, i64 r0, i64 c0, const VecRaw& raw, u32* smem) {
    const int t = threadIdx.x, q = t & 7;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int rl = (t >> 3) + 32 * j;
        const uint4 lo = raw.v[j][0], hi = raw.v[j][1];
        const u32 w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        // lanes 4..7 of a row store their second chunk first: each store's 8 lanes then cover all 32 banks
        const bool swap = (q & 4) != 0;
        *reinterpret_cast<uint4*>(smem + vec_word(rl, 8 * q + (swap ? 4 : 0))) = swap ? hi : lo;
        *reinterpret_cast<uint4*>(smem + vec_word(rl, 8 * q + (swap ? 0 : 4))) = swap ? lo : hi;
        u32 m = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) m = max_u16x2(m, w[i] & 0x7FFF7FFFu);
        m = meet8(max_u16x2(m, m >> 16)) & 0xFFFFu;
        bool finite;
        float down, scale;
        group_rule<L>(m, finite, down, scale);
        const i64 r = r0 + rl;
        *reinterpret_cast<uint4*>(reinterpret_cast<u8*>(a.bits) + r * a.cols + c0 + 16 * q) =
            codes16<L>(w, finite, down);
        if (q == 0) reinterpret_cast<float*>(a.scales)[(c0 / 128) * a.rows + r] = scale;
    }
}

// Column phase: thread t quantizes 16 rows (16 (t % 8) ..) of the column pairs t / 8 + 32 j, j < 2, from shared
// memory; each column's 16 codes are one 16-byte store along its row of bits_t.
template <class L>
__device__ __forceinline__ void vec_cols(const BothArgs& a, i64 r0, i64 c0, const u32* smem) {
    const int t = threadIdx.x, q = t & 7;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int cw = (t >> 3) + 32 * j;  // columns 2 cw and 2 cw + 1
        u32 d[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) d[i] = smem[vec_word(16 * q + i, cw)];
        u32 m = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) m = max_u16x2(m, d[i] & 0x7FFF7FFFu);
        m = meet8(m);  // low half: column 2 cw, high half: column 2 cw + 1
        u32 even[8], odd[8];  // each column's 16 values, two rows to a word
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            even[i] = __byte_perm(d[2 * i], d[2 * i + 1], 0x5410);
            odd[i] = __byte_perm(d[2 * i], d[2 * i + 1], 0x7632);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            bool finite;
            float down, scale;
            group_rule<L>(h ? m >> 16 : m & 0xFFFFu, finite, down, scale);
            const i64 c = c0 + 2 * cw + h;
            *reinterpret_cast<uint4*>(reinterpret_cast<u8*>(a.bits_t) + c * a.rows + r0 + 16 * q) =
                codes16<L>(h ? odd : even, finite, down);
            if (q == 0) reinterpret_cast<float*>(a.scales_t)[(r0 / 128) * a.cols + c] = scale;
        }
    }
}

// The "vec" variant: one block per tile; whole aligned tiles by the vec path, the others by both_tile_warps.
template <class L>
__global__ void __launch_bounds__(kThreads, 4) both_1x128_vec_kernel(i64 x, i64 rows, i64 cols, i64 stride_r,
                                                                     i64 bits, i64 scales, i64 bits_t,
                                                                     i64 scales_t) {  // fmt: skip
    __shared__ __align__(16) u32 smem[kBothSmemWords];
    const BothArgs a{x, rows, cols, stride_r, bits, scales, bits_t, scales_t};
    const i64 tiles_c = (cols + 127) / 128;
    const i64 r0 = (blockIdx.x / tiles_c) * 128, c0 = (blockIdx.x % tiles_c) * 128;
    if (!vec_tile(a, r0, c0)) {
        both_tile_warps<L>(a, r0, c0, smem);
        return;
    }
    VecRaw raw;
    vec_load(a, r0, c0, raw);
    vec_rows<L>(a, r0, c0, raw, smem);
    __syncthreads();
    vec_cols<L>(a, r0, c0, smem);
}

// The "stream" variant: as many blocks as are resident, each taking tiles blockIdx.x, + gridDim.x, ...: the next
// vec tile's loads are issued before the current tile's column phase, so that they are in flight while it runs.
template <class L>
__global__ void __launch_bounds__(kThreads, 3) both_1x128_stream_kernel(i64 x, i64 rows, i64 cols, i64 stride_r,
                                                                        i64 bits, i64 scales, i64 bits_t,
                                                                        i64 scales_t) {  // fmt: skip
    __shared__ __align__(16) u32 smem[kBothSmemWords];
    const BothArgs a{x, rows, cols, stride_r, bits, scales, bits_t, scales_t};
    const i64 tiles_c = (cols + 127) / 128, n = ((rows + 127) / 128) * tiles_c;
    VecRaw raw;
    i64 tile = blockIdx.x;
    if (tile < n && vec_tile(a, (tile / tiles_c) * 128, (tile % tiles_c) * 128)) {
        vec_load(a, (tile / tiles_c) * 128, (tile % tiles_c) * 128, raw);
    }
    for (; tile < n; tile += gridDim.x) {
        const i64 r0 = (tile / tiles_c) * 128, c0 = (tile % tiles_c) * 128;
        const i64 next = tile + gridDim.x, nr0 = (next / tiles_c) * 128, nc0 = (next % tiles_c) * 128;
        const bool prefetch = next < n && vec_tile(a, nr0, nc0);
        if (vec_tile(a, r0, c0)) {
            vec_rows<L>(a, r0, c0, raw, smem);
            __syncthreads();
            if (prefetch) vec_load(a, nr0, nc0, raw);
            vec_cols<L>(a, r0, c0, smem);
        } else {
            both_tile_warps<L>(a, r0, c0, smem);
            if (prefetch) vec_load(a, nr0, nc0, raw);
        }
        __syncthreads();  // the next tile writes the shared memory this one reads
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
template __global__ void both_1x128_vec_kernel<LoadBf16>(i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void both_1x128_vec_kernel<LoadFp16>(i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void both_1x128_stream_kernel<LoadBf16>(i64, i64, i64, i64, i64, i64, i64, i64);
template __global__ void both_1x128_stream_kernel<LoadFp16>(i64, i64, i64, i64, i64, i64, i64, i64);

}  // namespace fp4d
