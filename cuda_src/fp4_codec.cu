// fp4_codec.cu: MXFP4 / NVFP4 quantize and dequantize (docs/formats.md), bit-exact with
// vbw_cupy.reference.
//
// Layout: x is [R, K] row-major (R = product of the leading dims). Blocks of BLOCK elements (32 for
// MXFP4, 16 for NVFP4) run along K; each row is padded with zeros to Kp = ceil(K/BLOCK)*BLOCK.
// data is [R, Kp/2] bytes (element 2i in the low nibble), scales is [R, Kp/BLOCK] bytes.
//
// Tiling: a quantize thread step reads 64 bytes as four 16-byte loads: 32 fp16/bf16 elements (one MXFP4
// block, two NVFP4 blocks, 16 bytes of packed output) or 16 floats (an NVFP4 block; an MXFP4 block is two
// lanes that combine their amax with __shfl_xor). Work per element: amax on the packed 16-bit lanes
// (__vmaxu2, one conversion of the block max), signs gathered 8 at a time with prmt, codes from
// e2m1_code_sub (16-bit MXFP4: x * 2^(-e-126) puts E2M1 on float32's subnormal grid, one rounding of
// the bits) or e2m1_code_biased (float32 MXFP4 and NVFP4 after the Markstein-corrected division).
// MXFP4 runs one resident wave with a grid-stride loop that prefetches the next step; NVFP4 one step
// per thread. Dequantize gives each thread 16 elements. When K is a multiple of the block (FLAT) the
// tensor is one flat run: 16-byte vector loads/stores and no row arithmetic. Otherwise rows are padded
// and located by a 64-bit division, with scalar bounds-checked loads (the slow, rare path).
// Quantize moves 2 + 0.5 + 1/BLOCK bytes per fp16 element.
//
// Denormals: compiled without -ftz (see _runtime.py), so float32 denormal inputs and the 2^-127
// MXFP4 scale are exact, as the reference requires.
//
// History (all on an H200: no H100 was lent; 8192x8192 inputs; % of the device-to-device copy bandwidth
// in the same run, read + written bytes):
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
//   v6 (H200): 64 B per thread step; packed-lane amax; prmt signs; branch-free E2M1 codes
//       (e2m1_code_sub / e2m1_code_biased, exhaustively checked) and E4M3 (e4m3_round_pos); 32-bit
//       step counters. fp16 MXFP4 ~9 instructions an element (was ~24), NVFP4 ~18 (was ~26). Kernel
//       alone at 8192x8192, direct launches in one run, v5 -> v6: MXFP4 fp16 84 -> 52 us, bf16 85 -> 54,
//       fp32 89 -> 82; NVFP4 fp16 84 -> 65, bf16 85 -> 66, fp32 90 -> 84 (copy 3.3-3.75 TB/s that run:
//       MXFP4 95-99%, NVFP4 77-79% 16-bit, 97% fp32). Without prefetch MXFP4 took 56 us (warps load and
//       compute in lockstep); with prefetch NVFP4 took 69 us (80 registers, 3 CTAs/SM).
//   v6, bench/gpu_check.sh (10 back-to-back launches between events, copy timed the same way, 3.7-3.96 TB/s):
//       quantize MXFP4 101% fp16, 96% bf16, 102% fp32; NVFP4 78% / 78% / 98%; dequantize 86-95%.
//       With global_scale=None the public NVFP4 call was 0.21 ms (22% of copy): the abs_max pass did a
//       float max per element and was compute-bound like v1.
//   v7: abs_max on raw bits with the quantize kernels' amax_bits (integer max on packed lanes).
//       bench_fp4_codec.py (its events also time the Python launch, ~5-10 us), run with prefetch in
//       both: quantize MXFP4 87% fp16, 84% bf16, 93% fp32; NVFP4 67% / 64% / 92%; dequantize 75-88%.
//       The committed NVFP4 (no prefetch, a step per thread) was timed by direct launch only. 99 GPU
//       tests bit-exact on both builds, which compile to the same SASS as this file.
#include "errors.cuh"
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

// ------------------------------------------------------------------------------------------ quantize
// A thread step reads 64 bytes (16 words): 32 elements of a 16-bit type or 16 floats, i.e. two or one
// 16-element units (8 output bytes each). Steps are numbered in 32 bits: the launcher splits a tensor
// into row chunks of at most 2^30 units.
constexpr int QWORDS = 16;
template <typename T> struct QStep {
    static constexpr int ELEMS = 64 / (int)sizeof(T);  // 32 or 16
    static constexpr int UNITS = ELEMS / 16;           // 2 or 1
    static constexpr int WPU = QWORDS / UNITS;         // words per unit: 8 or 16
};
template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };

// The raw words of step g. FLAT and whole: four 16-byte loads (a thread's 64 bytes are contiguous; the
// other halves of the 32-byte sectors are hit in L1 by the next load). Otherwise (K not a multiple of the
// block, or the last step holding a single unit): zero-filled words and bounds-checked scalar loads at
// row-located units (the rare path). Returns how many units of the step exist.
template <typename T, bool FLAT>
__device__ __forceinline__ int load_step(const T* __restrict__ x, unsigned g, unsigned units, long long K,
                                         long long Kp, unsigned (&w)[QWORDS]) {
    constexpr int U = QStep<T>::UNITS;
    const unsigned u0 = g * U;
    if (FLAT && u0 + U <= units) {
        const uint4* src = reinterpret_cast<const uint4*>(x) + 4ull * g;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 v = __ldg(src + i);
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
        return U;
    }
#pragma unroll
    for (int i = 0; i < QWORDS; ++i) w[i] = 0u;
    int live = 0;
    const long long upr = Kp / 16;  // units per row
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u0 + u >= units) break;
        ++live;
        const long long r = (u0 + u) / upr, c = (u0 + u - r * upr) * 16, base = r * K + c;
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            if (c + e < K) {
                if constexpr (sizeof(T) == 2)
                    w[u * 8 + e / 2] |= (unsigned)__ldg(reinterpret_cast<const unsigned short*>(x) + base + e)
                                        << (16 * (e & 1));
                else
                    w[e] = __ldg(reinterpret_cast<const unsigned*>(x) + base + e);
            }
        }
    }
    return live;
}

// Element i of a unit's words as float.
template <typename T>
__device__ __forceinline__ float elem_f(const unsigned* w, int i) {
    if constexpr (sizeof(T) == 4) {
        return __uint_as_float(w[i]);
    } else if constexpr (IsHalf<T>::value) {
        unsigned v = w[i / 2];
        const __half2 h = *reinterpret_cast<const __half2*>(&v);
        return (i & 1) ? __high2float(h) : __low2float(h);
    } else {
        return __uint_as_float((i & 1) ? (w[i / 2] & 0xffff0000u) : (w[i / 2] << 16));
    }
}

// max |x| over n words as float32 bits (order-preserving for x >= 0; NaN's bits exceed Inf's, so bits >=
// 0x7f800000 means "NaN or Inf seen"). 16-bit types: a packed max over both lanes of each word, then one
// conversion of the larger lane.
template <typename T>
__device__ __forceinline__ unsigned amax_bits(const unsigned* w, int n) {
    unsigned m = 0;
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < n; ++i) m = max(m, w[i] & 0x7fffffffu);
        return m;
    } else {
#pragma unroll
        for (int i = 0; i < n; ++i) m = __vmaxu2(m, w[i] & 0x7fff7fffu);
        m = max(m & 0xffffu, m >> 16);
        if constexpr (IsHalf<T>::value) return __float_as_uint(__half2float(__ushort_as_half((unsigned short)m)));
        else return m << 16;
    }
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// Sign bits of 8 consecutive elements at their E2M1 nibbles' bit 3. prmt with a selector nibble >= 8
// replicates the selected byte's top bit, so the sign bytes gather into E = elements 0,2,4,6 and
// O = 1,3,5,7 (0x00 or 0xff each), which land on bits 8k+3 and 8k+7.
template <typename T>
__device__ __forceinline__ unsigned sign_nibbles(const unsigned* w) {
    unsigned ev, od;
    if constexpr (sizeof(T) == 2) {  // 4 words; element 2j's sign is byte 1 of word j, 2j+1's byte 3
        const unsigned a = prmt(w[0], w[1], 0xFBD9u), b = prmt(w[2], w[3], 0xFBD9u);  // [s0 s2 s1 s3], [s4 s6 s5 s7]
        ev = prmt(a, b, 0x5410u);
        od = prmt(a, b, 0x7632u);
    } else {  // 8 words; element j's sign is byte 3 of word j
        ev = prmt(prmt(w[0], w[2], 0xFBu), prmt(w[4], w[6], 0xFBu), 0x5410u);
        od = prmt(prmt(w[1], w[3], 0xFBu), prmt(w[5], w[7], 0xFBu), 0x5410u);
    }
    return (ev & 0x08080808u) | (od & 0x80808080u);
}

// Packs the 16 elements of one unit: enc(x) returns the magnitude code plus `bias`, added as code << 4i
// (the bias is taken off once per 8 codes), signs from the raw words.
template <typename T, unsigned BIAS, typename Enc>
__device__ __forceinline__ uint2 pack_unit(const unsigned* w, Enc enc) {
    unsigned p[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        unsigned acc = 0u;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc += enc(elem_f<T>(w, 8 * h + i)) << (4 * i);
        p[h] = (acc - BIAS * 0x11111111u) | sign_nibbles<T>(w + h * (8 * sizeof(T) / 4));
    }
    return make_uint2(p[0], p[1]);
}

template <typename T>
__device__ __forceinline__ void store_step(uint2* __restrict__ data, unsigned g, int live,
                                           const uint2 (&out)[QStep<T>::UNITS]) {
    if (QStep<T>::UNITS == 2 && live == 2) {
        reinterpret_cast<uint4*>(data)[g] = make_uint4(out[0].x, out[0].y, out[QStep<T>::UNITS - 1].x,
                                                       out[QStep<T>::UNITS - 1].y);
    } else {
        data[g * QStep<T>::UNITS] = out[0];
    }
}

// 2^n for n in [-127, 127], built from bits (2^-127 is a float32 denormal, exact without -ftz).
__device__ __forceinline__ float exp2i(int n) {
    return n > -127 ? __int_as_float((n + 127) << 23) : __int_as_float(0x00400000);
}

// Grid-stride loop over thread steps: body(g, live, w) gets step g's words.
// PREFETCH: the next step's loads are issued before the body runs, so a warp keeps 64 bytes in flight
// while it computes (MXFP4, one resident wave of CTAs: without it the warps of an SM load and compute in
// lockstep and the time is about the sum of the two). NVFP4 does better without it at 63 registers and
// one step per thread: CTAs start and end at different times, which overlaps loads and work as well.
// UNIFORM: the trip count is the same for all lanes of a warp (for bodies that shuffle).
template <typename T, bool FLAT, bool UNIFORM, bool PREFETCH, typename Body>
__device__ __forceinline__ void quantize_steps(const T* __restrict__ x, unsigned steps, unsigned units, long long K,
                                               long long Kp, Body body) {
    const unsigned stride = gridDim.x * blockDim.x, lane = UNIFORM ? (threadIdx.x & 31u) : 0u;
    unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    if constexpr (PREFETCH) {
        unsigned w[QWORDS];
        int live = g - lane < steps ? load_step<T, FLAT>(x, g, units, K, Kp, w) : 0;
        for (; g - lane < steps; g += stride) {
            unsigned cur[QWORDS];
#pragma unroll
            for (int i = 0; i < QWORDS; ++i) cur[i] = w[i];
            const int lc = live;
            if (g + stride - lane < steps) live = load_step<T, FLAT>(x, g + stride, units, K, Kp, w);
            body(g, lc, cur);
        }
    } else {
        for (; g - lane < steps; g += stride) {
            unsigned w[QWORDS];
            const int live = load_step<T, FLAT>(x, g, units, K, Kp, w);
            body(g, live, w);
        }
    }
}

}  // namespace vbw

using namespace vbw;

// MXFP4 quantize. A block holding NaN or Inf gets scale code 255 (decodes to NaN) and zero elements.
// 16-bit inputs: a thread step is one 32-element block; elements go through e2m1_code_sub with the
// scale 2^(-e-126) (exact: 11 or 8 significant bits) unless e > 23 (bfloat16 blocks with amax >= 2^26),
// which, like float32, takes x * 2^-e (exact wherever the code depends on it) and e2m1_code_biased.
// float32: lanes 2j, 2j+1 own one block and combine their amax with __shfl_xor; the grid-stride loop
// has a warp-uniform trip count so both lanes of a pair always reach the shuffle.
template <typename T, bool FLAT>
__global__ void __launch_bounds__(256, 3) mxfp4_quantize(const T* __restrict__ x, uint2* __restrict__ data,
                                                         unsigned char* __restrict__ scales, long long R,
                                                         long long K, long long Kp) {
    using S = QStep<T>;
    constexpr unsigned TPB = 32 / S::ELEMS;  // threads per block: 1 or 2
    const unsigned units = (unsigned)(R * (Kp / 16)), steps = units / S::UNITS;  // Kp % 32 == 0
    quantize_steps<T, FLAT, TPB == 2, true>(x, steps, units, K, Kp, [&](unsigned g, int live,
                                                                       const unsigned (&w)[QWORDS]) {
        unsigned mb = amax_bits<T>(w, QWORDS);
        if (TPB == 2) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
        if (live == 0) return;
        const bool bad = mb >= 0x7f800000u;
        const float amax = __uint_as_float(mb);
        int e = amax == 0.0f ? -127 : floor_log2(amax) - 2;
        e = max(-127, min(127, e));
        uint2 out[S::UNITS];
#pragma unroll
        for (int u = 0; u < S::UNITS; ++u) out[u] = make_uint2(0u, 0u);
        if (!bad) {
            if (sizeof(T) == 2 && (IsHalf<T>::value || e <= 23)) {
                const float s = e2m1_sub_scale(e);
#pragma unroll
                for (int u = 0; u < S::UNITS; ++u)
                    out[u] = pack_unit<T, 0u>(w + u * S::WPU, [s](float f) { return e2m1_code_sub(fabsf(f) * s); });
            } else {
                const float inv = exp2i(-e);
#pragma unroll
                for (int u = 0; u < S::UNITS; ++u)
                    out[u] = pack_unit<T, E2M1_CODE_BIAS>(w + u * S::WPU,
                                                          [inv](float f) { return e2m1_code_biased(fabsf(f) * inv); });
            }
        }
        store_step<T>(data, g, live, out);
        if (g % TPB == 0) scales[g / TPB] = bad ? 255 : (unsigned char)(e + 127);
    });
}

// NVFP4 quantize with a given float32 global scale: one 16-element block per unit (two per 16-bit
// thread step). `flag` is the error word from NVFP4_NONFINITE on: sets it to 1 when the input holds NaN or
// Inf (the caller then raises and discards the output), and the NVFP4_SATURATED word when a finite block
// needs a scale above 512 (global_scale too small: its elements saturate past E2M1's rounding error).
// docs/formats.md rounds x / denom once (IEEE division). With rcp = RN(1/denom), q0 = RN(x * rcp) is within an
// ulp of x / denom, the residual x - q0 * denom is exact in one FMA, and RN(q0 + residual * rcp) is the
// correctly rounded quotient (Markstein's theorem), as long as nothing under- or overflows near the
// E2M1 thresholds: denom outside [2^-100, 2^100] takes the plain division instead.
template <typename T, bool FLAT>
__global__ void __launch_bounds__(256, 4) nvfp4_quantize(const T* __restrict__ x, uint2* __restrict__ data,
                                                         unsigned char* __restrict__ scales, long long R,
                                                         long long K, long long Kp, float gscale,
                                                         int* __restrict__ flag) {
    using S = QStep<T>;
    const unsigned units = (unsigned)(R * (Kp / 16)), steps = (units + S::UNITS - 1) / S::UNITS;
    quantize_steps<T, FLAT, false, false>(x, steps, units, K, Kp, [&](unsigned g, int live,
                                                                     const unsigned (&w)[QWORDS]) {
        uint2 out[S::UNITS];
        unsigned char code[S::UNITS];
#pragma unroll
        for (int u = 0; u < S::UNITS; ++u) {
            const unsigned* wu = w + u * S::WPU;
            const unsigned mb = amax_bits<T>(wu, S::WPU);
            if (mb >= 0x7f800000u) *flag = 1;
            // docs/formats.md order: s = f32(amax / 6) / gscale, clamp to [2^-9, 448], round to E4M3.
            float s = __fdiv_rn(__fdiv_rn(__uint_as_float(mb), 6.0f), gscale);
            if (s > 512.0f && mb < 0x7f800000u) flag[vbw_err::NVFP4_SATURATED - vbw_err::NVFP4_NONFINITE] = 1;
            s = fminf(fmaxf(s, 0.001953125f), 448.0f);
            float sq;
            code[u] = (unsigned char)e4m3_round_pos(s, sq);
            const float denom = sq * gscale;
            if (denom >= 0x1p-100f && denom <= 0x1p100f) {
                const float rcp = __frcp_rn(denom);
                out[u] = pack_unit<T, E2M1_CODE_BIAS>(wu, [rcp, denom](float f) {
                    const float q0 = __fmul_rn(f, rcp);
                    return e2m1_code_biased(fabsf(__fmaf_rn(__fmaf_rn(-q0, denom, f), rcp, q0)));
                });
            } else {
                out[u] = pack_unit<T, E2M1_CODE_BIAS>(wu, [denom](float f) {
                    return e2m1_code_biased(fabsf(__fdiv_rn(f, denom)));
                });
            }
        }
        store_step<T>(data, g, live, out);
        if (S::UNITS == 2 && live == 2)
            reinterpret_cast<unsigned short*>(scales)[g] = (unsigned short)(code[0] | (code[S::UNITS - 1] << 8));
        else
            scales[g * S::UNITS] = code[0];
    });
}

// Tensor amax for the NVFP4 global scale, as float32 bits of max |x| (order-preserving for x >= 0; NaN's
// bits exceed Inf's, so a NaN anywhere makes the result NaN and the caller raises). Integer maxima on the
// raw (packed) bits, as in the quantize kernels: a float max per element made this pass compute-bound.
template <typename T>
__global__ void __launch_bounds__(256) abs_max(const T* __restrict__ x, long long n, unsigned* __restrict__ out) {
    constexpr int PER = 16 / sizeof(T);  // elements per 16-byte load (the base is 16 B aligned)
    const long long stride = (long long)gridDim.x * blockDim.x, nv = n / PER;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned b = 0;
    for (long long j = i; j < nv; j += stride) {
        uint4 v = __ldg(reinterpret_cast<const uint4*>(x) + j);
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        b = max(b, amax_bits<T>(w, 4));
    }
    for (long long j = nv * PER + i; j < n; j += stride) b = max(b, __float_as_uint(fabsf(to_float(x[j]))));
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
