// fp4_codec.cu: MXFP4 / NVFP4 quantize and dequantize (SPEC section 2), bit-exact with
// vbw_cupy.reference.
//
// Layout: x is [R, K] row-major (R = product of the leading dims). Blocks of BLOCK elements (32 for
// MXFP4, 16 for NVFP4) run along K; each row is padded with zeros to Kp = ceil(K/BLOCK)*BLOCK.
// data is [R, Kp/2] bytes (element 2i in the low nibble), scales is [R, Kp/BLOCK] bytes.
//
// Tiling: quantize gives each thread 16 consecutive elements (32 B of fp16 input, 8 B of packed output),
// so an NVFP4 block is one thread and an MXFP4 block two lanes that combine their amax with __shfl_xor;
// dequantize gives each thread 16 elements. When K is a multiple of the block (FLAT) the tensor is one
// flat run of groups: 16-byte vector loads/stores and no row arithmetic. Otherwise rows are padded and
// located by a 64-bit division, with scalar bounds-checked loads (the slow, rare path).
// Memory-bound: quantize moves 2 + 0.5 + 1/BLOCK bytes per fp16 element; per-element work is kept to a
// multiply by 2^-e (MXFP4) or one IEEE division (NVFP4, as the SPEC's rounding requires) and 7 compares.
//
// Denormals: compiled without -ftz (see _runtime.py), so float32 denormal inputs and the 2^-127
// MXFP4 scale are exact, as the reference requires.
//
// History (H100, 64M fp16 elements, % of the device-to-device copy bandwidth in the same run):
//   v1 (H200): 8 elements per thread, 64-bit row division, ldexpf: quantize 23-50%, dequantize 56-70%.
//   v2 (H200): FLAT path without division, exp2 by bits, 16 elements per dequantize thread:
//       MXFP4 quantize 42-66%, NVFP4 24-37% (instruction-bound: ~530 Gelem/s whatever the dtype),
//       dequantize 70-77% for fp16/bf16 but 41% for fp32 (strided 64 B per thread).
//   v3: E2M1 encode by exponent/mantissa bits (12 instr, was 21), amax and NaN/Inf test as one integer
//       max, NVFP4 division as reciprocal + one Markstein correction, dequantize stores staged in smem:
//       all 99 bit-exact tests pass; dequantize 71-84%; quantize still 47% MXFP4 / 29% NVFP4 (fp16),
//       ~600 Gelem/s for fp16 and fp32 alike: bound by the 8M short-lived threads, not by bytes.
//   v4: grid-stride quantize loops (8 CTAs of 256 per SM), E4M3 encode/decode from bits. Timing the
//       kernel alone (the public call adds allocations and, for NVFP4, a host sync): quantize MXFP4
//       49% fp16 / 78% fp32, NVFP4 45% / 69%; dequantize 77-87%. Still ~640 Gelem/s for any dtype.
//   v5: 16 elements (two 16 B loads) per quantize thread: an NVFP4 block per thread, no shuffles.
//       Kernel alone: quantize MXFP4 59% fp16, 56% bf16, 88% fp32; NVFP4 56% / 54% / 86%;
//       dequantize 82-88%. 16-bit quantize is still bound by per-element work (~750 Gelem/s, ~22
//       instructions an element in float32); next step: amax and NaN test on packed 16-bit lanes.
#include "fp4.cuh"

namespace vbw {

template <typename T> struct Vec8 { T v[8]; };

template <typename T, bool VEC>
__device__ __forceinline__ void load8(const T* __restrict__ row, long long k0, long long K, float (&f)[8]) {
    if (VEC) {
        Vec8<T> p;
        constexpr int N16 = sizeof(Vec8<T>) / 16;
        const uint4* src = reinterpret_cast<const uint4*>(row + k0);
        uint4* dst = reinterpret_cast<uint4*>(&p);
#pragma unroll
        for (int i = 0; i < N16; ++i) dst[i] = __ldg(src + i);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = to_float(p.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = (k0 + i < K) ? to_float(row[k0 + i]) : 0.0f;
    }
}

}  // namespace vbw

using namespace vbw;

// Thread t owns 16-element group t of the padded [R, Kp] tensor (Kp is a multiple of 16 for both
// formats). FLAT (K a multiple of the block, so Kp == K) needs no row arithmetic and loads 16 B vectors;
// otherwise rows are located with a division and loads are scalar and bounds-checked.
template <typename T, bool FLAT>
__device__ __forceinline__ bool load_group(const T* __restrict__ x, long long t, long long R, long long K,
                                           long long Kp, float (&f)[16]) {
    const long long groups = Kp / 16;
    bool live = t < R * groups;
    float (&lo)[8] = *reinterpret_cast<float (*)[8]>(&f[0]);
    float (&hi)[8] = *reinterpret_cast<float (*)[8]>(&f[8]);
    if (FLAT) {
        if (live) { load8<T, true>(x, t * 16, K, lo); load8<T, true>(x, t * 16 + 8, K, hi); }
    } else if (live) {
        long long r = t / groups, g = t - r * groups;
        load8<T, false>(x + r * K, g * 16, K, lo);
        load8<T, false>(x + r * K, g * 16 + 8, K, hi);
    }
    if (!live) {
#pragma unroll
        for (int i = 0; i < 16; ++i) f[i] = 0.0f;
    }
    return live;
}

// 2^n for n in [-127, 127], built from bits (2^-127 is a float32 denormal, exact without -ftz).
__device__ __forceinline__ float exp2i(int n) {
    return n > -127 ? __int_as_float((n + 127) << 23) : __int_as_float(0x00400000);
}

// max |x| over the 16 values as float bits: for x >= 0 the bit order is the value order and NaN's bits
// exceed Inf's, so one integer max gives the amax and, with bits >= 0x7f800000, "NaN or Inf seen".
__device__ __forceinline__ unsigned amax_bits16(const float (&f)[16]) {
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = max(m, __float_as_uint(f[i]) & 0x7fffffffu);
    return m;
}

__device__ __forceinline__ unsigned sign_bit4(float x) { return (__float_as_uint(x) >> 28) & 8u; }

// MXFP4 quantize. A block holding NaN or Inf gets scale code 255 (decodes to NaN) and zero elements.
// Lanes 2j, 2j+1 of a warp own one 32-element block (Kp/16 is even and warps start at t % 32 == 0).
// Grid-stride loop with a warp-uniform trip count, so both lanes of a pair always reach the shuffle.
template <typename T, bool FLAT>
__global__ void __launch_bounds__(256) mxfp4_quantize(const T* __restrict__ x, uint2* __restrict__ data,
                                                      unsigned char* __restrict__ scales, long long R, long long K,
                                                      long long Kp) {
    const long long total = R * (Kp / 16), stride = (long long)gridDim.x * blockDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t - (threadIdx.x & 31) < total; t += stride) {
        float f[16];
        bool live = load_group<T, FLAT>(x, t, R, K, Kp, f);
        unsigned mb = amax_bits16(f);
        mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
        if (!live) continue;
        bool bad = mb >= 0x7f800000u;
        float amax = __uint_as_float(mb);
        int e = amax == 0.0f ? -127 : floor_log2(amax) - 2;
        e = max(-127, min(127, e));
        const float inv = exp2i(-e);  // x * 2^-e is exact wherever the E2M1 code depends on it
        unsigned p[2] = {0u, 0u};
        if (!bad) {
#pragma unroll
            for (int i = 0; i < 16; ++i) p[i / 8] |= e2m1_encode(f[i] * inv) << (4 * (i % 8));
        }
        data[t] = make_uint2(p[0], p[1]);
        if ((t & 1) == 0) scales[t / 2] = bad ? 255 : (unsigned char)(e + 127);
    }
}

// NVFP4 quantize with a given float32 global scale: one thread owns one 16-element block. Sets *flag to
// 1 when the input holds NaN or Inf (the caller then raises and discards the output).
// The SPEC rounds x / denom once (IEEE division). With rcp = RN(1/denom), q0 = RN(x * rcp) is within an
// ulp of x / denom, the residual x - q0 * denom is exact in one FMA, and RN(q0 + residual * rcp) is the
// correctly rounded quotient (Markstein's theorem), as long as nothing under- or overflows near the
// E2M1 thresholds: denom outside [2^-100, 2^100] takes the plain division instead.
template <typename T, bool FLAT>
__global__ void __launch_bounds__(256) nvfp4_quantize(const T* __restrict__ x, uint2* __restrict__ data,
                                                      unsigned char* __restrict__ scales, long long R, long long K,
                                                      long long Kp, float gscale, int* __restrict__ flag) {
    const long long total = R * (Kp / 16), stride = (long long)gridDim.x * blockDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += stride) {
        float f[16];
        load_group<T, FLAT>(x, t, R, K, Kp, f);
        unsigned mb = amax_bits16(f);
        if (mb >= 0x7f800000u) *flag = 1;
        // SPEC order: s = f32(amax / 6) / gscale, clamp to [2^-9, 448], round to E4M3.
        float s = __fdiv_rn(__fdiv_rn(__uint_as_float(mb), 6.0f), gscale);
        s = fminf(fmaxf(s, 0.001953125f), 448.0f);
        unsigned code = e4m3_encode_pos(s);
        float denom = e4m3_decode(code) * gscale;
        unsigned p[2] = {0u, 0u};
        if (denom >= 0x1p-100f && denom <= 0x1p100f) {
            float rcp = __frcp_rn(denom);
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                float q0 = __fmul_rn(f[i], rcp);
                float q = __fmaf_rn(__fmaf_rn(-q0, denom, f[i]), rcp, q0);
                p[i / 8] |= (e2m1_encode_mag(fabsf(q)) | sign_bit4(f[i])) << (4 * (i % 8));
            }
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i)
                p[i / 8] |= (e2m1_encode_mag(fabsf(__fdiv_rn(f[i], denom))) | sign_bit4(f[i])) << (4 * (i % 8));
        }
        data[t] = make_uint2(p[0], p[1]);
        scales[t] = (unsigned char)code;
    }
}

// Tensor amax for the NVFP4 global scale: max of |x| as float bits (order-preserving for x >= 0;
// NaN's bits exceed Inf's, so a NaN anywhere makes the result NaN and the caller raises).
template <typename T>
__global__ void __launch_bounds__(256) abs_max(const T* __restrict__ x, long long n, unsigned* __restrict__ out) {
    float m = 0.0f;
    bool nan = false;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // 8 elements a step when the base is 16 B aligned (CuPy allocations are), scalar tail.
    long long n8 = n / 8;
    for (long long j = i; j < n8; j += stride) {
        float f[8];
        load8<T, true>(x + j * 8, 0, 8, f);
#pragma unroll
        for (int q = 0; q < 8; ++q) { nan |= isnan(f[q]); m = fmaxf(m, fabsf(f[q])); }
    }
    for (long long j = n8 * 8 + i; j < n; j += stride) {
        float f = to_float(x[j]);
        nan |= isnan(f);
        m = fmaxf(m, fabsf(f));
    }
    unsigned b = nan ? 0x7fc00000u : __float_as_uint(m);
#pragma unroll
    for (int o = 16; o; o >>= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, o));
    if ((threadIdx.x & 31) == 0) atomicMax(out, b);
}

// Dequantize: x = (e2m1 * scale) * global_scale in float32, then rounded to T.
// FLAT (K a multiple of the block): thread t owns elements [16t, 16t+16): an 8-byte load of codes, one
// or two scale bytes, 16 outputs stored as 16-byte vectors. Otherwise one thread per 8 outputs of a
// row, located by division, stored element by element.
template <int BLOCK>
__device__ __forceinline__ float block_scale(unsigned code) {
    return BLOCK == 32 ? e8m0_decode(code) : e4m3_decode(code);
}

template <typename T, int BLOCK, bool FLAT>
__global__ void __launch_bounds__(256) fp4_dequantize(const unsigned* __restrict__ data,
                                                      const unsigned char* __restrict__ scales,
                                                      T* __restrict__ out, long long R, long long K, long long Kp,
                                                      float gscale) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (FLAT) {
        // Each thread decodes 16 contiguous outputs into shared memory, then the block writes its
        // 256 * 16 outputs back as consecutive 16-byte vectors (a thread's own 32-64 B would be strided).
        constexpr int PER = 16, VPT = PER * sizeof(T) / 16;  // 16-byte vectors per thread
        __shared__ uint4 stage[256 * VPT];
        const long long total = R * K, base = (long long)blockIdx.x * 256 * PER;
        if (t * PER < total) {
            uint2 packed = __ldg(reinterpret_cast<const uint2*>(data) + t);
            float sc = block_scale<BLOCK>(__ldg(scales + (t * PER) / BLOCK));
            Vec8<T> o[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned p = h ? packed.y : packed.x;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float v = e2m1_decode((p >> (4 * i)) & 15u) * sc;
                    if (BLOCK == 16) v *= gscale;
                    o[h].v[i] = from_float<T>(v);
                }
            }
#pragma unroll
            for (int i = 0; i < VPT; ++i) stage[threadIdx.x * VPT + i] = reinterpret_cast<const uint4*>(o)[i];
        }
        __syncthreads();
        const long long nvec = min((long long)256 * VPT, (total - base) * (long long)sizeof(T) / 16);
        uint4* dst = reinterpret_cast<uint4*>(out + base);
        for (int i = threadIdx.x; i < nvec; i += 256) dst[i] = stage[i];
        return;
    }
    const long long groups = (K + 7) / 8;  // output groups per row (unpadded)
    if (t >= R * groups) return;
    long long r = t / groups, g = t - r * groups;
    unsigned packed = __ldg(data + r * (Kp / 8) + g);
    float sc = block_scale<BLOCK>(__ldg(scales + r * (Kp / BLOCK) + (g * 8) / BLOCK));
    T* dst = out + r * K + g * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float v = e2m1_decode((packed >> (4 * i)) & 15u) * sc;
        if (BLOCK == 16) v *= gscale;
        if (g * 8 + i < K) dst[i] = from_float<T>(v);
    }
}
