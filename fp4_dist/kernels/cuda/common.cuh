// Shared device code of the NVFP4 stage kernels: rounding to the model dtype, E4M3 and E2M1 rounding,
// the multi-tensor work-table lookup and the descriptor layouts the Python side fills.
//
// No #include: these sources are compiled by NVRTC (at run time, through CuPy) and by nvcc (CI compile test)
// alike, and the loader in _launch.py pastes this header into each .cu so that CuPy's cache key covers it.
// Numerics (spec section 2) need IEEE fp32 one operation at a time: build with -fmad=false -ftz=false
// -prec-div=true and never with fast math. The conversions below are written so that they do not depend on
// those flags, but the scale math in scale.cu does.
#pragma once

namespace fp4d {

typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

constexpr int kTile = 16;
constexpr int kThreads = 256;  // every kernel of this package runs 256-thread blocks
// Resident blocks per SM asked of the streaming kernels: 4-6 x 256 threads x 64 bytes of loads in flight per
// thread keep 64-100 KB in flight per SM, enough to cover DRAM latency on Hopper. (amax at 5 spills.)
constexpr int kMinBlocksAmax = 4;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kMinBlocksCast = 5;  // sm_100's register allocation spills the cast at 6 (40 registers)
#else
constexpr int kMinBlocksCast = 6;
#endif
constexpr float kFltMax = 3.402823466e+38f;
constexpr u32 kInfBits = 0x7f800000u;

// min(v, hi) that lets NaN through, as torch.clamp(max=hi) does (fminf would drop the NaN).
__device__ __forceinline__ float clamp_max(float v, float hi) { return v > hi ? hi : v; }

// ---------------------------------------------------------------------------------------------------------
// Rounding of the master value to the model dtype (spec section 2: "an fp32 master is first rounded to
// bf16"). Each policy returns an fp32 that holds the rounded value exactly. PTX cvt.rn is what
// __float2bfloat16_rn / __float2half_rn compile to; written here so that no header is needed.
struct RoundBf16 {
    static __device__ __forceinline__ float apply(float x) {
        u16 h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return __uint_as_float(static_cast<u32>(h) << 16);
    }
    // Two at once (one cvt for the pair; same rounding as apply): x0 -> r0, x1 -> r1.
    static __device__ __forceinline__ void apply2(float x0, float x1, float& r0, float& r1) {
        u32 p;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(x1), "f"(x0));  // first source -> upper half
        r0 = __uint_as_float(p << 16);
        r1 = __uint_as_float(p & 0xffff0000u);
    }
    static constexpr bool kIdentityOnBf16 = true;
};

struct RoundFp16 {
    static __device__ __forceinline__ float apply(float x) {
        u16 h;
        float y;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(h));
        return y;
    }
    static __device__ __forceinline__ void apply2(float x0, float x1, float& r0, float& r1) {
        r0 = apply(x0);
        r1 = apply(x1);
    }
    static constexpr bool kIdentityOnBf16 = false;
};

struct RoundFp32 {
    static __device__ __forceinline__ float apply(float x) { return x; }
    static __device__ __forceinline__ void apply2(float x0, float x1, float& r0, float& r1) {
        r0 = x0;
        r1 = x1;
    }
    static constexpr bool kIdentityOnBf16 = true;
};

// fp32 values at base (an address) + i elements: one, or 16 consecutive ones from a 16-byte aligned i (the FP8 and
// NVFP4 1-D quantizers' loader of fp32 inputs).
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

// bf16 bits -> the fp32 value they hold (exact).
// 8 consecutive shard values from element `idx` of the shard at address `src` in 16-byte loads: bf16 fills `a`, fp32 fills `a` and `b`.
// The caller has checked that all 8 are owned and that the address is 16-byte aligned.
__device__ __forceinline__ void load8(i64 src, i64 idx, bool bf16, uint4& a, uint4& b) {
    if (bf16) {
        a = *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(src) + idx);
    } else {
        const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const float*>(src) + idx);
        a = p[0];
        b = p[1];
    }
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// ---------------------------------------------------------------------------------------------------------
// E4M3 (float8_e4m3fn) round-to-nearest-even with saturation to 448, subnormals kept, for d >= 0 or NaN.
// Same bits as torch.clamp(d, max=448).to(torch.float8_e4m3fn): NaN gives 0x7F, anything >= 448 gives 0x7E.
__device__ __forceinline__ u32 e4m3_rne_satfinite(float d) {
    if (!(d == d)) return 0x7Fu;
    if (d >= 448.0f) return 0x7Eu;
    if (d < 0.015625f) {
        // Below 2^-6 the E4M3 grid is k * 2^-9 (k = 0..8; k = 8 is the smallest normal, code 0x08, so the
        // carry into the exponent is free). d * 512 is exact; __float2int_rn rounds half to even.
        return static_cast<u32>(__float2int_rn(d * 512.0f));
    }
    u32 u = __float_as_uint(d);
    u = u + 0x7FFFFu + ((u >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even
    u32 code = ((((u >> 23) & 0xFFu) - 120u) << 3) | ((u >> 20) & 7u);  // rebias 127 -> 7
    return code > 0x7Eu ? 0x7Eu : code;
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

__device__ __forceinline__ float e4m3_to_float(u32 code) {
    u32 e = (code >> 3) & 0xFu, m = code & 7u;
    if (code == 0x7Fu) return __uint_as_float(0x7fc00000u);
    if (e == 0) return static_cast<float>(m) * 0.001953125f;  // m * 2^-9, exact
    return __uint_as_float(((e + 120u) << 23) | (m << 20));
}

// ---------------------------------------------------------------------------------------------------------
// E2M1 code of y: round-to-nearest-even on |y| to the grid 0, .5, 1, 1.5, 2, 3, 4, 6 (the thresholds of the
// spec table, section 2.8), saturating (inf gives 7), sign bit 0x8 when y < 0 (so -0.0 and NaN give 0, as the
// reference does). Done in software: sm_90 has no cvt to e2m1.
// The grid step is 0.5 below 2, 1 in [2, 4) and 2 above, so |y| + 2^22 (resp. 2^23, 2^24), a float whose ulp
// is that step, is |y| rounded half-to-even onto the grid by the fp32 add itself; the low bits of the sum are
// the grid index. (Checked against the threshold table on every tie, its neighbours and ~10^7 more values.)
__device__ __forceinline__ u32 e2m1_code(float y) {
    const float a = fabsf(y);
    const bool lo = a < 2.0f, mid = a < 4.0f;
    const float magic = lo ? 4194304.0f : (mid ? 8388608.0f : 16777216.0f);
    const u32 base = lo ? 0x4A800000u : (mid ? 0x4B000000u - 2u : 0x4B800000u - 4u);  // minus the code offset
    u32 c = min(__float_as_uint(a + magic) - base, 7u);
    c = (a == a) ? c : 0u;
    return c | (y < 0.0f ? 8u : 0u);
}

// min that returns NaN if either input is NaN (fminf would return the other input).
__device__ __forceinline__ float min_nan(float a, float b) {
    float d;
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// The same codes with fewer instructions (no selects between three magics): with M = 2^23 (ulp 1), the
// candidates M + rne(2a), M + rne(a) + 2 and M + rne(a / 2) + 4 are single fp32 fma/add results (exact
// products; M, M + 2, M + 4 are even, so each sum rounds half to even), and the E2M1 code is the smallest of
// them, capped at 7: below 2 the first is smallest, in [2, 4) the second, from 4 the third, and at every tie
// the minimum is the even code. NaN propagates through min.NaN, and fmaxf(NaN, M) = M gives code 0. Huge and
// infinite |y| give M + 7. Equal to e2m1_code on every tie, its neighbours, every 1237th float, +-0, +-inf and
// NaN (checked against the reference table; the GPU tests compare the two on 10^7 values).
struct E2M1Min {
    static __device__ __forceinline__ u32 code(float y) {
        constexpr float kM = 8388608.0f;
        const float a = fabsf(y);
        const float lo = __fmaf_rn(a, 2.0f, kM);
        const float mid = __fadd_rn(a, kM + 2.0f);
        const float hi = __fmaf_rn(a, 0.5f, kM + 4.0f);
        const float c = fmaxf(min_nan(min_nan(lo, mid), min_nan(hi, kM + 7.0f)), kM);
        return (__float_as_uint(c) - 0x4B000000u) | (y < 0.0f ? 8u : 0u);
    }
};

struct E2M1Select {  // the three-magic version above
    static __device__ __forceinline__ u32 code(float y) { return e2m1_code(y); }
};

// ---------------------------------------------------------------------------------------------------------
// Multi-tensor work tables. Each launch gets an array of per-tensor descriptors (all fields int64, so the
// Python side fills a plain int64 [n, fields] array; the field order below is mirrored by the *_FIELDS
// tuples in cuda_plans.py, and a CPU test compares the two) and `unit_begin` [n + 1], the prefix sum of each
// tensor's work units. A block finds the tensor of unit u by binary search.

// Largest t in [lo, n) with begin[t] <= u, given begin[lo] <= u < begin[n]. `lo` is the caller's last answer:
// grid-stride loops visit units in increasing order, so the search only moves forward and usually ends at
// once.
__device__ __forceinline__ int find_tensor(const i64* __restrict__ begin, int n, i64 u, int lo) {
    if (u < begin[lo + 1]) return lo;
    int hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (begin[mid] <= u) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// The walk over a launch's work units every kernel makes: units first, first + step, ... of the whole table
// (first/step: this block or warp, and how many the grid has), each as tensor `t` and its unit `uu`:
//     for (UnitWalk unit(unit_begin, n, blockIdx.x, gridDim.x); unit.next();) { ... descs[unit.t], unit.uu ... }
// Units come in increasing order, so find_tensor's search only moves forward.
struct UnitWalk {
    const i64* __restrict__ begin;
    int n;
    int t = 0;
    i64 u, step, total, uu = 0;

    __device__ __forceinline__ UnitWalk(const i64* __restrict__ unit_begin, int n_, i64 first, i64 step_)
        : begin(unit_begin), n(n_), u(first - step_), step(step_), total(unit_begin[n_]) {}

    __device__ __forceinline__ bool next() {
        u += step;
        if (u >= total) return false;
        t = find_tensor(begin, n, u, t);
        uu = u - begin[t];
        return true;
    }
};

// partial_amax and partial_cast: one flat shard [start, end) of a row-major M x K weight.
// Owned units are (16-row band, 256-column chunk) pairs over bands band_lo .. band_lo + n_bands - 1.
struct ShardDesc {
    i64 src;          // shard data pointer (element `start` of the weight)
    i64 dst;          // cast: fragment pointer (byte start >> 1); amax: unused
    i64 start;        // first owned element (row-major)
    i64 end;          // one past the last owned element
    i64 m;
    i64 k;
    i64 tiles_k;      // ceil(K / 16)
    i64 tile_off;     // index of this weight's tile (0, 0) in the packed tile array
    i64 band_lo;      // first 16-row band holding an owned element
    i64 n_chunks;     // ceil(K / 256)
    i64 owned_units;  // n_bands * n_chunks (0 for an empty shard)
    i64 zero_lo;      // amax: tiles [0, zero_lo) and [zero_hi, tiles) are outside the owned bands
    i64 zero_hi;
    i64 zero_units;   // amax: units that write those tiles' zeros (kZeroChunk tiles each)
    i64 flags;        // kFlagBf16Src | kFlagVecSrc | kFlagVecDst
    i64 pad_;
};

constexpr i64 kFlagBf16Src = 1;  // shard holds bf16 (else fp32)
constexpr i64 kFlagVecSrc = 2;   // element e of the weight sits at a 16-byte boundary when e % 8 == 0
constexpr i64 kFlagVecDst = 4;   // cast: byte (e >> 1) of the fragment is 4-byte aligned when e % 8 == 0
constexpr int kChunkCols = 256;  // columns of one owned unit: 32 lanes x 8 elements
constexpr int kZeroChunk = 1024; // tiles zero-filled by one amax zero unit: 256 threads x 4

// fused_scale: one weight's scale row bands.
struct ScaleDesc {
    i64 scale_inv;    // uint8 [rows_pad, cols_pad] rowwise_scale_inv
    i64 amax_out;     // fp32 [1]
    i64 m;
    i64 tiles_m;
    i64 tiles_k;
    i64 cols_pad;     // roundup(tiles_k, 4)
    i64 tile_off;     // this weight's first tile in the packed tile part
    i64 n_chunks;     // ceil(cols_pad / kScaleChunk)
    i64 flags;        // kFlagVecDst: scale_inv is 4-byte aligned (rows are: cols_pad % 4 == 0)
    i64 pad_;
};

constexpr int kScaleChunk = 1024;  // scale columns handled by one fused_scale / expand_scales unit

// owner_scales: one weight's tiles on this rank. Tile t (flat tr * tiles_k + tc) of the weight sits at
// amaxes[n + tile_off + t] and enc[tile_off + t].
struct OwnerDesc {
    i64 amax_out;     // fp32 [1]
    i64 tile_off;
    i64 enc_lo;       // encode multipliers of tiles [enc_lo, enc_hi) (the bands this rank's shard touches)
    i64 enc_hi;
    i64 own_lo;       // scale bytes of tiles [own_lo, own_hi) (the tiles whose first element it owns) go to
    i64 own_hi;       // compact[own_base + t - own_lo]
    i64 own_base;
    i64 pad_;
};

constexpr int kOwnerChunk = 1024;  // tiles handled by one owner_scales unit

// expand_scales: one weight's scale row bands, filled from the all-gathered compact scale bytes. Its tiles are
// covered by seg_count segments (tile_start, offset) of the side table, from entry seg_begin, in increasing
// tile_start (the first one 0): tile t of segment j is byte gathered[t + offset_j].
struct ExpandDesc {
    i64 scale_inv;    // uint8 [rows_pad, cols_pad] rowwise_scale_inv
    i64 m;
    i64 tiles_m;
    i64 tiles_k;
    i64 cols_pad;
    i64 n_chunks;     // ceil(cols_pad / kScaleChunk)
    i64 seg_begin;
    i64 seg_count;
    i64 flags;        // kFlagVecDst: scale_inv is 4-byte aligned
    i64 pad_;
};

// nibble_transpose: [M, K/2] -> [K, M/2].
struct TransposeDesc {
    i64 src;
    i64 dst;
    i64 m;
    i64 k;
    i64 n_mt;         // ceil(M / 64); a unit is 64 rows x 512 columns
    i64 flags;        // kFlagVecSrc: src 4-byte aligned; kFlagVec16Src: src rows 16-byte aligned;
                      // kFlagVecDst: dst rows 4-byte aligned; kFlagVec16Dst: dst rows 16-byte aligned
};

constexpr i64 kFlagVec16Dst = 8;
constexpr i64 kFlagVec16Src = 16;

// scale_transpose: rowwise [rows_pad, cols_pad] -> columnwise [k_pad, mt_pad]; a unit is one tile column j
// (16 columnwise rows) x 1024 tile rows.
struct ScaleTDesc {
    i64 src;
    i64 dst;
    i64 k;
    i64 tiles_m;
    i64 tiles_k;
    i64 src_cols;     // row stride of the rowwise scales
    i64 dst_cols;     // roundup(tiles_m, 4): row stride of the columnwise scales
    i64 dst_rows;     // roundup(K, 128)
    i64 flags;        // kFlagVecDst: dst 4-byte aligned
    i64 pad_;
};


// dequantize: one weight's compute copy [M, K] from its rowwise fields. Units: 16-row band x 256 columns, one
// warp each.
struct DequantDesc {
    i64 src;          // uint8 [M, K/2] rowwise_data
    i64 scale;        // uint8 rowwise_scale_inv [rows_pad, cols_pad] or the tile grid [ceil(M/16), ceil(K/16)]
    i64 amax;         // fp32 [1]
    i64 dst;          // [M, K] output, bf16 (default), fp16 or fp32 (flags)
    i64 m;
    i64 k;
    i64 scale_band;   // scale bytes from one 16-row band's first row to the next band's
    i64 n_chunks;     // ceil(K / 256)
    i64 flags;        // kFlagVecSrc: src 4-byte aligned; kFlagVecDst: dst 16-byte aligned; kFlagOutFp16/Fp32
    i64 scale_row;    // scale bytes from one row to the next: the row stride (row-expanded), 0 (tile grid)
};

constexpr i64 kFlagOutFp16 = 32;
constexpr i64 kFlagOutFp32 = 64;

}  // namespace fp4d
