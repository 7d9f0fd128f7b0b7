// partial_amax: per-16x16-tile and per-shard max|x| of flat master shards, all weights in one launch.
//
// Output (AmaxLayout): out[t] = shard amax of weight t, out[tile_off + tr * tiles_k + tc] = tile amax, every
// entry written (0 where nothing is owned), NaN counted as +inf. Values are first rounded to the model dtype
// (policy R), as the cast will see them.
//
// Work: a unit is a (16-row band, 256-column chunk) of one weight: warp w reads rows w and w + 8 of the band,
// lane l eight consecutive elements (one 16-byte bf16 load or two fp32 loads), so a warp reads 512 or 1024
// contiguous bytes of a row. Bands with no owned element are not read; "zero units" write their tiles' 0.
// The tensor amax is folded into the same pass: each block keeps a running max per weight and merges it
// into a per-weight scratch word with atomicMax; the block that finishes a weight's last unit (a per-weight
// counter) publishes it and re-zeroes the scratch, so the scratch is all-zero between launches and the
// stage needs no memset launch.
#include "common.cuh"

namespace fp4d {

// |x| as ordered bits: for non-negative floats the uint order is the float order, and every NaN sorts
// above +inf, so min(max_bits, kInfBits) turns NaN into +inf at the end.
__device__ __forceinline__ u32 abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// Max |round(x)| of 8 elements held as raw words: 4 words of bf16 pairs, or 8 fp32 words.
template <class R>
__device__ __forceinline__ u32 words_amax(const uint4& a, const uint4& b, bool bf16) {
    u32 m = 0;
    if (bf16) {
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (R::kIdentityOnBf16) {
                m = max(m, max((w[j] << 16) & 0x7fffffffu, w[j] & 0x7fff0000u));
            } else {
                m = max(m, max(abs_bits(R::apply(bf16_lo(w[j]))), abs_bits(R::apply(bf16_hi(w[j])))));
            }
        }
    } else {
        const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) m = max(m, abs_bits(R::apply(__uint_as_float(w[j]))));
    }
    return m;
}

// Edge of the shard (or a misaligned shard): element by element, owned ones only.
// (Arguments by value, so that the descriptor stays in registers.)
template <class R>
__device__ __forceinline__ u32 octet_amax_scalar(i64 src, i64 start, i64 end, bool bf16, i64 e0) {
    u32 m = 0;
    for (int j = 0; j < 8; ++j) {
        const i64 e = e0 + j;
        if (e < start || e >= end) continue;
        const i64 s = e - start;
        const float x = bf16 ? bf16_lo(reinterpret_cast<const u16*>(src)[s]) : reinterpret_cast<const float*>(src)[s];
        m = max(m, abs_bits(R::apply(x)));
    }
    return m;
}

// Tile amaxes of one owned unit; returns (in thread 0) the max over the unit's tiles.
template <class R>
__device__ __forceinline__ u32 owned_unit(const ShardDesc& d, i64 uu, float* __restrict__ out,
                                          u32 (*red)[16]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool bf16 = d.flags & kFlagBf16Src;
    // 32-bit unit arithmetic (a weight has < 2^32 units): a 64-bit division is a long software sequence.
    const u32 q = static_cast<u32>(uu) / static_cast<u32>(d.n_chunks);
    const i64 band = d.band_lo + q;
    const i64 chunk = static_cast<u32>(uu) - q * static_cast<u32>(d.n_chunks);
    const i64 col = chunk * kChunkCols + lane * 8;
    // Both rows' loads are issued before any use, so each thread has up to 64 bytes in flight.
    i64 e0[2];
    bool vec[2], edge[2];
    uint4 a[2], b[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 row = band * kTile + warp + 8 * h;
        e0[h] = row * d.k + col;
        const bool any = col < d.k && row < d.m && e0[h] + 8 > d.start && e0[h] < d.end;
        const bool full = e0[h] >= d.start && e0[h] + 8 <= d.end;
        vec[h] = any && full && (d.flags & kFlagVecSrc);
        edge[h] = any && !vec[h];
        a[h] = b[h] = make_uint4(0, 0, 0, 0);
        if (vec[h]) load8(d.src, e0[h] - d.start, bf16, a[h], b[h]);
    }
    u32 m = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (vec[h]) m = max(m, words_amax<R>(a[h], b[h], bf16));
        if (edge[h]) m = max(m, octet_amax_scalar<R>(d.src, d.start, d.end, bf16, e0[h]));
    }
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));  // lanes 2c, 2c+1 share tile column c of the chunk
    if ((lane & 1) == 0) red[warp][lane >> 1] = m;
    __syncthreads();
    u32 t = 0;
    if (threadIdx.x < 16) {
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) t = max(t, red[w][threadIdx.x]);
        t = min(t, kInfBits);
        const i64 tc = chunk * (kChunkCols / kTile) + threadIdx.x;
        if (tc < d.tiles_k) out[d.tile_off + band * d.tiles_k + tc] = __uint_as_float(t);
    }
    if (warp == 0) {
#pragma unroll
        for (int s = 8; s > 0; s >>= 1) t = max(t, __shfl_xor_sync(0xffffffffu, t, s));
    }
    return t;
}

// Zeros of the tiles outside the owned bands: zero unit z covers kZeroChunk of them, counted over
// [0, zero_lo) then [zero_hi, tiles).
__device__ __forceinline__ void zero_unit(const ShardDesc& d, i64 z, i64 n_tiles, float* __restrict__ out) {
    const i64 n_zero = n_tiles - (d.zero_hi - d.zero_lo);
#pragma unroll
    for (int j = 0; j < kZeroChunk / kThreads; ++j) {
        const i64 i = z * kZeroChunk + j * kThreads + threadIdx.x;
        if (i < n_zero) out[d.tile_off + (i < d.zero_lo ? i : i - d.zero_lo + d.zero_hi)] = 0.0f;
    }
}

// Merge this block's running max of weight t (thread 0 only) and publish it if this block was the last.
__device__ __forceinline__ void flush_tensor(int t, u32 tmax, i64 units_done, i64 units_total, int n,
                                             float* __restrict__ out, u32* __restrict__ scratch) {
    u32* counter = scratch + n;
    atomicMax(scratch + t, tmax);
    __threadfence();  // the max is visible device-wide before the counter says so
    const u32 before = atomicAdd(counter + t, static_cast<u32>(units_done));
    if (static_cast<i64>(before) + units_done == units_total) {
        __threadfence();
        out[t] = __uint_as_float(atomicExch(scratch + t, 0u));
        atomicExch(counter + t, 0u);
    }
}

template <class R>
__global__ void __launch_bounds__(kThreads, kMinBlocksAmax)
partial_amax_kernel(const ShardDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n,
                    float* __restrict__ out, u32* __restrict__ scratch) {
    __shared__ u32 red[2][kThreads / 32][16];  // double-buffered: one __syncthreads per unit
    int t = 0, parity = 0;  // t: the tensor whose max this block is collecting
    u32 tmax = 0;
    i64 done = 0;
    for (UnitWalk unit(unit_begin, n, blockIdx.x, gridDim.x); unit.next();) {
        if (unit.t != t) {
            if (threadIdx.x == 0 && done) flush_tensor(t, tmax, done, unit_begin[t + 1] - unit_begin[t], n, out, scratch);
            t = unit.t;
            tmax = 0;
            done = 0;
        }
        const ShardDesc d = descs[t];
        const i64 uu = unit.uu;
        if (uu < d.owned_units) {
            tmax = max(tmax, owned_unit<R>(d, uu, out, red[parity]));
            parity ^= 1;  // only units that used `red` flip it: zero units have no barrier
        } else {
            const i64 tiles_m = (d.m + kTile - 1) / kTile;
            zero_unit(d, uu - d.owned_units, tiles_m * d.tiles_k, out);
        }
        ++done;
    }
    if (threadIdx.x == 0 && done) flush_tensor(t, tmax, done, unit_begin[t + 1] - unit_begin[t], n, out, scratch);
}

template __global__ void partial_amax_kernel<RoundBf16>(const ShardDesc*, const i64*, int, float*, u32*);
template __global__ void partial_amax_kernel<RoundFp16>(const ShardDesc*, const i64*, int, float*, u32*);
template __global__ void partial_amax_kernel<RoundFp32>(const ShardDesc*, const i64*, int, float*, u32*);

}  // namespace fp4d
