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

// Up to 16 bytes of one columnwise row (ragged M or misaligned rows): `valid` bytes as words or bytes.
__device__ __noinline__ void store_part(u8* p, u32 w0, u32 w1, u32 w2, u32 w3, int valid, bool aligned) {
    const u32 w[4] = {w0, w1, w2, w3};
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const int count = min(4, valid - 4 * g);
        if (count <= 0) return;
        if (count == 4 && aligned) {
            *reinterpret_cast<u32*>(p + 4 * g) = w[g];
        } else {
            for (int b = 0; b < count; ++b) p[4 * g + b] = static_cast<u8>(w[g] >> (8 * b));
        }
    }
}

// One block, one unit: 64 rows (m) x 512 columns (k) of one weight, staged through shared memory so that
// global memory sees only long coalesced segments: the block reads 64 row segments of 256 bytes (16-byte loads,
// four per thread, all in flight before the first use) and writes 512 columnwise row segments of 32 bytes (one
// full sector each, as two 16-byte stores). In between, each thread transposes two 8 x 8 nibble blocks in
// registers. Padded strides (65 and 9 words) keep the shared-memory accesses (nearly) free of bank conflicts.
constexpr int kNtRows = 64, kNtWords = 64;          // unit: 64 m x 64 input words (512 k)
constexpr int kNtInStride = kNtWords + 1;            // words per staged input row
constexpr int kNtOutRows = 8 * kNtWords, kNtOutStride = kNtRows / 8 + 1;  // 512 columnwise rows of 8 words

__device__ __forceinline__ void nibble_load(const TransposeDesc& d, i64 mt, i64 kt, u32* in) {
    const i64 row_bytes = d.k / 2;
    const bool vec16 = (d.flags & kFlagVec16Src) != 0;
    const bool aligned = (d.flags & kFlagVecSrc) != 0;
    uint4 v[4];
#pragma unroll
    for (int it = 0; it < 4; ++it) {  // 64 rows x 16 vectors of 16 bytes
        const int item = it * kThreads + threadIdx.x, r = item >> 4, q = item & 15;
        const i64 m = mt * kNtRows + r, byte = kt * (kNtWords * 4) + 16 * q;
        const u8* p = reinterpret_cast<const u8*>(d.src) + m * row_bytes + byte;
        v[it].x = v[it].y = v[it].z = v[it].w = 0u;
        if (m < d.m && byte < row_bytes) {
            if (vec16) {
                v[it] = *reinterpret_cast<const uint4*>(p);
            } else {  // rows hold whole words (K % 16 == 0), but maybe not whole 16-byte vectors
                v[it].x = load_word(p, aligned);
                v[it].y = load_word(p + 4, aligned);
                if (byte + 8 < row_bytes) {
                    v[it].z = load_word(p + 8, aligned);
                    v[it].w = load_word(p + 12, aligned);
                }
            }
        }
    }
#pragma unroll
    for (int it = 0; it < 4; ++it) {
        const int item = it * kThreads + threadIdx.x, r = item >> 4, q = item & 15;
        u32* row = in + r * kNtInStride + 4 * q;
        row[0] = v[it].x;
        row[1] = v[it].y;
        row[2] = v[it].z;
        row[3] = v[it].w;
    }
}

__device__ __forceinline__ void nibble_store(const TransposeDesc& d, i64 mt, i64 kt, const u32* out) {
    const i64 dst_row = d.m / 2;
    const int valid = static_cast<int>(min(static_cast<i64>(32), dst_row - mt * 32));  // bytes per out row
    const bool vec16 = valid == 32 && (d.flags & kFlagVec16Dst);
#pragma unroll
    for (int it = 0; it < 4; ++it) {  // 512 rows x 2 halves of 16 bytes
        const int item = it * kThreads + threadIdx.x, rr = item >> 1, half = item & 1;
        const i64 k = kt * kNtOutRows + rr;
        if (k >= d.k) continue;
        const u32* w = out + rr * kNtOutStride + 4 * half;
        u8* p = reinterpret_cast<u8*>(d.dst) + k * dst_row + mt * 32 + 16 * half;
        if (vec16) {
            uint4 v;
            v.x = w[0];
            v.y = w[1];
            v.z = w[2];
            v.w = w[3];
            *reinterpret_cast<uint4*>(p) = v;
        } else {
            store_part(p, w[0], w[1], w[2], w[3], valid - 16 * half, (d.flags & kFlagVecDst) != 0);
        }
    }
}

__global__ void __launch_bounds__(kThreads)
nibble_transpose_kernel(const TransposeDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n) {
    __shared__ u32 in[kNtRows * kNtInStride];
    __shared__ u32 out[kNtOutRows * kNtOutStride];
    const int lane = threadIdx.x & 31;
    const i64 total = unit_begin[n];
    int t = 0;
    for (i64 u = blockIdx.x; u < total; u += gridDim.x) {
        t = find_tensor(unit_begin, n, u, t);
        const TransposeDesc d = descs[t];
        const i64 uu = u - unit_begin[t];
        const i64 mt = uu % d.n_mt, kt = uu / d.n_mt;
        __syncthreads();  // the previous unit's readers of `out` are done
        nibble_load(d, mt, kt, in);
        __syncthreads();
#pragma unroll
        for (int it = 0; it < 2; ++it) {
            // (g, c) = (m-group, input word column); lanes spread over 8 g x 4 c, so that the reads of `in`
            // hit 16 banks twice and the writes of `out` 32 distinct banks.
            const int warp_item = (threadIdx.x >> 5) * 2 + it;  // 16 warp items x 4 columns = 64 columns
            const int g = lane & 7, c = warp_item * 4 + (lane >> 3);
            u32 r[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) r[i] = in[(8 * g + i) * kNtInStride + c];
            transpose8x8_nibbles(r);
#pragma unroll
            for (int j = 0; j < 8; ++j) out[(8 * c + j) * kNtOutStride + g] = r[j];
        }
        __syncthreads();
        nibble_store(d, mt, kt, out);
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
