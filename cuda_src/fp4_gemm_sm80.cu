// fp4_gemm_sm80.cu: the FP4-weight GEMM kernels for any sm_80+ (layout, modes and history: fp4_gemm.cuh):
//   fp4_gemm_prepare / fp4_scale_range (the weight re-layout, once per weight), fp4_gemm_mma (mma.sync,
//   cp.async ring, split-K), fp4_gemm_mmv (M <= 16, weights streamed into registers; clusters on sm_90),
//   fp4_gemm_mmvk (M = 1: weights and activations streamed into registers, K split inside the CTA).
#include "fp4_gemm.cuh"

namespace vbw_fp4gemm {

// ---------------------------------------------------------------------------------------------- prepare
// One thread per (row group, k atom, lane): writes the lane's 16 bytes; lanes with t == 0 write row g's and
// row g+8's scale bytes. SIR mode stores the multiplier code (see sir_h) and zeroes blocks whose scale is 0
// or outside the code range (gemm.py only picks SIR when no such block holds a nonzero element).
template <int BLK>
__device__ __forceinline__ int sir_code(u32 code, int c) {
  int e;
  u32 mant;
  if (BLK == 16) {
    const float s = vbw::e4m3_decode(code);
    if (!(s > 0.f)) return -1;
    const u32 bits = __float_as_uint(s);
    e = (int)((bits >> 23) & 0xFFu) - 127;
    mant = (bits >> 20) & 7u;
  } else {
    if (code == 255u) return -1;
    e = (int)code - 127;
    mant = 0;
  }
  const int eb = e - c + 29;
  if (eb < 0 || eb > 30) return -1;
  return (eb << 3) | (int)mant;
}

template <int BLK, int MODE>
__global__ void fp4_gemm_prepare(const u8* __restrict__ data, const u8* __restrict__ scales, u8* __restrict__ Wp,
                                 int N, int Dk, int Sk, int katoms, int n_rg, int cshift) {
  constexpr int ATOM = atom_bytes(BLK);
  constexpr int NB = BLK == 16 ? 4 : 2;  // scale blocks per atom and row
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n_rg * katoms * 32) return;
  const int lane = (int)(idx & 31);
  const long long at = idx >> 5;
  const int ka = (int)(at % katoms), rg = (int)(at / katoms);
  const int g = lane >> 2, t = lane & 3;
  const int r0 = rg * 16 + g, r1 = r0 + 8;
  auto byte_at = [&](int row, int col) -> u32 {
    if (row >= N || col >= Dk) return 0u;
    if (MODE == MODE_SIR && sir_code<BLK>(scales[(size_t)row * Sk + (col * 2) / BLK], cshift) < 0) return 0u;
    return data[(size_t)row * Dk + col];
  };
  u32 w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int kb = ka * 32 + j * 8 + t;  // byte column of k = ka*64 + j*16 + 2t
    const u32 bg0 = byte_at(r0, kb), bg1 = byte_at(r0, kb + 4), bh0 = byte_at(r1, kb), bh1 = byte_at(r1, kb + 4);
    w[j] = (bh1 & 15u) | ((bg1 & 15u) << 4) | ((bh0 & 15u) << 8) | ((bg0 & 15u) << 12) |
           ((bh1 >> 4) << 16) | ((bg1 >> 4) << 20) | ((bh0 >> 4) << 24) | ((bg0 >> 4) << 28);
  }
  u8* dst = Wp + (size_t)at * ATOM;
  *reinterpret_cast<uint4*>(dst + lane * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  if (t == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = h ? r1 : r0;
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const int blk = ka * NB + b;
        const u32 code = (row < N && blk < Sk) ? scales[(size_t)row * Sk + blk] : 0u;
        u32 outc = code;
        if (MODE == MODE_SIR) {
          const int s = sir_code<BLK>(code, cshift);
          outc = s < 0 ? 232u : (u32)s;  // 232: u = 1 (its data was zeroed)
        }
        dst[512 + g * 2 * NB + h * NB + b] = (u8)outc;
      }
    }
  }
}

// Scale range of a weight, for gemm._scale_info (once per weight): out[0] = max, out[1] = min of
// floor(log2(block scale)) over the live blocks (a nonzero E2M1 code and, NVFP4, a positive scale), out[2] = 1
// if any block scale (live or not) is NaN (MXFP4 255; NVFP4 0x7F / 0xFF) or negative (NVFP4 >= 0x80).
// data: [nblocks][BLK / 2] bytes, scales: [nblocks], both contiguous. out starts at {-2^30, 2^30, 0}.
template <int BLK>
__global__ void fp4_scale_range(const u8* __restrict__ data, const u8* __restrict__ scales, long long nblocks,
                                int* __restrict__ out) {
  int emax = -(1 << 30), emin = 1 << 30, bad = 0;
  for (long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks;
       b += (long long)gridDim.x * blockDim.x) {
    const u32 sc = scales[b];
    int e = 0;
    bool pos = true;
    if (BLK == 32) {
      bad |= sc == 255u;
      e = (int)sc - 127;
    } else {
      bad |= sc >= 0x7Fu;
      const int ex = (int)(sc >> 3) & 15, m = (int)(sc & 7u);
      pos = sc != 0u && sc < 0x7Fu;
      e = ex ? ex - 7 : (m >= 4 ? -7 : m >= 2 ? -8 : -9);  // subnormal m * 2^-9
    }
    bool live = false;
    const u8* p = data + b * (BLK / 2);
#pragma unroll
    for (int i = 0; i < BLK / 2; ++i) live |= (p[i] & 0x77u) != 0u;
    if (live && pos) {
      emax = max(emax, e);
      emin = min(emin, e);
    }
  }
  emax = __reduce_max_sync(0xffffffffu, emax);
  emin = __reduce_min_sync(0xffffffffu, emin);
  bad = __reduce_or_sync(0xffffffffu, (unsigned)bad);
  if ((threadIdx.x & 31) == 0) {
    atomicMax(out, emax);
    atomicMin(out + 1, emin);
    if (bad) atomicOr(out + 2, 1);
  }
}
// ---------------------------------------------------------------------------------------------- mma.sync
template <typename T, int BLK, int MODE, int BR, int BC, int BK, int WARPS_R, int WARPS_C, int STAGES>
__global__ void __launch_bounds__(32 * WARPS_R * WARPS_C)
fp4_gemm_mma(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
             const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
             int M, int N, int K, int lda, int katoms, int kt_per_split, float out_scale, int flags) {
  using OT = typename OpT<T>::type;
  using Acc = typename AccT<T>::type;
  constexpr bool F32 = same<T, float>::value;
  constexpr int NP = F32 ? 3 : 1;  // B pieces per fragment (hi, mid, lo for float32)
  constexpr int NT = 32 * WARPS_R * WARPS_C;
  constexpr int WR = BR / WARPS_R, WC = BC / WARPS_C, FR = WR / 16, FC = WC / 8;
  constexpr int ATOM = atom_bytes(BLK), KA = BK / 64;
  constexpr int W_STAGE = (BR / 16) * KA * ATOM;
  constexpr int ROWB = BK * (int)sizeof(T);
  constexpr int STAGE = W_STAGE + BC * ROWB;
  static_assert(!F32 || MODE == MODE_FPP, "float32 activations use fp32 partials");
  static_assert(WR % 16 == 0 && WC % 8 == 0 && BK % 64 == 0 && FR >= 1 && FC >= 1, "tile shape");
  static_assert(STAGES >= 2, "stages");

  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp % WARPS_R, wc = warp / WARPS_R;
  const int g = lane >> 2, t = lane & 3;
  const int n_rg = (N + 15) >> 4;
  const int rg0 = blockIdx.x * (BR / 16);
  const int m0 = blockIdx.y * BC;
  const int nkt = (katoms + KA - 1) / KA;
  const int kt0 = blockIdx.z * kt_per_split;
  const int nk = max(0, min(nkt, kt0 + kt_per_split) - kt0);
  vbw::pdl_wait();
  vbw::pdl_launch_dependents();

  // Per-thread copy plan, fixed over the k-tiles (so the k-loop only adds kt offsets).
  constexpr int CPA = ATOM / 16, CPR = KA * CPA, WCH = (BR / 16) * CPR, WIT = (WCH + NT - 1) / NT;
  constexpr int EPC = 16 / (int)sizeof(T), ACPR = ROWB / 16, ACH = BC * ACPR, AIT = (ACH + NT - 1) / NT;
  static_assert(NT % ACPR == 0, "activation copy plan");
  size_t w_off[WIT];
  int w_atom[WIT];
  const unsigned w_ok = weight_copy_plan<WIT, NT, CPR, CPA, WCH, ATOM>(tid, rg0, n_rg, katoms, w_off, w_atom);
  const int a_ch = tid % ACPR, a_r0 = tid / ACPR;
  const T* a_base = A + (size_t)(m0 + a_r0) * lda + a_ch * EPC;
  auto load_stage = [&](int kt, int buf) {
    u8* sw = smem + buf * STAGE;
    u8* sa = sw + W_STAGE;
#pragma unroll
    for (int i = 0; i < WIT; ++i) {
      const int c = tid + i * NT;
      if (WCH % NT == 0 || c < WCH) {
        const bool ok = ((w_ok >> i) & 1u) && kt * KA + w_atom[i] < katoms;
        const u8* src = Wp + w_off[i] + (size_t)kt * KA * ATOM;
        vbw::cp_async_16(vbw::smem_addr(sw + c * 16), ok ? (const void*)src : (const void*)Wp, ok);
      }
    }
    const bool k_ok = kt * BK + a_ch * EPC < K;
#pragma unroll
    for (int i = 0; i < AIT; ++i) {
      const int r = a_r0 + i * (NT / ACPR);
      if (ACH % NT == 0 || r < BC) {
        const bool ok = k_ok && m0 + r < M;
        const T* src = a_base + (size_t)i * (NT / ACPR) * lda + (size_t)kt * BK;
        vbw::cp_async_16(vbw::smem_addr(sa + r * ROWB + ((a_ch ^ (r & 7)) << 4)), ok ? (const void*)src : (const void*)A, ok);
      }
    }
  };

  Acc acc[FR][FC][4];
  float part[FR][FC][4];
#pragma unroll
  for (int i = 0; i < FR; ++i)
#pragma unroll
    for (int c = 0; c < FC; ++c)
#pragma unroll
      for (int r = 0; r < 4; ++r) { acc[i][c][r] = 0; part[i][c][r] = 0.f; }

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(kt0 + s, s);
    vbw::cp_async_commit();
  }

  for (int it = 0; it < nk; ++it) {
    vbw::cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int pf = it + STAGES - 1;
      if (pf < nk) load_stage(kt0 + pf, pf % STAGES);
      vbw::cp_async_commit();
    }
    const u8* sw = smem + (it % STAGES) * STAGE;
    const u8* sa = sw + W_STAGE;
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      uint4 wq[FR];
      u32 s0[FR], s1[FR];
#pragma unroll
      for (int i = 0; i < FR; ++i) {
        const u8* ap = sw + ((wr * FR + i) * KA + a) * ATOM;
        wq[i] = *reinterpret_cast<const uint4*>(ap + lane * 16);
        if (BLK == 16) {
          const uint2 s = *reinterpret_cast<const uint2*>(ap + 512 + g * 8);
          s0[i] = s.x; s1[i] = s.y;
        } else {
          const u32 s = *reinterpret_cast<const u32*>(ap + 512 + g * 4);
          s0[i] = s; s1[i] = s >> 16;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kk = a * 4 + j;  // k16 step inside the stage
        u32 bf[FC][NP][2];
        if constexpr (!F32) {
#pragma unroll
          for (int c = 0; c < FC; c += 2) {
            if (c + 1 < FC) {
              const int r = wc * WC + (c + (lane >> 4)) * 8 + (lane & 7);
              const int ch = kk * 2 + ((lane >> 3) & 1);
              vbw::ldsm_x4(bf[c][0][0], bf[c][0][1], bf[c + 1][0][0], bf[c + 1][0][1],
                           vbw::smem_addr(sa + r * ROWB + ((ch ^ (r & 7)) << 4)));
            } else {
              const int l = lane & 15;
              const int r = wc * WC + c * 8 + (l & 7);
              const int ch = kk * 2 + (l >> 3);
              vbw::ldsm_x2(bf[c][0][0], bf[c][0][1], vbw::smem_addr(sa + r * ROWB + ((ch ^ (r & 7)) << 4)));
            }
          }
        } else {
#pragma unroll
          for (int c = 0; c < FC; ++c) {
            const int r = wc * WC + c * 8 + g;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int ch = kk * 4 + h * 2 + (t >> 1);
              const float2 v = *reinterpret_cast<const float2*>(sa + r * ROWB + ((ch ^ (r & 7)) << 4) + (t & 1) * 8);
              u32 h0, m0_, l0, h1, m1, l1;
              split3(v.x, h0, m0_, l0);
              split3(v.y, h1, m1, l1);
              bf[c][0][h] = h0 | (h1 << 16);
              bf[c][1][h] = m0_ | (m1 << 16);
              bf[c][2][h] = l0 | (l1 << 16);
            }
          }
        }
        const int byte = BLK == 16 ? j : (j >> 1);
#pragma unroll
        for (int i = 0; i < FR; ++i) {
          const u32 q = j == 0 ? wq[i].x : j == 1 ? wq[i].y : j == 2 ? wq[i].z : wq[i].w;
          u32 af[4];
          if constexpr (MODE == MODE_SIR) {
            decode_sir<OT, BLK>(q, s0[i], s1[i], j, af);
#pragma unroll
            for (int c = 0; c < FC; ++c) mma<OT>(acc[i][c], af, bf[c][0][0], bf[c][0][1]);
          } else {
            decode_word<OT>(q, af);
            const u32 k2 = exact_k2<OT>();
#pragma unroll
            for (int r = 0; r < 4; ++r) af[r] = mul2<OT>(af[r], k2);
            const bool first = BLK == 16 || (j & 1) == 0, last = BLK == 16 || (j & 1) == 1;
#pragma unroll
            for (int c = 0; c < FC; ++c) {
              if (first) {
#pragma unroll
                for (int r = 0; r < 4; ++r) part[i][c][r] = 0.f;
              }
#pragma unroll
              for (int p = NP - 1; p >= 0; --p) mma<OT>(part[i][c], af, bf[c][p][0], bf[c][p][1]);
            }
            if (last) {
              const Acc sg = (Acc)scale_value<BLK>((s0[i] >> (8 * byte)) & 0xFFu);
              const Acc sg8 = (Acc)scale_value<BLK>((s1[i] >> (8 * byte)) & 0xFFu);
#pragma unroll
              for (int c = 0; c < FC; ++c) {
                acc[i][c][0] += (Acc)part[i][c][0] * sg;
                acc[i][c][1] += (Acc)part[i][c][1] * sg;
                acc[i][c][2] += (Acc)part[i][c][2] * sg8;
                acc[i][c][3] += (Acc)part[i][c][3] * sg8;
              }
            }
          }
        }
      }
    }
  }
  vbw::cp_async_wait<0>();

  constexpr int NACC = FR * FC * 4;
  Acc flat[NACC];
#pragma unroll
  for (int i = 0; i < FR; ++i)
#pragma unroll
    for (int c = 0; c < FC; ++c)
#pragma unroll
      for (int r = 0; r < 4; ++r) flat[(i * FC + c) * 4 + r] = acc[i][c][r];
  if (!splitk_reduce<NACC, NT>(flat, ws, counters)) return;
#pragma unroll
  for (int i = 0; i < FR; ++i)
#pragma unroll
    for (int c = 0; c < FC; ++c)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = (rg0 + wr * FR + i) * 16 + g + ((r & 2) ? 8 : 0);
        const int m = m0 + wc * WC + c * 8 + 2 * t + (r & 1);
        if (n < N && m < M) {
          const float v = (float)(flat[(i * FC + c) * 4 + r] * (Acc)out_scale);
          store_out(out, bias, flags, n, m, N, v);
        }
      }
}

// ---------------------------------------------------------------------------------------------- mmv (M <= 16)
// Streaming loads for the weights: each lane's 16 bytes of an atom are its A fragment, so they go from global
// memory straight into registers (STAGES - 1 k-tiles ahead, not through shared memory, not kept in L1).
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ldg_stream4(const void* p) {
  u32 v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// fp32 multiplier of a block's fp32 partial in DIAG mode, from its SIR code placed in bits 16..23 of x
// (see sir_code: code = ((e_u + 29) << 3) | mantissa3, u = scale * 2^-c): u * 2^14 for float16 operands
// (decoded weights carry 2^-14), u for bfloat16 (decoded weights are multiplied back to exact e2m1).
template <typename OT> __device__ __forceinline__ float diag_mult(u32 x);
template <> __device__ __forceinline__ float diag_mult<__half>(u32 x) { return __uint_as_float(x * 16u + 0x38000000u); }
template <> __device__ __forceinline__ float diag_mult<__nv_bfloat16>(u32 x) {
  return __uint_as_float(x * 16u + 0x31000000u);
}

// fp4_gemm_mmv <T, BLK, BC, BK, WARPS, STAGES, DIAG, CL>: the decode path (M <= 16), SIR mode, mma.sync.
//   CL > 1 (sm_90): the split-K CTAs of a tile form a cluster and reduce through shared memory (cluster_reduce).
//   CTA = WARPS row groups of 16 weights rows (one per warp) x BC tokens; split-K over gridDim.z. Only the
//   activations go through shared memory (cp.async ring of STAGES k-tiles, 128B-swizzled rows; rows past M
//   are zeroed once and never copied); the weights of the next STAGES - 1 k-tiles wait in registers.
//   DIAG (M = 1, BC = 8): row r of the activation tile holds token 0's values in the blocks b = r (mod 8) and
//   zeros elsewhere, so column r of the MMA output collects block r's partial sum. Every 8 blocks the lane's
//   two columns are scaled in fp32 and added up: no per-weight scale multiply and no scale build per k16 step.
template <typename T, int BLK, int BC, int BK, int WARPS, int STAGES, bool DIAG, int CL>
__global__ void __launch_bounds__(32 * WARPS) VBW_CLUSTER_Z(CL)
fp4_gemm_mmv(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
             const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
             int M, int N, int K, int lda, int katoms, int kt_per_split, float out_scale, int flags) {
  using OT = typename OpT<T>::type;
  static_assert(!same<T, float>::value, "16-bit activations only");
  constexpr int NT = 32 * WARPS, KA = BK / 64, ATOM = atom_bytes(BLK), FC = BC / 8;
  constexpr int ROWB = BK * 2, CPR = ROWB / 16, STAGE = BC * ROWB;
  constexpr int GA = 8 * BLK / 64;  // DIAG: atoms per group of 8 blocks
  static_assert(BK % 64 == 0 && (BC == 8 || BC == 16) && STAGES >= 2, "tile shape");
  static_assert(!DIAG || (BC == 8 && KA % GA == 0), "DIAG: 8 columns, k-tiles of whole 8-block groups");
  // copies per k-tile: DIAG one row's CPR chunks (each to its diagonal row), else BC rows x CPR chunks
  constexpr int ACH = DIAG ? CPR : BC * CPR, AIT = (ACH + NT - 1) / NT;

  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_rg = (N + 15) >> 4;
  const int rg = blockIdx.x * WARPS + warp;
  const bool rg_ok = rg < n_rg;
  const int m0 = blockIdx.y * BC;
  const int nkt = (katoms + KA - 1) / KA;
  const int kt0 = blockIdx.z * kt_per_split;
  const int nk = max(0, min(nkt, kt0 + kt_per_split) - kt0);

  // Zero the ring once: tile rows that are never copied (tokens past M, DIAG's off-diagonal chunks) stay 0.
  for (int i = tid; i < STAGES * STAGE / 16; i += NT) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // Per-thread activation copy plan, fixed over the k-tiles.
  const u32 s_base = vbw::smem_addr(smem);
  u32 a_dst[AIT];
  const T* a_src[AIT];
  int a_k[AIT];
  unsigned a_ok = 0u;
#pragma unroll
  for (int i = 0; i < AIT; ++i) {
    const int c = tid + i * NT;
    const int r = DIAG ? ((c * 8) / BLK) & 7 : c / CPR;   // tile row
    const int ch = DIAG ? c : c % CPR;                     // 16-byte chunk in the row
    const int tok = DIAG ? m0 : m0 + r;
    a_dst[i] = s_base + r * ROWB + ((ch ^ (r & 7)) << 4);
    a_src[i] = A + (size_t)tok * lda + ch * 8;
    a_k[i] = ch * 8;
    if (c < ACH && tok < M) a_ok |= 1u << i;
  }
  auto load_act = [&](int kt, int buf) {
#pragma unroll
    for (int i = 0; i < AIT; ++i) {
      if ((a_ok >> i) & 1u) {
        const bool ok = kt * BK + a_k[i] < K;
        vbw::cp_async_16(a_dst[i] + buf * STAGE, ok ? (const void*)(a_src[i] + (size_t)kt * BK) : (const void*)A, ok);
      }
    }
  };

  // Per-lane ldmatrix addresses: row (lane & 7) of n-tile pair (lane >> 4); the 128B swizzle of chunk
  // 2kk + hi only touches its low 3 bits, so four offsets (kk mod 4) cover every k16 step.
  u32 b_addr[4];
  {
    const int r = (FC == 2 ? (lane >> 4) * 8 : 0) + (lane & 7);
    const int hi = (lane >> 3) & 1;
#pragma unroll
    for (int q = 0; q < 4; ++q) b_addr[q] = s_base + r * ROWB + ((((2 * q) | hi) ^ (lane & 7)) << 4);
  }

  // This lane's 16 bytes and its rows' scale bytes in the split's first atom of its row group (row group 0
  // for idle warps, whose results are dropped). gemm.py pads katoms to a multiple of 4 (zero atoms), so every
  // k-tile (KA <= 4 atoms) is whole: no bounds per atom, and the two pointers just step through the row group.
  static_assert(KA <= 4 && 4 % KA == 0, "k-tiles must divide the padded row of atoms");
  const u8* wl = Wp + ((size_t)(rg_ok ? rg : 0) * katoms + (size_t)kt0 * KA) * ATOM + lane * 16;
  const u8* wsl = wl - lane * 16 + 512 + g * (BLK == 16 ? 8 : 4);
  auto load_w = [&](uint4 (&q)[KA], uint2 (&s)[KA]) {  // the next k-tile of this split
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      q[a] = ldg_stream16(wl + a * ATOM);
      if (BLK == 16) s[a] = ldg_stream8(wsl + a * ATOM);
      else s[a] = make_uint2(ldg_stream4(wsl + a * ATOM), 0u);
    }
    wl += KA * ATOM;
    wsl += KA * ATOM;
  };

  float acc[FC][4];
  float part[4] = {0.f, 0.f, 0.f, 0.f};  // DIAG: the current 8-block group's columns
  float dsum[2] = {0.f, 0.f};            // DIAG: rows g and g + 8, this lane's two blocks of every group
#pragma unroll
  for (int c = 0; c < FC; ++c)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[c][r] = 0.f;

  auto compute = [&](int buf, const uint4 (&wq)[KA], const uint2 (&sc)[KA]) {
    const u32 so = buf * STAGE;
#pragma unroll
    for (int a = 0; a < KA; ++a) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kk = a * 4 + j;
        u32 bf[FC][2];
        if (FC == 2) vbw::ldsm_x4(bf[0][0], bf[0][1], bf[1][0], bf[1][1], b_addr[kk & 3] + so + (kk >> 2) * 128);
        else vbw::ldsm_x2(bf[0][0], bf[0][1], b_addr[kk & 3] + so + (kk >> 2) * 128);
        const u32 q = j == 0 ? wq[a].x : j == 1 ? wq[a].y : j == 2 ? wq[a].z : wq[a].w;
        u32 af[4];
        if constexpr (DIAG) {
          decode_word<OT>(q, af);
          if (same<OT, __nv_bfloat16>::value) {
#pragma unroll
            for (int r = 0; r < 4; ++r) af[r] = mul2<OT>(af[r], exact_k2<OT>());
          }
          mma<OT>(part, af, bf[0][0], bf[0][1]);
        } else {
          decode_sir<OT, BLK>(q, sc[a].x, BLK == 16 ? sc[a].y : sc[a].x >> 16, j, af);
#pragma unroll
          for (int c = 0; c < FC; ++c) mma<OT>(acc[c], af, bf[c][0], bf[c][1]);
        }
      }
      if constexpr (DIAG) {
        if ((a + 1) % GA == 0) {  // end of an 8-block group: columns 2t, 2t + 1 are blocks 2t, 2t + 1
          u32 wg_, wg8;
          if (BLK == 16) {  // 4 blocks per atom: blocks 2t, 2t+1 are bytes 2(t&1), +1 of atom t >> 1
            const uint2 s = (t >> 1) ? sc[a - GA + 2] : sc[a - GA + 1];
            wg_ = s.x; wg8 = s.y;
          } else {          // 2 blocks per atom: atom t, row g in bytes 0-1, row g + 8 in bytes 2-3
            const u32 s = t == 0 ? sc[a - GA + 1].x : t == 1 ? sc[a - GA + 2].x : t == 2 ? sc[a - GA + 3].x : sc[a].x;
            wg_ = s; wg8 = s >> 16;
          }
          const u32 sh = BLK == 16 ? (t & 1) * 2 : 0;  // first byte
          // [byte] -> bits 16..23 (byte_perm with 0x4 selectors = zero bytes)
          const u32 c0 = __byte_perm(wg_, 0u, 0x4044u | (sh << 8)), c1 = __byte_perm(wg_, 0u, 0x4044u | ((sh + 1) << 8));
          const u32 c2 = __byte_perm(wg8, 0u, 0x4044u | (sh << 8)), c3 = __byte_perm(wg8, 0u, 0x4044u | ((sh + 1) << 8));
          dsum[0] = fmaf(part[0], diag_mult<OT>(c0), fmaf(part[1], diag_mult<OT>(c1), dsum[0]));
          dsum[1] = fmaf(part[2], diag_mult<OT>(c2), fmaf(part[3], diag_mult<OT>(c3), dsum[1]));
#pragma unroll
          for (int r = 0; r < 4; ++r) part[r] = 0.f;
        }
      }
    }
  };

  // STAGES - 1 k-tiles in flight for both operands: the activation ring in shared memory and the weights in
  // STAGES register buffers. The k-loop is unrolled by STAGES, so buffer and stage indices are static.
  // The weights are constants, so their first k-tiles are requested before waiting on the kernel before this
  // one (programmatic dependent launch, pdl.cuh); the activations and everything written come after.
  uint4 wq[STAGES][KA];
  uint2 sc[STAGES][KA];
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < nk) load_w(wq[s], sc[s]);
  vbw::pdl_wait();
  vbw::pdl_launch_dependents();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_act(kt0 + s, s);
    vbw::cp_async_commit();
  }
  for (int it0 = 0; it0 < nk; it0 += STAGES) {
#pragma unroll
    for (int b = 0; b < STAGES; ++b) {
      const int it = it0 + b;
      if (it < nk) {
        vbw::cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int pf = it + STAGES - 1;
        if (pf < nk) {
          load_act(kt0 + pf, (b + STAGES - 1) % STAGES);
          load_w(wq[(b + STAGES - 1) % STAGES], sc[(b + STAGES - 1) % STAGES]);
        }
        vbw::cp_async_commit();
        compute(b, wq[b], sc[b]);
      }
    }
  }
  vbw::cp_async_wait<0>();

  if constexpr (DIAG) {  // sum each row over the quad's 8 blocks; column 0 (token 0) is lane t = 0's
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
      dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
    }
    acc[0][0] = dsum[0]; acc[0][2] = dsum[1]; acc[0][1] = acc[0][3] = 0.f;
  }
  constexpr int NACC = FC * 4;
  float flat[NACC];
#pragma unroll
  for (int c = 0; c < FC; ++c)
#pragma unroll
    for (int r = 0; r < 4; ++r) flat[c * 4 + r] = acc[c][r];
  if constexpr (CL > 1) {
    static_assert(NACC * NT * 4 <= STAGES * STAGE, "the partials go through the drained ring");
    __syncthreads();  // every warp is past its last ldmatrix
    if (!cluster_reduce<NACC, NT, CL>(flat, reinterpret_cast<float*>(smem))) return;
  } else if (!splitk_reduce<NACC, NT>(flat, ws, counters)) {
    return;
  }
  if (!rg_ok) return;
#pragma unroll
  for (int c = 0; c < FC; ++c)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = rg * 16 + g + ((r & 2) ? 8 : 0);
      const int m = m0 + c * 8 + 2 * t + (r & 1);
      if (n < N && m < M && (!DIAG || t == 0)) store_out(out, bias, flags, n, m, N, flat[c * 4 + r] * out_scale);
    }
}


// ---------------------------------------------------------------------------------------------- mmvk (M = 1)
// fp4_gemm_mmvk <T, BLK, PU>: the M = 1 decode GEMV with K split among the warps of one CTA instead of over CTAs.
//   CTA = R row groups x S k-parts, one warp each (blockDim.x = 32 R S, S = ceil(katoms / apw)); warp (r, s)
//   streams atoms [s apw, (s + 1) apw) of row group blockIdx.x R + r, PU units of 4 atoms (256 k) in flight.
//   Nothing goes through shared memory on the way: the weights stream into registers (as fp4_gemm_mmv) and so
//   does each lane's own slice of the activation row (L1-cached loads), so there is no ring, no barrier per
//   k-tile and no split-K workspace, fence or counter; the S partials of a row meet once, in shared memory, and
//   are added in k order (deterministic).
//   DIAG as in fp4_gemm_mmv (M = 1): MMA column c collects block c of every 8-block group. Here the B fragment
//   is built in registers: lane (g, t) holds column g, which is nonzero only in the k16 step(s) of block g of
//   the group, so a lane loads just that block's activation pairs (2 words nvfp4, 4 mxfp4) per group and
//   masks them into the steps' B registers; the group's scale codes are one load per lane (its blocks 2t, 2t+1).
//   flags & FLAG_SWIGLU8: the weight's rows alternate 8 gate rows and 8 up rows (N % 16 == 0, no bias or
//   activation) and out [N / 2] gets silu(gate) * up, each rounded to the output type first, computed as the
//   model's silu_mul computes it (vbw_cupy/models/gpu.py: the decode step's fused gate / up projection).
constexpr int FLAG_SWIGLU8 = 1 << 12;
template <typename T, int BLK, int PU>
__global__ void __launch_bounds__(512)
fp4_gemm_mmvk(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
              const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
              int M, int N, int K, int lda, int katoms, int apw, float out_scale, int flags) {
  using OT = typename OpT<T>::type;
  static_assert(!same<T, float>::value, "16-bit activations only");
  constexpr int ATOM = atom_bytes(BLK);
  constexpr int NG = BLK == 16 ? 2 : 1;  // 8-block groups per unit of 4 atoms
  __shared__ float red[16 * 16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int S = (katoms + apw - 1) / apw;
  const int R = (blockDim.x >> 5) / S;  // row groups of the CTA
  const int r = warp / S, s = warp - r * S;
  const int n_rg = (N + 15) >> 4;
  const int rg = blockIdx.x * R + r;
  const bool rg_ok = rg < n_rg;
  const int a0 = s * apw;
  const int nu = max(0, min(apw, katoms - a0)) >> 2;  // units of 4 atoms (katoms and apw are multiples of 4)

  // this lane's 16 bytes of the warp's first atom, and its scale word of a group (row g's and row g + 8's codes
  // of blocks 2t, 2t + 1: nvfp4 atom t >> 1 of the group, bytes 2 (t & 1), +1; mxfp4 atom t, bytes 0-1 / 2-3);
  // the three pointers step one unit per load
  const u8* wl = Wp + ((size_t)(rg_ok ? rg : 0) * katoms + a0) * ATOM + lane * 16;
  const u8* wsl = wl - lane * 16 + 512 + (BLK == 16 ? (t >> 1) * ATOM + g * 8 : t * ATOM + g * 4);
  // this lane's activation words: block g of each group (nvfp4 k = 16 g + 2t, + 8; mxfp4 32 g + 2t + {0, 8, 16,
  // 24}); ku: the unit's first k
  long long ku = (long long)a0 * 64;  // 64-bit: K may come within a unit of 2^31
  const u32* xl = reinterpret_cast<const u32*>(A) + ((ku + (BLK == 16 ? 16 : 32) * g + 2 * t) >> 1);

  uint4 wq[PU][4];
  uint2 sc[PU][NG];
  u32 xv[PU][4];
  auto load_w = [&](int u, int b) {
    if (u < nu) {
#pragma unroll
      for (int a = 0; a < 4; ++a) wq[b][a] = ldg_stream16(wl + a * ATOM);
#pragma unroll
      for (int q = 0; q < NG; ++q) {
        if (BLK == 16) sc[b][q] = ldg_stream8(wsl + 2 * q * ATOM);
        else sc[b][q] = make_uint2(ldg_stream4(wsl), 0u);
      }
      wl += 4 * ATOM;
      wsl += 4 * ATOM;
    }
  };
  // word i of the unit: nvfp4 group i / 2, + 8 (i & 1); mxfp4 + 8 i (in halves; / 2 in words). ld.global.ca,
  // not .nc: under programmatic dependent launch the kernel that writes A may still be running when this one
  // starts (it is only read after pdl_wait), and .nc is for data read-only over the kernel's whole life.
  auto xoff = [](int i) { return BLK == 16 ? (i >> 1) * 64 + (i & 1) * 4 : i * 4; };
  auto load_x = [&](int u, int b) {
    if (u < nu) {
      if (ku + 256 <= K) {  // the whole unit inside K
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[b][i] = __ldca(xl + xoff(i));
      } else {
        const long long kl = ku + (BLK == 16 ? 16 : 32) * g + 2 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[b][i] = kl + 2 * xoff(i) < K ? __ldca(xl + xoff(i)) : 0u;
      }
      xl += 128;
      ku += 256;
    }
  };

  float part[4] = {0.f, 0.f, 0.f, 0.f};  // the current 8-block group's columns
  float dsum[2] = {0.f, 0.f};            // rows g and g + 8, this lane's two blocks of every group
  const u32 sh = BLK == 16 ? (t & 1) * 2 : 0;
  const u32 sel0 = 0x4044u | (sh << 8), sel1 = 0x4044u | ((sh + 1) << 8);  // byte sh / sh + 1 -> bits 16..23
  auto compute = [&](int b) {
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int blk = BLK == 16 ? (a & 1) * 4 + j : 2 * a + (j >> 1);  // block of the group = MMA column
        const int xi = BLK == 16 ? (a >> 1) * 2 : (j & 1) * 2;
        const bool on = g == blk;
        const u32 b0 = on ? xv[b][xi] : 0u, b1 = on ? xv[b][xi + 1] : 0u;
        const u32 qw = j == 0 ? wq[b][a].x : j == 1 ? wq[b][a].y : j == 2 ? wq[b][a].z : wq[b][a].w;
        u32 af[4];
        decode_word<OT>(qw, af);
        if (same<OT, __nv_bfloat16>::value) {
#pragma unroll
          for (int i = 0; i < 4; ++i) af[i] = mul2<OT>(af[i], exact_k2<OT>());
        }
        mma<OT>(part, af, b0, b1);
      }
      if ((BLK == 16 && (a & 1)) || a == 3) {  // end of a group: columns 2t, 2t + 1 are blocks 2t, 2t + 1
        const uint2 sw = sc[b][BLK == 16 ? a >> 1 : 0];
        const u32 wg_ = sw.x, wg8 = BLK == 16 ? sw.y : sw.x >> 16;
        const u32 c0 = __byte_perm(wg_, 0u, sel0), c1 = __byte_perm(wg_, 0u, sel1);
        const u32 c2 = __byte_perm(wg8, 0u, sel0), c3 = __byte_perm(wg8, 0u, sel1);
        dsum[0] = fmaf(part[0], diag_mult<OT>(c0), fmaf(part[1], diag_mult<OT>(c1), dsum[0]));
        dsum[1] = fmaf(part[2], diag_mult<OT>(c2), fmaf(part[3], diag_mult<OT>(c3), dsum[1]));
#pragma unroll
        for (int i = 0; i < 4; ++i) part[i] = 0.f;
      }
    }
  };

  // The weights are constants: the first units are requested before waiting on the previous kernel (pdl.cuh).
#pragma unroll
  for (int b = 0; b < PU; ++b) load_w(b, b);
  vbw::pdl_wait();
  vbw::pdl_launch_dependents();
#pragma unroll
  for (int b = 0; b < PU; ++b) load_x(b, b);
  for (int u0 = 0; u0 < nu; u0 += PU) {
#pragma unroll
    for (int b = 0; b < PU; ++b) {
      if (u0 + b < nu) {
        compute(b);
        load_w(u0 + b + PU, b);
        load_x(u0 + b + PU, b);
      }
    }
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {  // the quad's 8 columns
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
  }
  if (t == 0) {
    red[warp * 16 + g] = dsum[0];
    red[warp * 16 + g + 8] = dsum[1];
  }
  __syncthreads();
  if (s == 0 && lane < 16 && rg_ok) {
    float v = 0.f;
    for (int i = 0; i < S; ++i) v += red[(warp + i) * 16 + lane];
    v = v * out_scale + 0.f;  // (+ 0: a -0 becomes +0, as store_out's bias add makes it in the unfused GEMM)
    if (flags & FLAG_SWIGLU8) {  // rows 16 rg + l (gate) and + 8 (up) -> out[8 rg + l] = silu(gate) * up
      const int ok = (flags >> 8) & 3;  // both rounded to the output type first, as a stored GEMM output is
      v = ok == 0 ? __half2float(__float2half_rn(v)) : ok == 1 ? __bfloat162float(__float2bfloat16_rn(v)) : v;
      const float up = __shfl_down_sync(0xffffu, v, 8);
      // stored as silu_mul stores it (store_value: no bias add, which would turn a -0 into +0)
      if (lane < 8) vbw_gemm::store_value(out, rg * 8 + lane, v / (1.f + expf(-v)) * up, flags);
    } else {
      const int n = rg * 16 + lane;
      if (n < N) store_out(out, bias, flags, n, 0, N, v);
    }
  }
}

}  // namespace vbw_fp4gemm
