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

// One columnwise row's part of a unit, when it cannot be one 16-byte store (ragged M or misaligned rows):
// `valid` (< 16, or unaligned) bytes as words or bytes. Out of line: it is the rare path.
__device__ __noinline__ void store_row_slow(u8* row, u32 w0, u32 w1, u32 w2, u32 w3, int valid, bool aligned) {
    const u32 w[4] = {w0, w1, w2, w3};
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const int count = min(4, valid - 4 * g);
        if (count <= 0) return;
        if (count == 4 && aligned) {
            *reinterpret_cast<u32*>(row + 4 * g) = w[g];
        } else {
            for (int b = 0; b < count; ++b) row[4 * g + b] = static_cast<u8>(w[g] >> (8 * b));
        }
    }
}

// One warp, one unit: 32 rows (m) x 256 columns (k). Lane l reads word column l of 32 rows (coalesced 128-byte
// row segments; all 32 loads issued before the first use) and writes its 8 columnwise rows k = 8l .. 8l + 7,
// 16 bytes each. The warp of the next unit writes the other half of those 32-byte sectors.
__device__ __forceinline__ void nibble_unit(const TransposeDesc& d, i64 uu, int lane) {
    const i64 mt = uu % d.n_mt, kt = uu / d.n_mt;
    const i64 kw = kt * 32 + lane;  // word column: k = 8 kw .. 8 kw + 7
    if (kw >= d.k / 8) return;
    const i64 src_row = d.k / 2, dst_row = d.m / 2;
    const u8* src = reinterpret_cast<const u8*>(d.src) + 4 * kw;
    const bool src_aligned = d.flags & kFlagVecSrc;
    u32 r[4][8];  // r[g][i]: row mt * 32 + 8 g + i; after the transpose r[g][j]: column 8 kw + j, m-group g
#pragma unroll
    for (int g = 0; g < 4; ++g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const i64 m = mt * 32 + 8 * g + i;
            r[g][i] = m < d.m ? load_word(src + m * src_row, src_aligned) : 0u;
        }
    }
#pragma unroll
    for (int g = 0; g < 4; ++g) transpose8x8_nibbles(r[g]);
    const i64 valid = min(static_cast<i64>(16), dst_row - mt * 16);  // bytes of this unit in each out row
    u8* dst = reinterpret_cast<u8*>(d.dst) + mt * 16;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        u8* row = dst + (8 * kw + j) * dst_row;
        if (valid == 16 && (d.flags & kFlagVec16Dst)) {
            uint4 v;
            v.x = r[0][j];
            v.y = r[1][j];
            v.z = r[2][j];
            v.w = r[3][j];
            *reinterpret_cast<uint4*>(row) = v;
        } else {
            store_row_slow(row, r[0][j], r[1][j], r[2][j], r[3][j], static_cast<int>(valid), d.flags & kFlagVecDst);
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
// Scale transpose. The 16 columnwise rows k = 16 j .. 16 j + 15 are identical (all hold column j of the tile
// scales), so a unit is one tile column j and 1024 tile rows: each thread gathers 4 tile scales (rows 16 mt of
// the rowwise array, small and L2-resident) once and stores the word in all 16 rows, coalesced along the row.
// Tile columns j >= tiles_k are the zero rows k >= K of the padded array.
__global__ void __launch_bounds__(kThreads)
scale_transpose_kernel(const ScaleTDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n) {
    const i64 total = unit_begin[n];
    int t = 0;
    for (i64 u = blockIdx.x; u < total; u += gridDim.x) {
        t = find_tensor(unit_begin, n, u, t);
        const ScaleTDesc d = descs[t];
        const i64 uu = u - unit_begin[t];
        const i64 row_words = d.dst_cols / 4;
        const i64 chunks = (row_words + kThreads - 1) / kThreads;
        const i64 j = uu / chunks;
        const i64 cw = (uu % chunks) * kThreads + threadIdx.x;
        if (cw >= row_words) continue;
        const u8* src = reinterpret_cast<const u8*>(d.src);
        u32 v = 0;
        if (j < d.tiles_k) {
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const i64 mt = 4 * cw + b;
                if (mt < d.tiles_m) v |= static_cast<u32>(src[mt * kTile * d.src_cols + j]) << (8 * b);
            }
        }
        u8* dst = reinterpret_cast<u8*>(d.dst) + (j * kTile) * d.dst_cols + 4 * cw;
        const bool aligned = d.flags & kFlagVecDst;
#pragma unroll 4
        for (int r = 0; r < kTile; ++r) {
            u8* p = dst + r * d.dst_cols;
            if (aligned) {
                *reinterpret_cast<u32*>(p) = v;
            } else {
                for (int b = 0; b < 4; ++b) p[b] = static_cast<u8>(v >> (8 * b));
            }
        }
    }
}

}  // namespace fp4d
