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

// One block, one unit: ROWS rows (m) x 8 * WORDS columns (k) of one weight, staged through shared memory so that
// global memory sees only long coalesced segments: the block reads ROWS row segments of 4 * WORDS bytes
// (16-byte loads, four per thread, all in flight before the first use) and writes 8 * WORDS columnwise row
// segments of ROWS / 2 bytes (16-byte stores). In between, each thread transposes two 8 x 8 nibble blocks in
// registers. Two shapes are instantiated (ROWS * WORDS = 4096 bytes per unit either way):
//   <64, 64>:  256-byte input segments, 32-byte (one sector) output segments;
//   <128, 32>: 128-byte input segments, 64-byte output segments (fewer DRAM pages touched per byte written).
// Padded strides (WORDS + 1 and ROWS / 8 + 1 words) keep shared-memory accesses at most 2-way conflicted.
template <int ROWS, int WORDS>
struct NibbleUnit {
    static_assert(ROWS * WORDS == 4096, "4 input vectors and 2 nibble blocks per thread");
    static constexpr int kVecsPerRow = WORDS / 4;          // 16-byte vectors per input row segment
    static constexpr int kInStride = WORDS + 1;            // words per staged input row
    static constexpr int kOutRows = 8 * WORDS;             // columnwise rows (k) of a unit
    static constexpr int kOutWords = ROWS / 8;             // words per columnwise row segment
    static constexpr int kOutStride = kOutWords + 1;
    static constexpr int kOutVecs = ROWS / 32;             // 16-byte vectors per columnwise row segment
    static constexpr int kGroups = ROWS / 8;               // 8-row groups (g) of the unit
};

template <int ROWS, int WORDS>
__device__ __forceinline__ void nibble_load(const TransposeDesc& d, i64 mt, i64 kt, u32* in) {
    using U = NibbleUnit<ROWS, WORDS>;
    const i64 row_bytes = d.k / 2;
    const bool vec16 = (d.flags & kFlagVec16Src) != 0;
    const bool aligned = (d.flags & kFlagVecSrc) != 0;
    uint4 v[4];
#pragma unroll
    for (int it = 0; it < 4; ++it) {  // ROWS rows x kVecsPerRow vectors of 16 bytes
        const int item = it * kThreads + threadIdx.x, r = item / U::kVecsPerRow, q = item % U::kVecsPerRow;
        const i64 m = mt * ROWS + r, byte = kt * (WORDS * 4) + 16 * q;
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
        const int item = it * kThreads + threadIdx.x, r = item / U::kVecsPerRow, q = item % U::kVecsPerRow;
        u32* row = in + r * U::kInStride + 4 * q;
        row[0] = v[it].x;
        row[1] = v[it].y;
        row[2] = v[it].z;
        row[3] = v[it].w;
    }
}

template <int ROWS, int WORDS>
__device__ __forceinline__ void nibble_store(const TransposeDesc& d, i64 mt, i64 kt, const u32* out) {
    using U = NibbleUnit<ROWS, WORDS>;
    const i64 dst_row = d.m / 2;
    const int valid = static_cast<int>(min(static_cast<i64>(ROWS / 2), dst_row - mt * (ROWS / 2)));  // bytes per out row
    const bool vec16 = valid == ROWS / 2 && (d.flags & kFlagVec16Dst);
#pragma unroll
    for (int it = 0; it < 4; ++it) {  // kOutRows rows x kOutVecs vectors of 16 bytes
        const int item = it * kThreads + threadIdx.x, rr = item / U::kOutVecs, part = item % U::kOutVecs;
        const i64 k = kt * U::kOutRows + rr;
        if (k >= d.k) continue;
        const u32* w = out + rr * U::kOutStride + 4 * part;
        u8* p = reinterpret_cast<u8*>(d.dst) + k * dst_row + mt * (ROWS / 2) + 16 * part;
        if (vec16) {
            uint4 v;
            v.x = w[0];
            v.y = w[1];
            v.z = w[2];
            v.w = w[3];
            *reinterpret_cast<uint4*>(p) = v;
        } else {
            store_part(p, w[0], w[1], w[2], w[3], valid - 16 * part, (d.flags & kFlagVecDst) != 0);
        }
    }
}

template <int ROWS, int WORDS>
__global__ void __launch_bounds__(kThreads)
nibble_transpose_kernel(const TransposeDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n) {
    using U = NibbleUnit<ROWS, WORDS>;
    __shared__ u32 in[ROWS * U::kInStride];
    __shared__ u32 out[U::kOutRows * U::kOutStride];
    const int lane = threadIdx.x & 31;
    // Lanes of a warp take (g, c) = kGl groups x (32 / kGl) columns: kGl = 8 for <64, 64> (reads of `in` hit 16
    // banks twice, writes of `out` 32 banks), 4 for <128, 32> (reads 32 banks, writes 16 banks twice).
    constexpr int kGl = ROWS == 64 ? 8 : 4;
    constexpr int kCl = 32 / kGl;
    constexpr int kGItems = U::kGroups / kGl;  // warp items along g
    for (UnitWalk unit(unit_begin, n, blockIdx.x, gridDim.x); unit.next();) {
        const TransposeDesc d = descs[unit.t];
        const i64 mt = unit.uu % d.n_mt, kt = unit.uu / d.n_mt;
        __syncthreads();  // the previous unit's readers of `out` are done
        nibble_load<ROWS, WORDS>(d, mt, kt, in);
        __syncthreads();
#pragma unroll
        for (int it = 0; it < 2; ++it) {
            const int warp_item = (threadIdx.x >> 5) * 2 + it;  // 16 warp items of 32 blocks: 512 blocks
            const int g = (warp_item % kGItems) * kGl + (lane % kGl);
            const int c = (warp_item / kGItems) * kCl + (lane / kGl);
            u32 r[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) r[i] = in[(8 * g + i) * U::kInStride + c];
            transpose8x8_nibbles(r);
#pragma unroll
            for (int j = 0; j < 8; ++j) out[(8 * c + j) * U::kOutStride + g] = r[j];
        }
        __syncthreads();
        nibble_store<ROWS, WORDS>(d, mt, kt, out);
    }
}

template __global__ void nibble_transpose_kernel<64, 64>(const TransposeDesc*, const i64*, int);
template __global__ void nibble_transpose_kernel<128, 32>(const TransposeDesc*, const i64*, int);

// ---------------------------------------------------------------------------------------------------------
// Scale transpose. The 16 columnwise rows k = 16 j .. 16 j + 15 are identical (all hold column j of the tile
// scales), so a unit is one tile column j and 1024 tile rows: each thread gathers 4 tile scales (rows 16 mt of
// the rowwise array, small and L2-resident) once and stores the word in all 16 rows, coalesced along the row.
// Tile columns j >= tiles_k are the zero rows k >= K of the padded array.
__global__ void __launch_bounds__(kThreads)
scale_transpose_kernel(const ScaleTDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n) {
    for (UnitWalk unit(unit_begin, n, blockIdx.x, gridDim.x); unit.next();) {
        const ScaleTDesc d = descs[unit.t];
        const i64 row_words = d.dst_cols / 4;
        const i64 chunks = (row_words + kThreads - 1) / kThreads;
        const i64 j = unit.uu / chunks;
        const i64 cw = (unit.uu % chunks) * kThreads + threadIdx.x;
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
