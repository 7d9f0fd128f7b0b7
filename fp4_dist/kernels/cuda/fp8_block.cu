// The FP8 block copy of an NVFP4 weight (the FP8 compute mode's weight operand), bit for bit the rule of
// kernels/fp8_block_reference.py: each 128 x 128 block of the weight [m, k] gets the fp32 scale
// G * sig/8 * 2^shift whose E4M3 copy has the least squared error against the NVFP4 values (sig in 8..15, ties to
// the smaller), each element the E4M3 code of its NVFP4 value divided by that scale (round to nearest even).
//
// One 256-thread block per 128 x 128 block. Thread t holds the elements t + 256 j (j = 0..63) of the block in
// row-major order, i.e. column t % 128 of rows t / 128 + 2 j: its 64 squared errors are summed as the
// reference's tree_sum pairs them (j with j + 32, then j + 16, ..., then thread t with t + 128, ...), so the
// fp64 sums, and so the choice of sig, are the reference's. Every fp64 operation is written as an explicit
// round-to-nearest intrinsic: a contracted err * err + sum would round once where the reference rounds twice.
#include "common.cuh"

namespace fp4d {

constexpr int kBlock = 128;
constexpr int kPerThread = kBlock * kBlock / kThreads;  // 64
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kMinBlocksFp8Copy = 1;  // sm_100's register allocation spills at 2
#else
constexpr int kMinBlocksFp8Copy = 2;
#endif

// 2 * |q| for an E2M1 code's magnitude bits (code & 7): integers
__device__ __forceinline__ u32 twice_e2m1(u32 code) { return (0xC8643210u >> (4u * (code & 7u))) & 0xFu; }

// 2^e as a double, exact for the small exponents used here (|e| < 1000)
__device__ __forceinline__ double pow2d(int e) {
    return __longlong_as_double(static_cast<long long>(e + 1023) << 52);
}

// The reference's smallest_shift for one significand: the smallest integer s with top <= 448 * sig/8 * 2^s
// (0 for top == 0); exact compares, as the values are small integers times powers of two.
__device__ __forceinline__ int block_shift(float top, int sig) {
    if (!(top > 0.0f)) return 0;
    int e;
    frexpf(top, &e);
    int s = e - 10;
    for (int i = 0; i < 2; ++i) {
        if (__dmul_rn(static_cast<double>(top), 8.0) > __dmul_rn(448.0 * sig, pow2d(s))) s += 1;
    }
    return s;
}

// E4M3 code (no sign) of the value v (in units of G) under the scale sig * 2^(shift - 3): E4M3 (round to nearest
// even) of the fp32 quotient (v * 2^(3 - shift)) / sig, correctly rounded. The reference divides in fp64 and then
// rounds to fp32; rounding a quotient to 53 bits and then to 24 is the same as rounding it to 24 at once (double
// rounding is innocuous for division when 53 >= 2 * 24 + 2), so the fp32 division gives its fp32, and its code.
__device__ __forceinline__ u32 block_code(float v, int sig, int shift) {
    const float scaled = v * __uint_as_float(static_cast<u32>(3 - shift + 127) << 23);  // exact: a power of two
    return e4m3_rne_satfinite(__fdiv_rn(scaled, static_cast<float>(sig)));
}

// |value| of an element held as bf16 bits in the upper half of `bits`
__device__ __forceinline__ float magnitude(u32 bits) { return __uint_as_float(bits & 0x7fff0000u); }

// (copy - value)^2 in fp64 for one element: the difference is exact, its square rounded once.
__device__ __forceinline__ double squared_error(float v, int sig, int shift, double unit) {
    const double copy = __dmul_rn(static_cast<double>(e4m3_to_float(block_code(v, sig, shift))), unit);
    const double e = __dsub_rn(copy, static_cast<double>(v));
    return __dmul_rn(e, e);
}

// fp64 sum over the block's 256 threads, in the order of the reference's tree_sum; every thread gets the sum.
__device__ __forceinline__ double block_tree_sum(double v, double* shared) {
    const int t = threadIdx.x;
    shared[t] = v;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half >>= 1) {
        if (t < half) shared[t] = __dadd_rn(shared[t], shared[t + half]);
        __syncthreads();
    }
    const double total = shared[0];
    __syncthreads();  // shared is written again by the next call
    return total;
}

// data: packed codes [m, k/2] (row stride data_stride bytes, even column in the low nibble); scales: E4M3 tile
// scales, the scale of element (r, c) at scales[(r / scale_row_div) * scale_stride + c / 16] (row-expanded:
// scale_row_div 1; the compact tile grid: 16); amax: the tensor's fp32 amax (one, on the device).
// bits: E4M3 [m, k] row-major; out_scales: fp32 [ceil(m / 128), ceil(k / 128)] row-major.
__global__ void __launch_bounds__(kThreads, kMinBlocksFp8Copy)
    fp8_block_copy_kernel(i64 data, i64 data_stride, i64 scales, i64 scale_stride, i64 scale_row_div, i64 m,
                          i64 k, i64 amax, i64 bits, i64 out_scales) {
    __shared__ double shared[kThreads];
    __shared__ float shared_top[kThreads];
    const i64 blocks_k = (k + kBlock - 1) / kBlock;
    const i64 row0 = (blockIdx.x / blocks_k) * kBlock, col0 = (blockIdx.x % blocks_k) * kBlock;
    const int t = threadIdx.x;
    const i64 c = col0 + (t % kBlock);
    const u8* codes = reinterpret_cast<const u8*>(data);
    const u8* tile_scales = reinterpret_cast<const u8*>(scales);

    // Each element as +-P * 2^X (units of G; P <= 180 has at most 8 significant bits, so the value is exact in
    // bf16's 16 bits): element j in the low half of pair[j % 32][t] for j < 32, in the high half for j >= 32 (the
    // pairs the tree adds first), its sign in the bf16 sign bit. In shared memory, not registers: the sums below
    // index it by a loop counter.
    __shared__ u32 pair[kPerThread / 2][kThreads];
    float top = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
        const i64 r = row0 + t / kBlock + 2 * j;
        u32 half_bits = 0;
        if (r < m && c < k) {
            const u32 byte = codes[r * data_stride + c / 2];
            const u32 code = (c & 1) ? byte >> 4 : byte & 0xFu;
            const u32 s = tile_scales[(r / scale_row_div) * scale_stride + c / kTile];
            const u32 field = (s >> 3) & 0xFu, mantissa = s & 7u;
            const u32 p = twice_e2m1(code) * (field > 0 ? mantissa + 8u : mantissa);
            const int x = static_cast<int>(field > 1 ? field : 1u) - 11;
            const float v = static_cast<float>(p) * __uint_as_float(static_cast<u32>(x + 127) << 23);
            top = v > top ? v : top;
            half_bits = (__float_as_uint(v) >> 16) | ((code & 8u) << 12);
        }
        if (j < kPerThread / 2) pair[j][t] = half_bits;
        else pair[j - kPerThread / 2][t] |= half_bits << 16;
    }
    shared_top[t] = top;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half >>= 1) {
        if (t < half) shared_top[t] = fmaxf(shared_top[t], shared_top[t + half]);
        __syncthreads();
    }
    top = shared_top[0];

    double best_sse = 0.0;
    int best_sig = 8, best_shift = 0;
    for (int sig = 8; sig < 16; ++sig) {
        const int shift = block_shift(top, sig);
        const double unit = __dmul_rn(static_cast<double>(sig), pow2d(shift - 3));
        // The in-thread tree over 64 squares, leaf by leaf in its own order (the bit-reversed j of the 32 first-level
        // pairs), keeping one partial sum per level: the same additions as pairing j with j + 32, then + 16, ...
        double p0 = 0.0, p1 = 0.0, p2 = 0.0, p3 = 0.0, p4 = 0.0, sum = 0.0;  // the partial sum waiting at each level
#pragma unroll 2
        for (int i = 0; i < kPerThread / 2; ++i) {
            const int j = ((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4);
            const u32 both = pair[j][t];
            sum = __dadd_rn(squared_error(magnitude(both << 16), sig, shift, unit),
                            squared_error(magnitude(both & 0xffff0000u), sig, shift, unit));
            // named partials, not an array indexed by the level: that would live in local memory
            if (!(i & 1)) { p0 = sum; continue; }
            sum = __dadd_rn(p0, sum);
            if (!(i & 2)) { p1 = sum; continue; }
            sum = __dadd_rn(p1, sum);
            if (!(i & 4)) { p2 = sum; continue; }
            sum = __dadd_rn(p2, sum);
            if (!(i & 8)) { p3 = sum; continue; }
            sum = __dadd_rn(p3, sum);
            if (!(i & 16)) { p4 = sum; continue; }
            sum = __dadd_rn(p4, sum);  // i = 31: the whole tree
        }
        const double sse = block_tree_sum(sum, shared);
        if (sig == 8 || sse < best_sse) {
            best_sse = sse;
            best_sig = sig;
            best_shift = shift;
        }
    }

    u8* out = reinterpret_cast<u8*>(bits);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
        const i64 r = row0 + t / kBlock + 2 * j;
        if (r < m && c < k) {
            const u32 v = j < kPerThread / 2 ? pair[j][t] << 16 : pair[j - kPerThread / 2][t] & 0xffff0000u;
            out[r * k + c] = static_cast<u8>(block_code(magnitude(v), best_sig, best_shift) | ((v >> 24) & 0x80u));
        }
    }
    if (t == 0) {
        // (G * sig) * 2^(shift - 3), G = A * fp32(1 / 2688): the reference's fp32 operations, one at a time
        const float a = *reinterpret_cast<const float*>(amax);
        const float g = a * (1.0f / 2688.0f);
        reinterpret_cast<float*>(out_scales)[blockIdx.x] =
            (g * static_cast<float>(best_sig)) * __uint_as_float(static_cast<u32>(best_shift - 3 + 127) << 23);
    }
}

}  // namespace fp4d
