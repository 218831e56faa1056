// fp4_gemm_sm90.cu: the FP4-weight GEMM kernels for Hopper (sm_90a wgmma; layout, modes and history:
// fp4_gemm.cuh): fp4_gemm_wgmma (decoded weights staged in shared memory) and fp4_gemm_wgrs (decoded weights
// as register operands, TMA loads: the prefill path), with their shared epilogue wg_finish.
#include "fp4_gemm.cuh"

namespace vbw_fp4gemm {

// The two wgmma kernels' ending: split-K reduction (only the tile's last CTA goes on), then the epilogue.
// Accumulator acc[4i + r] of thread t (in its quad) holds out[nbase + 8 * (r >> 1)][m0 + 8i + 2t + (r & 1)].
// Epilogue of the wgmma kernels (CTA tile: BR weight rows n x BC tokens m, after split-K). The fp32 tile goes
// through shared memory (the drained ring; rows of BR + 4 floats, so the accumulator-layout writes hit 32
// distinct banks), then each thread finishes 8 consecutive n of one token row: bias, activation and
// conversion in a loop, 16-byte stores along the output's rows. (Per element from the accumulators, the
// stores were 2-byte writes N apart and a call each.)
template <int BR, int BC, int NACC, int NT>
__device__ __forceinline__ void wg_finish(float (&acc)[NACC], void* __restrict__ ws, int* __restrict__ counters,
                                          u8* smem, int rg0, int m0, int N, int M, void* __restrict__ out,
                                          const void* __restrict__ bias, int flags, float out_scale) {
  if (!splitk_reduce<NACC, NT>(acc, ws, counters)) return;
  constexpr int LDT = BR + 4, CPR = BR / 8;
  static_assert(NT % CPR == 0, "epilogue mapping");
  float* tile = reinterpret_cast<float*>(smem);
  {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, nl = (threadIdx.x >> 5) * 16 + g;
    __syncthreads();  // every warp is done with the ring
#pragma unroll
    for (int i = 0; i < BC / 8; ++i)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        tile[(i * 8 + 2 * t + (r & 1)) * LDT + nl + ((r & 2) ? 8 : 0)] = acc[4 * i + r] * out_scale;
    __syncthreads();
  }
  const int col = (threadIdx.x % CPR) * 8, n0 = rg0 * 16 + col;
  float bv[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) bv[e] = n0 + e < N ? bias_at(bias, flags, n0 + e) : 0.f;
  const int ok = (flags >> 8) & 3, es = ok == 2 ? 4 : 2;
  const bool vec = n0 + 8 <= N && (N * es) % 16 == 0 && (reinterpret_cast<size_t>(out) & 15) == 0;
#pragma unroll 1
  for (int rr = threadIdx.x / CPR; rr < BC && m0 + rr < M; rr += NT / CPR) {
    float v[8];
    const float4 a = *reinterpret_cast<const float4*>(tile + rr * LDT + col);
    const float4 b = *reinterpret_cast<const float4*>(tile + rr * LDT + col + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = activate(v[e] + bv[e], flags);
    vbw_gemm::store8(out, (size_t)(m0 + rr) * (size_t)N + (size_t)n0, v, N - n0, flags, vec);
  }
}

// ---------------------------------------------------------------------------------------------- wgmma (sm_90a)
// Helpers (WgmmaSS / WgmmaRS, fences, descriptors) live in wgmma.cuh.
using vbw::WgmmaSS;
using vbw::WgmmaRS;
using vbw::wg_fence;
using vbw::wg_commit;
using vbw::wg_wait;
using vbw::fence_async_smem;
using vbw::named_bar;
using vbw::keep_acc;
using vbw::keep_regs;
using vbw::desc_sw128_k;

// CTA = WGS warpgroups x 64 weight rows, BC tokens, BK = 64 (one atom per warp per k-tile). cp.async ring of
// STAGES (activation tile in 128B-swizzled rows + the raw FP4 atoms); each warp decodes its atom (SIR) into a
// double-buffered, 128B-swizzled f16/bf16 A tile in shared memory, then wgmma SS (A and B from smem). Decode
// of tile it+1 overlaps wgmma of tile it (wait_group 1). Prefetch distance STAGES-2 tiles.
template <typename T, int BLK, int BC, int WGS, int STAGES>
__global__ void __launch_bounds__(128 * WGS, 1)
fp4_gemm_wgmma(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
               const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
               int M, int N, int K, int lda, int katoms, int kt_per_split, float out_scale, int flags) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!same<T, float>::value, "wgmma path: float16 / bfloat16 activations");
  static_assert(STAGES >= 4 && (BC == 64 || BC == 128 || BC == 256), "wgmma config");
  using OT = T;
  constexpr int NT = 128 * WGS, BR = 64 * WGS, ATOM = atom_bytes(BLK);
  constexpr int B_BYTES = BC * 128, W_BYTES = (BR / 16) * ATOM;
  constexpr int STAGE = (B_BYTES + W_BYTES + 1023) / 1024 * 1024;
  static_assert(BC * (BR + 4) * 4 <= STAGES * STAGE, "the epilogue's fp32 tile fits the ring (wg_finish)");
  constexpr int A_BYTES = BR * 128;
  constexpr int NACC = BC / 2;
  extern __shared__ __align__(128) u8 smem_raw[];
  const u32 raw = vbw::smem_addr(smem_raw);
  u8* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const u32 sbase = vbw::smem_addr(smem);
  u8* abuf = smem + STAGES * STAGE;  // 2 x A_BYTES
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  const int n_rg = (N + 15) >> 4;
  const int rg0 = blockIdx.x * (BR / 16);
  const int m0 = blockIdx.y * BC;
  const int kt0 = blockIdx.z * kt_per_split;
  const int nk = max(0, min(katoms, kt0 + kt_per_split) - kt0);

  // Per-thread copy plan, fixed over the k-tiles.
  constexpr int ACH = BC * 8, AIT = (ACH + NT - 1) / NT;
  constexpr int CPA = ATOM / 16, WCH = (BR / 16) * CPA, WIT = (WCH + NT - 1) / NT;
  const int a_ch = tid & 7, a_r0 = tid >> 3;
  const T* a_base = A + (size_t)(m0 + a_r0) * lda + a_ch * 8;
  size_t w_off[WIT];
  int w_atom[WIT];  // all 0: one atom per row group and stage
  const unsigned w_ok = weight_copy_plan<WIT, NT, CPA, CPA, WCH, ATOM>(tid, rg0, n_rg, katoms, w_off, w_atom);
  auto load_stage = [&](int kt, int buf) {
    u8* sb = smem + buf * STAGE;
    u8* sw = sb + B_BYTES;
    const bool k_ok = kt * 64 + a_ch * 8 < K;
#pragma unroll
    for (int i = 0; i < AIT; ++i) {
      const int r = a_r0 + i * (NT / 8);
      if (ACH % NT == 0 || r < BC) {
        const bool ok = k_ok && m0 + r < M;
        const T* src = a_base + (size_t)i * (NT / 8) * lda + (size_t)kt * 64;
        vbw::cp_async_16(vbw::smem_addr(sb + r * 128 + ((a_ch ^ (r & 7)) << 4)), ok ? (const void*)src : (const void*)A, ok);
      }
    }
#pragma unroll
    for (int i = 0; i < WIT; ++i) {
      const int c = tid + i * NT;
      if (WCH % NT == 0 || c < WCH) {
        const bool ok = (w_ok >> i) & 1u;
        const u8* src = Wp + w_off[i] + (size_t)kt * ATOM;
        vbw::cp_async_16(vbw::smem_addr(sw + c * 16), ok ? (const void*)src : (const void*)Wp, ok);
      }
    }
  };
  // This warp's atom of tile `buf` -> its 16 rows of A buffer `ab` (f16/bf16, exact e2m1 * u, swizzled).
  auto decode_atom = [&](int buf, int ab) {
    const u8* ap = smem + buf * STAGE + B_BYTES + warp * ATOM;
    const uint4 wq = *reinterpret_cast<const uint4*>(ap + lane * 16);
    u32 s0, s1;
    if (BLK == 16) {
      const uint2 s = *reinterpret_cast<const uint2*>(ap + 512 + g * 8);
      s0 = s.x; s1 = s.y;
    } else {
      s0 = *reinterpret_cast<const u32*>(ap + 512 + g * 4);
      s1 = s0 >> 16;
    }
    u8* arow0 = abuf + ab * A_BYTES + (warp * 16 + g) * 128;
    u8* arow1 = arow0 + 8 * 128;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 q = j == 0 ? wq.x : j == 1 ? wq.y : j == 2 ? wq.z : wq.w;
      u32 f[4];
      decode_sir<OT, BLK>(q, s0, s1, j, f);
      const int c0 = ((2 * j) ^ g) << 4, c1 = ((2 * j + 1) ^ g) << 4;
      *reinterpret_cast<u32*>(arow0 + c0 + 4 * t) = f[0];
      *reinterpret_cast<u32*>(arow1 + c0 + 4 * t) = f[1];
      *reinterpret_cast<u32*>(arow0 + c1 + 4 * t) = f[2];
      *reinterpret_cast<u32*>(arow1 + c1 + 4 * t) = f[3];
    }
    fence_async_smem();
    named_bar(1 + wg, 128);  // the warpgroup's 64 rows are written before its wgmma reads them
  };

  float acc[NACC];
#pragma unroll
  for (int r = 0; r < NACC; ++r) acc[r] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < nk) load_stage(kt0 + s, s);
    vbw::cp_async_commit();
  }
  if (nk > 0) {
    vbw::cp_async_wait<STAGES - 3>();
    fence_async_smem();
    __syncthreads();
    decode_atom(0, 0);
  }
  const u32 a_wg = vbw::smem_addr(abuf) + wg * 64 * 128;
  for (int it = 0; it < nk; ++it) {
    const int buf = it % STAGES;
    keep_acc(acc);
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j)
      WgmmaSS<OT, BC>::run(acc, desc_sw128_k(a_wg + (it & 1) * A_BYTES + j * 32),
                           desc_sw128_k(sbase + buf * STAGE + j * 32));
    wg_commit();
    if (it + 1 < nk) {
      vbw::cp_async_wait<STAGES - 4>();  // tile it+1 landed (this thread's copies)
      fence_async_smem();
      __syncthreads();                   // ... everyone's; every warpgroup finished wgmma of tile it-1
      const int pf = it + STAGES - 2;    // refills the buffer of tile it-2
      if (pf < nk) load_stage(kt0 + pf, pf % STAGES);
      vbw::cp_async_commit();
      wg_wait<1>();                      // this warpgroup's wgmma of tile it-1 done: A buffer (it+1)&1 is free
      keep_acc(acc);
      decode_atom((it + 1) % STAGES, (it + 1) & 1);
    }
  }
  wg_wait<0>();
  keep_acc(acc);
  vbw::cp_async_wait<0>();

  wg_finish<BR, BC, NACC, NT>(acc, ws, counters, smem, rg0, m0, N, M, out, bias, flags, out_scale);
#else
  __trap();  // Hopper only: gemm.py never launches it elsewhere
#endif
}


// ---------------------------------------------------------------------------------------------- wgmma, A in registers
// Register-A variant (Machete-like): each warp's decoded fragments feed wgmma straight from registers, B (the
// activations) from 128B-swizzled smem; KSUB 64-k sub-tiles per stage. ptxas serializes wgmma when an A
// register is written while any wgmma is in flight, so every k-tile drains (wait_group 0) before the next
// decode; the two warpgroups overlap each other, and KSUB = 2 halves the drains per FLOP.
template <typename T, int BLK, int BC, int WGS, int STAGES, int KSUB, bool TMA>
__global__ void __launch_bounds__(128 * WGS, 1)
fp4_gemm_wgrs(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
              const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
              int M, int N, int K, int lda, int katoms, int kt_per_split, float out_scale, int flags,
              const __grid_constant__ vbw::TmaDesc tm_a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!same<T, float>::value, "wgmma path: float16 / bfloat16 activations");
  static_assert(STAGES >= 3 && (BC == 64 || BC == 128 || BC == 256) && (KSUB == 1 || KSUB == 2), "wgmma config");
  using OT = T;
  constexpr int NT = 128 * WGS, BR = 64 * WGS, ATOM = atom_bytes(BLK);
  constexpr int SUB = BC * 128;                               // one 64-k activation sub-tile
  constexpr int B_BYTES = KSUB * SUB, W_BYTES = (BR / 16) * KSUB * ATOM;
  constexpr int STAGE = (B_BYTES + W_BYTES + 1023) / 1024 * 1024;
  static_assert(BC * (BR + 4) * 4 <= STAGES * STAGE, "the epilogue's fp32 tile fits the ring (wg_finish)");
  constexpr int NACC = BC / 2;
  extern __shared__ __align__(128) u8 smem_raw[];
  const u32 raw = vbw::smem_addr(smem_raw);
  u8* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const u32 sbase = vbw::smem_addr(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_rg = (N + 15) >> 4;
  const int rg0 = blockIdx.x * (BR / 16);
  const int m0 = blockIdx.y * BC;
  const int nkt = (katoms + KSUB - 1) / KSUB;
  const int kt0 = blockIdx.z * kt_per_split;
  const int nk = max(0, min(nkt, kt0 + kt_per_split) - kt0);

  // Per-thread copy plan, fixed over the k-tiles.
  constexpr int ACH = BC * 8, AIT = (ACH + NT - 1) / NT;
  constexpr int CPA = ATOM / 16, CPR = KSUB * CPA, WCH = (BR / 16) * CPR, WIT = (WCH + NT - 1) / NT;
  const int a_ch = tid & 7, a_r0 = tid >> 3;
  const T* a_base = A + (size_t)(m0 + a_r0) * lda + a_ch * 8;
  size_t w_off[TMA ? 1 : WIT];
  int w_atom[TMA ? 1 : WIT];
  unsigned w_ok = 0;
  if constexpr (!TMA) w_ok = weight_copy_plan<WIT, NT, CPR, CPA, WCH, ATOM>(tid, rg0, n_rg, katoms, w_off, w_atom);
  // TMA: buffer b's mbarrier at bar0 + 8 b; the j-th k-tile of this CTA is that buffer's fill j / STAGES.
  const u32 bar0 = sbase + STAGES * STAGE;
  if constexpr (TMA) {
    if (tid == 0)
      for (int b = 0; b < STAGES; ++b) vbw::mbar_init(bar0 + 8 * b, 1);
    __syncthreads();
  }
  auto load_stage = [&](int kt, int buf) {
    if constexpr (TMA) {
      // One thread: the activation sub-tiles by TMA (rows past M and k past K zero-filled; the map's 128-byte
      // swizzle is this layout), each 16-row group's atoms by bulk copies. Atoms past katoms and row groups
      // past n_rg re-read the last real ones: finite SIR weights times zero activations, or rows never stored.
      if (tid == 0) {
        const u32 sb = sbase + buf * STAGE, bar = bar0 + 8 * buf;
        vbw::mbar_expect_tx(bar, B_BYTES + W_BYTES);
#pragma unroll
        for (int u = 0; u < KSUB; ++u) vbw::tma_load_2d(sb + u * SUB, &tm_a, bar, (kt * KSUB + u) * 64, m0);
#pragma unroll
        for (int r = 0; r < BR / 16; ++r)
#pragma unroll
          for (int u = 0; u < KSUB; ++u) {
            const size_t at = (size_t)min(rg0 + r, n_rg - 1) * katoms + min(kt * KSUB + u, katoms - 1);
            vbw::bulk_load(sb + B_BYTES + (r * KSUB + u) * ATOM, Wp + at * ATOM, ATOM, bar);
          }
      }
      return;
    }
    u8* sb = smem + buf * STAGE;
    u8* sw = sb + B_BYTES;
#pragma unroll
    for (int u = 0; u < KSUB; ++u) {
      const int kb = (kt * KSUB + u) * 64;
      const bool k_ok = kb + a_ch * 8 < K;
#pragma unroll
      for (int i = 0; i < AIT; ++i) {
        const int r = a_r0 + i * (NT / 8);
        if (ACH % NT == 0 || r < BC) {
          const bool ok = k_ok && m0 + r < M;
          const T* src = a_base + (size_t)i * (NT / 8) * lda + kb;
          vbw::cp_async_16(vbw::smem_addr(sb + u * SUB + r * 128 + ((a_ch ^ (r & 7)) << 4)),
                           ok ? (const void*)src : (const void*)A, ok);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < WIT; ++i) {
      const int c = tid + i * NT;
      if (WCH % NT == 0 || c < WCH) {
        const bool ok = ((w_ok >> i) & 1u) && kt * KSUB + w_atom[i] < katoms;
        const u8* src = Wp + w_off[i] + (size_t)kt * KSUB * ATOM;
        vbw::cp_async_16(vbw::smem_addr(sw + c * 16), ok ? (const void*)src : (const void*)Wp, ok);
      }
    }
  };

  float acc[NACC];
#pragma unroll
  for (int r = 0; r < NACC; ++r) acc[r] = 0.f;

  // Per k-tile: decode this warp's KSUB atoms into A registers -> 4*KSUB wgmma (B from smem) -> while they
  // run: wait for the next stage, barrier, refill the freed buffer, load the next raw words -> drain.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(kt0 + s, s);
    vbw::cp_async_commit();
  }
  uint4 wq[KSUB];
  u32 s0[KSUB], s1[KSUB];
  auto load_words = [&](int buf) {
#pragma unroll
    for (int u = 0; u < KSUB; ++u) {
      const u8* ap = smem + buf * STAGE + B_BYTES + (warp * KSUB + u) * ATOM;
      wq[u] = *reinterpret_cast<const uint4*>(ap + lane * 16);
      if (BLK == 16) {
        const uint2 s = *reinterpret_cast<const uint2*>(ap + 512 + g * 8);
        s0[u] = s.x; s1[u] = s.y;
      } else {
        s0[u] = *reinterpret_cast<const u32*>(ap + 512 + g * 4);
        s1[u] = s0[u] >> 16;
      }
    }
  };
  if (nk > 0) {
    if constexpr (TMA) {
      vbw::mbar_wait(bar0, 0);
    } else {
      vbw::cp_async_wait<STAGES - 2>();
      fence_async_smem();
      __syncthreads();
    }
    load_words(0);
  }
  for (int it = 0; it < nk; ++it) {
    const int buf = it % STAGES;
    u32 af[16 * KSUB];
#pragma unroll
    for (int u = 0; u < KSUB; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 q = j == 0 ? wq[u].x : j == 1 ? wq[u].y : j == 2 ? wq[u].z : wq[u].w;
        u32 f[4];
        decode_sir<OT, BLK>(q, s0[u], s1[u], j, f);
#pragma unroll
        for (int r = 0; r < 4; ++r) af[16 * u + 4 * j + r] = f[r];
      }
    u64 desc[4 * KSUB];
#pragma unroll
    for (int u = 0; u < KSUB; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        desc[4 * u + j] = desc_sw128_k(sbase + buf * STAGE + u * SUB + j * 32);
        asm volatile("" : "+l"(desc[4 * u + j]) :: "memory");
      }
    keep_regs(af);
    keep_acc(acc);
    wg_fence();
#pragma unroll
    for (int x = 0; x < 4 * KSUB; ++x)
      WgmmaRS<OT, BC>::run(acc, af[4 * x], af[4 * x + 1], af[4 * x + 2], af[4 * x + 3], desc[x]);
    wg_commit();
    if (it + 1 < nk) {
      if constexpr (!TMA) {
        vbw::cp_async_wait<STAGES - 3>();  // groups committed: STAGES-1 + it; tile it+1 is group it+1
        fence_async_smem();
      }
      __syncthreads();  // (cp.async: tile it+1 landed everywhere;) every warpgroup drained tile it-1 (its buffer is free)
      const int pf = it + STAGES - 1;
      if (pf < nk) load_stage(kt0 + pf, pf % STAGES);
      vbw::cp_async_commit();
      if constexpr (TMA) vbw::mbar_wait(bar0 + 8 * ((it + 1) % STAGES), (u32)((it + 1) / STAGES) & 1u);
      load_words((it + 1) % STAGES);
    }
    wg_wait<0>();
    keep_regs(af);
    keep_acc(acc);
  }
  vbw::cp_async_wait<0>();

  wg_finish<BR, BC, NACC, NT>(acc, ws, counters, smem, rg0, m0, N, M, out, bias, flags, out_scale);
#else
  __trap();  // Hopper only: gemm.py never launches it elsewhere
#endif
}


}  // namespace vbw_fp4gemm
