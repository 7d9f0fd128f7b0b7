// partial_cast: E2M1 nibbles of every owned element of flat master shards, all weights in one launch.
//
// Element e (row-major in its weight) is rounded to the model dtype (policy R), multiplied by its tile's
// encode multiplier e_t (one fp32 multiply), rounded to E2M1 (common.cuh) and stored in byte
// (e >> 1) - (start >> 1) of the weight's fragment, low nibble when e is even. Only owned nibbles are
// written: the other nibble of a byte half-owned at an odd shard end is read and written back unchanged.
// Different weights never share a byte (M * K is even), and within a launch each byte has one writer.
//
// Work units are those of amax.cu (16-row band x 256 columns); a lane converts 8 consecutive elements of two
// rows of its tile and stores 4 bytes per row.
#include "common.cuh"

namespace fp4d {

// 8 nibbles of 8 values: element j in bits 4j..4j+3. C: the E2M1 rounding (E2M1Min or E2M1Select, same bits).
template <class R, class C>
__device__ __forceinline__ u32 encode_words(const uint4& a, const uint4& b, bool bf16, float enc) {
    u32 out = 0;
    if (bf16) {
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float lo = R::apply(bf16_lo(w[j])), hi = R::apply(bf16_hi(w[j]));
            out |= (C::code(lo * enc) | (C::code(hi * enc) << 4)) << (8 * j);
        }
    } else {
        const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            float r0, r1;
            R::apply2(__uint_as_float(w[j]), __uint_as_float(w[j + 1]), r0, r1);
            out |= (C::code(r0 * enc) | (C::code(r1 * enc) << 4)) << (4 * j);
        }
    }
    return out;
}

// Shard edge or misaligned shard/fragment: element by element, read-modify-write of half-owned bytes.
// (Arguments by value, so that the descriptor stays in registers.)
template <class R, class C>
__device__ __forceinline__ void octet_cast_scalar(i64 src, i64 dst, i64 start, i64 end, bool bf16, i64 e0,
                                               float enc) {
    u8* frag = reinterpret_cast<u8*>(dst);
    for (int p = 0; p < 4; ++p) {
        u32 nib[2] = {0, 0};
        bool own[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const i64 e = e0 + 2 * p + q;
            own[q] = e >= start && e < end;
            if (own[q]) {
                const i64 s = e - start;
                const float x = bf16 ? bf16_lo(reinterpret_cast<const u16*>(src)[s])
                                     : reinterpret_cast<const float*>(src)[s];
                nib[q] = C::code(R::apply(x) * enc);
            }
        }
        if (!own[0] && !own[1]) continue;
        u8* byte = frag + (((e0 + 2 * p) >> 1) - (start >> 1));
        u32 v = nib[0] | (nib[1] << 4);
        if (!own[0]) v |= *byte & 0x0Fu;
        if (!own[1]) v |= *byte & 0xF0u;
        *byte = static_cast<u8>(v);
    }
}

template <class R, class C>
__device__ __forceinline__ void cast_unit(const ShardDesc& d, i64 uu, const float* __restrict__ enc) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool bf16 = d.flags & kFlagBf16Src;
    const i64 band = d.band_lo + uu / d.n_chunks;
    const i64 col = (uu % d.n_chunks) * kChunkCols + lane * 8;
    if (col >= d.k) return;
    const float e_t = enc[d.tile_off + band * d.tiles_k + col / kTile];
    i64 e0[2];
    bool vec[2], edge[2];
    uint4 a[2], b[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // issue both rows' loads before any use
        const i64 row = band * kTile + warp + 8 * h;
        e0[h] = row * d.k + col;
        const bool any = row < d.m && e0[h] + 8 > d.start && e0[h] < d.end;
        const bool full = e0[h] >= d.start && e0[h] + 8 <= d.end;
        vec[h] = any && full && (d.flags & kFlagVecSrc) && (d.flags & kFlagVecDst);
        edge[h] = any && !vec[h];
        a[h] = b[h] = make_uint4(0, 0, 0, 0);
        if (vec[h]) load8(d.src, e0[h] - d.start, bf16, a[h], b[h]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (vec[h]) {
            u8* frag = reinterpret_cast<u8*>(d.dst);
            *reinterpret_cast<u32*>(frag + ((e0[h] >> 1) - (d.start >> 1))) = encode_words<R, C>(a[h], b[h], bf16, e_t);
        }
        if (edge[h]) octet_cast_scalar<R, C>(d.src, d.dst, d.start, d.end, bf16, e0[h], e_t);
    }
}

template <class R, class C>
__global__ void __launch_bounds__(kThreads, kMinBlocksCast)
partial_cast_kernel(const ShardDesc* __restrict__ descs, const i64* __restrict__ unit_begin, int n,
                    const float* __restrict__ enc) {
    for (UnitWalk unit(unit_begin, n, blockIdx.x, gridDim.x); unit.next();) {
        const ShardDesc d = descs[unit.t];
        cast_unit<R, C>(d, unit.uu, enc);
    }
}

template __global__ void partial_cast_kernel<RoundBf16, E2M1Min>(const ShardDesc*, const i64*, int, const float*);
template __global__ void partial_cast_kernel<RoundFp16, E2M1Min>(const ShardDesc*, const i64*, int, const float*);
template __global__ void partial_cast_kernel<RoundFp32, E2M1Min>(const ShardDesc*, const i64*, int, const float*);
template __global__ void partial_cast_kernel<RoundBf16, E2M1Select>(const ShardDesc*, const i64*, int, const float*);
template __global__ void partial_cast_kernel<RoundFp16, E2M1Select>(const ShardDesc*, const i64*, int, const float*);
template __global__ void partial_cast_kernel<RoundFp32, E2M1Select>(const ShardDesc*, const i64*, int, const float*);

// Test hook: E2M1 codes of fp32 values, to compare the rounding with the reference on many values at once.
template <class C>
__global__ void __launch_bounds__(kThreads) e2m1_codes_kernel(const float* __restrict__ y, u8* __restrict__ out, i64 n) {
    for (i64 i = blockIdx.x * static_cast<i64>(kThreads) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * kThreads) {
        out[i] = static_cast<u8>(C::code(y[i]));
    }
}

template __global__ void e2m1_codes_kernel<E2M1Min>(const float*, u8*, i64);
template __global__ void e2m1_codes_kernel<E2M1Select>(const float*, u8*, i64);

}  // namespace fp4d
