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
// the bits), e2m1_code_biased (float32 MXFP4 and NVFP4 after the Markstein-corrected division), or for
// 16-bit NVFP4 a count of per-scale thresholds met (7 packed compares a word, from a table each CTA
// builds with the exact division: nvfp4_thresholds). MXFP4 and 16-bit NVFP4 run one resident wave with a
// grid-stride loop that prefetches the next step; float32 NVFP4 one step per thread. Dequantize gives
// each thread 16 elements. When K is a multiple of the block (FLAT) the tensor is one flat run: 16-byte
// vector loads/stores and no row arithmetic. Otherwise rows are padded and located by a 64-bit division,
// with scalar bounds-checked loads (the slow, rare path).
// Quantize moves 2 + 0.5 + 1/BLOCK bytes per fp16 element.
//
// Denormals: compiled without -ftz (see _runtime.py), so float32 denormal inputs and the 2^-127
// MXFP4 scale are exact, as the reference requires.
//
// History (8192^2 inputs, fraction of a device copy of the same bytes; full log: notes/kernel-history.md):
//   v1-v2  8-16 elements a thread: quantize 23-66%, instruction-bound (~530 Gelem/s any dtype).
//   v3-v5  E2M1 codes from bits, Markstein-corrected NVFP4 division, grid-stride loops: MXFP4 59%, NVFP4 56%.
//   v6-v7  64 B a thread step, packed-lane amax, branch-free codes, MXFP4 prefetch: MXFP4 87-101%, NVFP4
//          67-78% (16-bit) / 92-98% (fp32), dequantize 75-95%.
//   v8     16-bit NVFP4 codes from a per-CTA threshold table, prefetch: NVFP4 16-bit 0.73 -> 0.86-0.89 (H200,
//          graph replay); tried and dropped: binary-search codes, two prefetch buffers, Markstein block scales.
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
// while it computes (one resident wave of CTAs: without it the warps of an SM load and compute in
// lockstep and the time is about the sum of the two). Float32 NVFP4 does as well without it at one step
// per thread: CTAs start and end at different times, which overlaps loads and work as well. Two buffers
// used in turn instead of the copy were 5-12% slower (H200).
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

// NVFP4 code thresholds for 16-bit inputs. A block's element codes depend only on its E4M3 scale code c
// (denom = e4m3(c) * gscale is per-tensor otherwise), and code(|x|) = E2M1 rounding of RN32(|x| / denom) is
// monotone in |x|. So thr[c] holds, for i = 0..6, the smallest 16-bit pattern |x| whose code is at least
// i + 1, both lanes of a word; codes are then counts of thresholds met (nvfp4_codes16). Each entry is
// found from RZ(tie_i * denom) in the input type, one below it, stepping up with the exact quotient
// (__fdiv_rn, the same function as the float32 path), so the table is the reference by construction:
// the start is at least one 16-bit ulp (2^-11 relative or more) below the boundary, and the boundary
// lies within a float32 rounding of tie_i * denom, so the walk is 1-2 steps. Code 127 (NaN) is unused.
template <typename T>
__device__ __forceinline__ unsigned bits16_rz(float v) {
    if constexpr (IsHalf<T>::value) return __half_as_ushort(__float2half_rz(v));
    else return __bfloat16_as_ushort(__float2bfloat16_rz(v));
}
template <typename T>
__device__ __forceinline__ float from_bits16(unsigned b) {
    if constexpr (IsHalf<T>::value) return __half2float(__ushort_as_half((unsigned short)b));
    else return __uint_as_float(b << 16);
}
constexpr int NV_CODES = 127;  // E4M3 codes a block scale can take (0x7F is NaN)

template <typename T>
__device__ void nvfp4_thresholds(uint4 (*thr)[2], float gscale) {
    constexpr unsigned INF = IsHalf<T>::value ? 0x7C00u : 0x7F80u;
    for (int idx = threadIdx.x; idx < NV_CODES * 7; idx += blockDim.x) {
        const int c = idx / 7, i = idx - 7 * c;
        const float denom = __fmul_rn(e4m3_decode((unsigned)c), gscale);
        const float tie = i < 4 ? 0.25f + 0.5f * (float)i : (i == 4 ? 2.5f : (i == 5 ? 3.5f : 5.0f));
        unsigned t = bits16_rz<T>(__fmul_rn(tie, denom));
        t = t ? min(t, INF) - 1u : 0u;
        // (t = 0 never meets a threshold: a zero's code is 0 even where denom underflowed to 0)
        while (t < INF && (t == 0 || e2m1_code_biased(__fdiv_rn(from_bits16<T>(t), denom)) - E2M1_CODE_BIAS <=
                                     (unsigned)i))
            ++t;
        reinterpret_cast<unsigned*>(thr[c])[i] = t | (t << 16);
    }
    __syncthreads();
}

// The E2M1 magnitude codes of the two 16-bit lanes of word a (sign bits cleared), as bytes 0 and 2 of the
// result: the count of thresholds met. On sm_90 (and for half on any arch) a packed compare yields 1.0 per
// lane, summed onto 1024.0 (half) or 128.0 (bfloat16), where the type's ulp is 1, so the count is the low
// byte of each lane. bfloat16 below sm_90 (no bf16x2 compare), and any type with -DVBW_NV_INT_COMPARE (so a
// Hopper test runs this form): (a | 0x8000) - t per lane has bit 15 set iff a >= t.
template <typename T>
__device__ __forceinline__ unsigned nvfp4_codes16(unsigned a, const unsigned (&th)[7]) {
#if defined(VBW_NV_INT_COMPARE)
    constexpr bool INT = true;
#elif __CUDA_ARCH__ < 900
    constexpr bool INT = !IsHalf<T>::value;
#else
    constexpr bool INT = false;
#endif
    if constexpr (INT) {
        unsigned n = 0;
#pragma unroll
        for (int i = 0; i < 7; ++i) n += (((a | 0x80008000u) - th[i]) >> 15) & 0x00010001u;
        return n;
    }
    unsigned acc = IsHalf<T>::value ? 0x64006400u : 0x43004300u;
#pragma unroll
    for (int i = 0; i < 7; ++i) {
        unsigned m;
        if constexpr (IsHalf<T>::value) {
            asm("set.ge.f16x2.f16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(th[i]));
            asm("add.rn.f16x2 %0, %0, %1;" : "+r"(acc) : "r"(m));
        } else {
            asm("set.ge.bf16x2.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(th[i]));
            asm("add.rn.bf16x2 %0, %0, %1;" : "+r"(acc) : "r"(m));
        }
    }
    return acc;
}

// One unit of a 16-bit input (16 elements: raw words w, the same without sign bits a): element 2j's code
// is byte 0 of word j's counts, 2j+1's byte 2; prmt gathers the even and odd elements of each half into
// bytes, and odd << 4 puts them on their nibbles.
template <typename T>
__device__ __forceinline__ uint2 nvfp4_pack16(const unsigned* w, const unsigned (&a)[8], const unsigned (&th)[7]) {
    unsigned c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = nvfp4_codes16<T>(a[j], th);
    unsigned p[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned lo = prmt(c[4 * h], c[4 * h + 1], 0x6240u), hi = prmt(c[4 * h + 2], c[4 * h + 3], 0x6240u);
        p[h] = (prmt(lo, hi, 0x5410u) + (prmt(lo, hi, 0x7632u) << 4)) | sign_nibbles<T>(w + 4 * h);
    }
    return make_uint2(p[0], p[1]);
}

// NVFP4 quantize with a given float32 global scale: one 16-element block per unit (two per 16-bit
// thread step). `flag` is the error word from NVFP4_NONFINITE on: sets it to 1 when the input holds NaN or
// Inf (the caller then raises and discards the output), and the NVFP4_SATURATED word when a finite block
// needs a scale above 512 (global_scale too small: its elements saturate past E2M1's rounding error).
// float32: one step per thread; the codes by division. docs/formats.md rounds x / denom once (IEEE
// division): fp4.cuh's div_markstein, exact as long as nothing under- or overflows near the E2M1 thresholds;
// denom outside [2^-100, 2^100] takes the plain division instead.
// 16-bit: one resident wave (the launcher's grid), grid-stride with prefetch like MXFP4; each CTA first
// builds the threshold table (nvfp4_thresholds), then the codes are 7 packed compares a word.
template <typename T, bool FLAT>
__global__ void __launch_bounds__(256, sizeof(T) == 2 ? 3 : 4)
    nvfp4_quantize(const T* __restrict__ x, uint2* __restrict__ data, unsigned char* __restrict__ scales, long long R,
                   long long K, long long Kp, float gscale, int* __restrict__ flag) {
    using S = QStep<T>;
    constexpr bool TABLE = sizeof(T) == 2;
    __shared__ uint4 thr[TABLE ? NV_CODES : 1][2];
    if constexpr (TABLE) nvfp4_thresholds<T>(thr, gscale);
    const unsigned units = (unsigned)(R * (Kp / 16)), steps = (units + S::UNITS - 1) / S::UNITS;
    quantize_steps<T, FLAT, false, TABLE>(x, steps, units, K, Kp, [&](unsigned g, int live,
                                                                     const unsigned (&w)[QWORDS]) {
        uint2 out[S::UNITS];
        unsigned char code[S::UNITS];
#pragma unroll
        for (int u = 0; u < S::UNITS; ++u) {
            const unsigned* wu = w + u * S::WPU;
            unsigned a[8];  // the table path: the words without sign bits, for the amax and the codes
            if constexpr (TABLE) {
#pragma unroll
                for (int j = 0; j < 8; ++j) a[j] = wu[j] & 0x7fff7fffu;
            }
            const unsigned mb = amax_bits<T>(TABLE ? a : wu, S::WPU);
            if (mb >= 0x7f800000u) *flag = 1;
            // docs/formats.md order: s = f32(amax / 6) / gscale, clamp to [2^-9, 448], round to E4M3.
            float s = __fdiv_rn(__fdiv_rn(__uint_as_float(mb), 6.0f), gscale);
            if (s > 512.0f && mb < 0x7f800000u) flag[vbw_err::NVFP4_SATURATED - vbw_err::NVFP4_NONFINITE] = 1;
            s = fminf(fmaxf(s, 0.001953125f), 448.0f);
            float sq;
            code[u] = (unsigned char)e4m3_round_pos(s, sq);
            if constexpr (TABLE) {
                const uint4 t0 = thr[code[u]][0], t1 = thr[code[u]][1];
                const unsigned th[7] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z};
                out[u] = nvfp4_pack16<T>(wu, a, th);
            } else {
                const float denom = sq * gscale;
                if (denom >= 0x1p-100f && denom <= 0x1p100f) {
                    const float rcp = __frcp_rn(denom);
                    out[u] = pack_unit<T, E2M1_CODE_BIAS>(wu, [rcp, denom](float f) {
                        return e2m1_code_biased(fabsf(div_markstein(f, denom, rcp)));
                    });
                } else {
                    out[u] = pack_unit<T, E2M1_CODE_BIAS>(wu, [denom](float f) {  // (0 / 0: a zero's code is 0)
                        return e2m1_code_biased(fabsf(f == 0.f ? f : __fdiv_rn(f, denom)));
                    });
                }
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
