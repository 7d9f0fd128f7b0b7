// dequantize: NVFP4 rowwise data + tile scales (row-expanded, or the compact tile grid as all-gathered) + amax
// -> [M, K] values in the model dtype (bf16, fp16 or fp32, per weight), all weights in one launch. The compute
// copy of fp4_dist's NVFP4 weights.
//
// Per element (spec section 3, fp32, one IEEE operation at a time, then round-to-nearest-even to the output):
//   f   = (float(s) * A) * fp32(1/2688)       s = rowwise_scale_inv[row, col / 16] (the row's copy of its tile
//                                             scale, as the reference reads it) or tile_grid[row / 16, col / 16]
//                                             (the same byte), A = amax
//   out = cvt_rn(value(code) * f)             value: 0, .5, 1, 1.5, 2, 3, 4, 6; negative when bit 3 is set
//
// Work: a unit is one 16-row band x 256 columns, handled by ONE warp: lane l converts columns 8l .. 8l + 7 of
// the chunk in each row of the band (4 packed bytes in, 8 values out per row). All 16 rows' loads are issued
// before the first use.
//
// Fast path (16-bit outputs, aligned, 0 <= f < inf): f changes only with the scale byte (once per band for a
// quantizer's output), so the 8 possible outputs of a magnitude code are computed once per change and split
// into two 8-byte planes, their low and their high bytes. PRMT looks 4 nibbles up in a plane at once (the
// selector's low 3 bits per nibble are the magnitude code), a second PRMT interleaves low and high bytes, and
// the sign bit is OR-ed into bit 15: round-to-nearest-even is symmetric, so cvt(-x * f) == -cvt(x * f) for
// finite f >= +0 (for f == +0 too: (-v) * 0 = -0). Every other case (f negative, inf or NaN, fp32 output,
// misaligned pointers) takes the per-element path, which performs the reference's operations one by one.
#include "common.cuh"

namespace fp4d {

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// E4M3 byte -> fp32, sign bit included (0x7F and 0xFF are NaN), as torch's float8_e4m3fn -> float32.
__device__ __forceinline__ float e4m3_to_float_signed(u32 b) {
    const float mag = e4m3_to_float(b & 0x7Fu);
    return (b & 0x80u) ? -mag : mag;
}

// E2M1 code (4 bits) -> its fp32 value, -0.0 for code 8. For magnitudes c >= 2 the fp32 bits are
// (c << 22) + (126 << 23): 2 -> 1.0, 3 -> 1.5, 4 -> 2, 5 -> 3, 6 -> 4, 7 -> 6.
__device__ __forceinline__ float e2m1_value(u32 code) {
    const u32 c = code & 7u;
    const float v = c < 2u ? 0.5f * static_cast<float>(c) : __uint_as_float((c << 22) + (126u << 23));
    return (code & 8u) ? -v : v;
}

// The three output types: two values rounded to 16 bits (first -> low half), or one fp32 as is.
struct OutBf16 {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 p;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));  // first source -> upper half
        return p;
    }
};

struct OutFp16 {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 p;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));
        return p;
    }
};

struct OutFp32 {
    static constexpr int kBytes = 4;
};

constexpr float kInv2688 = 0x1.861862p-12f;  // fp32(1 / 2688), correctly rounded (bits 0x39C30C31)
constexpr int kDeqWarps = kThreads / 32;    // units per block

// Byte planes of the 8 outputs of the magnitude codes for multiplier f (16-bit outputs): (x, y) = low bytes
// of codes 0-3 and 4-7, (z, w) = their high bytes. Not inlined: it runs once per scale change, and inlined
// into every row of the unrolled unit it would only grow the code.
template <class O>
__device__ __noinline__ uint4 byte_planes(float f) {
    const u32 t01 = O::pack2(0.0f * f, 0.5f * f), t23 = O::pack2(1.0f * f, 1.5f * f);
    const u32 t45 = O::pack2(2.0f * f, 3.0f * f), t67 = O::pack2(4.0f * f, 6.0f * f);
    return make_uint4(prmt(t01, t23, 0x6420u), prmt(t45, t67, 0x6420u), prmt(t01, t23, 0x7531u),
                      prmt(t45, t67, 0x7531u));
}

// 8 outputs (16-bit) of one packed word w (element j in nibble j) by plane lookup; see the header.
__device__ __forceinline__ uint4 lookup8(u32 w, const uint4& planes) {
    const u32 w7 = w & 0x77777777u, w7h = w7 >> 16;
    const u32 l0 = prmt(planes.x, planes.y, w7), h0 = prmt(planes.z, planes.w, w7);     // elements 0..3
    const u32 l1 = prmt(planes.x, planes.y, w7h), h1 = prmt(planes.z, planes.w, w7h);   // elements 4..7
    // Sign of element 2j is bit 3 of byte j (the msb of byte j of w << 4), of element 2j + 1 bit 7 of byte j:
    // PRMT's sign-replicate selectors (nibble bit 3 set) spread them over bytes 1 and 3.
    const u32 se = w << 4;
    uint4 o;
    o.x = prmt(l0, h0, 0x5140u) | (prmt(se, w, 0xC080u) & 0x80008000u);
    o.y = prmt(l0, h0, 0x7362u) | (prmt(se, w, 0xD090u) & 0x80008000u);
    o.z = prmt(l1, h1, 0x5140u) | (prmt(se, w, 0xE0A0u) & 0x80008000u);
    o.w = prmt(l1, h1, 0x7362u) | (prmt(se, w, 0xF0B0u) & 0x80008000u);
    return o;
}

// 8 outputs of one packed word, element by element: the reference's operations in its order.
__device__ __forceinline__ void values8(u32 w, float f, float (&v)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = e2m1_value((w >> (4 * j)) & 0xFu) * f;
}

__device__ __forceinline__ void store16(u8* dst, bool vec, const uint4& o) {
    if (vec) {
        *reinterpret_cast<uint4*>(dst) = o;
    } else {
        const u32 w[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
        for (int j = 0; j < 16; ++j) dst[j] = static_cast<u8>(w[j >> 2] >> (8 * (j & 3)));
    }
}

template <class O>
__device__ __forceinline__ void store8(u8* dst, bool vec, const float (&v)[8]) {
    if constexpr (O::kBytes == 4) {
        if (vec) {
            float4* p = reinterpret_cast<float4*>(dst);
            p[0] = make_float4(v[0], v[1], v[2], v[3]);
            p[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u32 b = __float_as_uint(v[j]);
#pragma unroll
                for (int q = 0; q < 4; ++q) dst[4 * j + q] = static_cast<u8>(b >> (8 * q));
            }
        }
    } else {
        const uint4 o = make_uint4(O::pack2(v[0], v[1]), O::pack2(v[2], v[3]), O::pack2(v[4], v[5]),
                                   O::pack2(v[6], v[7]));
        store16(dst, vec, o);
    }
}

// One row's 8 outputs element by element (the rare cases). Not inlined: unrolled 16 times per unit and per
// output type it would multiply the kernel's code size.
template <class O>
__device__ __noinline__ void row_by_elements(u32 w, float f, u8* out, bool vec) {
    float v[8];
    values8(w, f, v);
    store8<O>(out, vec, v);
}

template <class O>
__device__ __forceinline__ void dequant_unit(const DequantDesc& d, i64 uu, int lane) {
    const i64 band = uu / d.n_chunks;
    const i64 col = (uu % d.n_chunks) * kChunkCols + lane * 8;
    if (col >= d.k) return;  // K % 16 == 0: a lane's 8 columns are all inside or all outside
    const i64 row0 = band * kTile;
    const int rows = static_cast<int>(min(static_cast<i64>(kTile), d.m - row0));
    const i64 row_bytes = d.k >> 1;
    const u8* src = reinterpret_cast<const u8*>(d.src) + row0 * row_bytes + (col >> 1);
    const u8* scale = reinterpret_cast<const u8*>(d.scale) + band * d.scale_band + col / kTile;
    u8* dst = reinterpret_cast<u8*>(d.dst) + (row0 * d.k + col) * O::kBytes;
    const bool vec_src = d.flags & kFlagVecSrc, vec_dst = d.flags & kFlagVecDst;
    const float amax = *reinterpret_cast<const float*>(d.amax);
    u32 w[kTile], s[kTile];
#pragma unroll
    for (int r = 0; r < kTile; ++r) {
        w[r] = 0;
        s[r] = 0;
        if (r < rows) {
            w[r] = vec_src ? *reinterpret_cast<const u32*>(src)
                           : (static_cast<u32>(src[0]) | (static_cast<u32>(src[1]) << 8) |
                              (static_cast<u32>(src[2]) << 16) | (static_cast<u32>(src[3]) << 24));
            s[r] = *scale;
        }
        src += row_bytes;
        scale += d.scale_row;
    }
    const i64 out_stride = d.k * O::kBytes;
    u32 cur = 0x100u;  // no scale byte: the first row builds the table
    float f = 0.0f;
    bool fast = false;
    uint4 planes = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < kTile; ++r) {
        if (r < rows) {
            if (s[r] != cur) {
                cur = s[r];
                f = (e4m3_to_float_signed(cur) * amax) * kInv2688;
                fast = O::kBytes == 2 && __float_as_uint(f) < 0x7F800000u;  // +0 <= f < inf
                if constexpr (O::kBytes == 2) {
                    if (fast) planes = byte_planes<O>(f);
                }
            }
            if (O::kBytes == 2 && fast && vec_dst) {
                *reinterpret_cast<uint4*>(dst) = lookup8(w[r], planes);
            } else {
                row_by_elements<O>(w[r], f, dst, vec_dst);
            }
        }
        dst += out_stride;
    }
}

// 4 resident blocks per SM (64 registers, no spills): 32 warps x 16 rows x 4 bytes of loads in flight.
__global__ void __launch_bounds__(kThreads, 4)
dequantize_kernel(const DequantDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 first = static_cast<i64>(blockIdx.x) * kDeqWarps + warp, step = static_cast<i64>(gridDim.x) * kDeqWarps;
    for (UnitWalk unit(unit_begin, n, first, step); unit.next();) {  // units are per warp here
        const DequantDesc d = descs[unit.t];
        if (d.flags & kFlagOutFp32) {
            dequant_unit<OutFp32>(d, unit.uu, lane);
        } else if (d.flags & kFlagOutFp16) {
            dequant_unit<OutFp16>(d, unit.uu, lane);
        } else {
            dequant_unit<OutBf16>(d, unit.uu, lane);
        }
    }
}

}  // namespace fp4d
