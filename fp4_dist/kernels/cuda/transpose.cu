// Post-all-gather processing, all weights in one launch per kernel:
//   nibble_transpose: rowwise_data [M, K/2] -> columnwise_data [K, M/2], out[k, p] = nib(2p, k) | nib(2p+1, k) << 4
//   scale_transpose:  columnwise_scale_inv[k, mt] = rowwise_scale_inv[16 * mt, k / 16] on k < K, mt < tiles_m;
//                     zero on the rest of the padded [roundup(K, 128), roundup(tiles_m, 4)] array.
#include "common.cuh"

namespace fp4d {

// ---------------------------------------------------------------------------------------------------------
// Nibble transpose. A 32-bit word of a rowwise row holds 8 consecutive k (nibble j = k0 + j, little endian),
// and a word of a columnwise row holds 8 consecutive m, so an 8 x 8 block of nibbles is 8 words in and 8 words
// out: transpose it in registers with three rounds of block swaps (4x4, 2x2, 1x1 nibble blocks).
__device__ __forceinline__ void transpose8x8_nibbles(u32 (&r)[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 a = r[i], b = r[i + 4];
        r[i] = (a & 0x0000FFFFu) | (b << 16);
        r[i + 4] = (a >> 16) | (b & 0xFFFF0000u);
    }
#pragma unroll
    for (int i = 0; i < 8; i += 4) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 a = r[i + j], b = r[i + j + 2];
            r[i + j] = (a & 0x00FF00FFu) | ((b << 8) & 0xFF00FF00u);
            r[i + j + 2] = ((a >> 8) & 0x00FF00FFu) | (b & 0xFF00FF00u);
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
        const u32 a = r[i], b = r[i + 1];
        r[i] = (a & 0x0F0F0F0Fu) | ((b << 4) & 0xF0F0F0F0u);
        r[i + 1] = ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u);
    }
}

__device__ __forceinline__ u32 load_word(const u8* p, bool aligned) {
    if (aligned) return *reinterpret_cast<const u32*>(p);
    return static_cast<u32>(p[0]) | (static_cast<u32>(p[1]) << 8) | (static_cast<u32>(p[2]) << 16) |
           (static_cast<u32>(p[3]) << 24);
}

// One columnwise row's part of a unit, when it cannot be two 16-byte stores (ragged M or misaligned rows):
// `valid` (< 32 or unaligned) bytes as words or bytes. Out of line: it is the rare path.
__device__ __noinline__ void store_row_slow(u8* row, u32 w0, u32 w1, u32 w2, u32 w3, u32 w4, u32 w5, u32 w6,
                                            u32 w7, int valid, bool aligned) {
    const u32 w[8] = {w0, w1, w2, w3, w4, w5, w6, w7};
#pragma unroll
    for (int g = 0; g < 8; ++g) {
        const int count = min(4, valid - 4 * g);
        if (count <= 0) return;
        if (count == 4 && aligned) {
            *reinterpret_cast<u32*>(row + 4 * g) = w[g];
        } else {
            for (int b = 0; b < count; ++b) row[4 * g + b] = static_cast<u8>(w[g] >> (8 * b));
        }
    }
}

// One warp, one unit: 64 rows (m) x 256 columns (k). Lane l reads word column l of 64 rows (coalesced 128-byte
// row segments) and writes its 8 columnwise rows k = 8l .. 8l + 7, 32 bytes each (two 16-byte stores when the
// rows allow it: one full 32-byte sector per row).
__device__ __forceinline__ void nibble_unit(const TransposeDesc& d, i64 uu, int lane) {
    const i64 mt = uu % d.n_mt, kt = uu / d.n_mt;
    const i64 kw = kt * 32 + lane;  // word column: k = 8 kw .. 8 kw + 7
    if (kw >= d.k / 8) return;
    const i64 src_row = d.k / 2, dst_row = d.m / 2;
    const u8* src = reinterpret_cast<const u8*>(d.src) + 4 * kw;
    const bool src_aligned = d.flags & kFlagVecSrc;
    u32 o[8][8];  // o[j][g]: columnwise row 8 kw + j, m-group g of this unit
#pragma unroll
    for (int g = 0; g < 8; ++g) {
        u32 r[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const i64 m = mt * 64 + 8 * g + i;
            r[i] = m < d.m ? load_word(src + m * src_row, src_aligned) : 0u;
        }
        transpose8x8_nibbles(r);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j][g] = r[j];
    }
    const i64 valid = min(static_cast<i64>(32), dst_row - mt * 32);  // bytes of this unit in each out row
    u8* dst = reinterpret_cast<u8*>(d.dst) + mt * 32;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        u8* row = dst + (8 * kw + j) * dst_row;
        if (valid == 32 && (d.flags & kFlagVec16Dst)) {
            reinterpret_cast<uint4*>(row)[0] = make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
            reinterpret_cast<uint4*>(row)[1] = make_uint4(o[j][4], o[j][5], o[j][6], o[j][7]);
        } else {
            store_row_slow(row, o[j][0], o[j][1], o[j][2], o[j][3], o[j][4], o[j][5], o[j][6], o[j][7],
                           static_cast<int>(valid), d.flags & kFlagVecDst);
        }
    }
}

__global__ void __launch_bounds__(kThreads)
nibble_transpose_kernel(const TransposeDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n) {
    const int lane = threadIdx.x & 31;
    const i64 warps = static_cast<i64>(gridDim.x) * (kThreads / 32);
    const i64 total = unit_begin[n];
    int t = 0;
    for (i64 u = blockIdx.x * static_cast<i64>(kThreads / 32) + (threadIdx.x >> 5); u < total; u += warps) {
        t = find_tensor(unit_begin, n, u, t);
        const TransposeDesc d = descs[t];
        nibble_unit(d, u - unit_begin[t], lane);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Scale transpose: each thread writes 4-byte words of the columnwise scale array (4 consecutive tile rows
// mt of one k), gathering the tile scales from row 16 * mt of the rowwise array (small, L2-resident).
__global__ void __launch_bounds__(kThreads)
scale_transpose_kernel(const ScaleTDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n) {
    const i64 total = unit_begin[n];
    int t = 0;
    for (i64 u = blockIdx.x; u < total; u += gridDim.x) {
        t = find_tensor(unit_begin, n, u, t);
        const ScaleTDesc d = descs[t];
        const i64 uu = u - unit_begin[t];
        const u8* src = reinterpret_cast<const u8*>(d.src);
        u8* dst = reinterpret_cast<u8*>(d.dst);
        const u32 row_words = static_cast<u32>(d.dst_cols / 4);
        const i64 n_words = d.dst_rows * row_words;
#pragma unroll
        for (int j = 0; j < kScaleTWords / kThreads; ++j) {
            const i64 w = uu * kScaleTWords + j * kThreads + threadIdx.x;
            if (w >= n_words) break;
            const u32 k = static_cast<u32>(w / row_words), cw = static_cast<u32>(w % row_words);
            u32 v = 0;
            if (k < d.k) {
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const i64 mt = 4 * static_cast<i64>(cw) + b;
                    if (mt < d.tiles_m) v |= static_cast<u32>(src[mt * kTile * d.src_cols + k / kTile]) << (8 * b);
                }
            }
            u8* p = dst + w * 4;
            if (d.flags & kFlagVecDst) {
                *reinterpret_cast<u32*>(p) = v;
            } else {
#pragma unroll
                for (int b = 0; b < 4; ++b) p[b] = static_cast<u8>(v >> (8 * b));
            }
        }
    }
}

}  // namespace fp4d
