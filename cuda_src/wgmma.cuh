// wgmma.cuh: Hopper (sm_90a) warpgroup MMA helpers shared by the vbw_cupy kernels.
//
//   WgmmaSS<T, N, TB>::run(d, da, db, acc = 1)   d = A * B (acc = 0) or d += A * B, m64nNk16, A and B from
//                                                shared memory
//   WgmmaSS8<N>::run(d, da, db, acc = 1)          FP8: m64nNk32 e4m3 x e4m3, both operands K-major in shared
//                                                memory (N = 128, 192)
//   WgmmaRS<T, N, TB>::run(d, a0..a3, db)        the same with A from registers (the m16n8k16 A fragment layout
//                                                per warp: warp w of the warpgroup holds rows 16w..16w+15)
//   WgmmaRS8<N>::run(d, a0..a3, db)              FP8 with A from registers: m64nNk32 e4m3, B K-major (N = 128,
//                                                256); a0 / a1 hold 4 bytes of k 4t..4t+3 of rows g / g + 8,
//                                                a2 / a3 the same at k + 16 (mma.sync m16n8k32's 8-bit A layout)
//     T = __half / __nv_bfloat16, fp32 accumulators d[N / 2]; TB = 1 reads B MN-major (transposed: N contiguous)
//     Accumulator layout (lane l, g = l / 4, t = l % 4, warp w): d[4j + e] is row 16w + g + 8 (e / 2),
//     column 8j + 2t + e % 2, i.e. the m16n8 C fragment of mma.sync repeated over the N / 8 column tiles.
//   wg_fence / wg_commit / wg_wait<N>            wgmma.fence / commit_group / wait_group
//   fence_async_smem                             generic-proxy smem writes (st.shared, cp.async) -> wgmma reads
//   named_bar(id, n)                             bar.sync on a named barrier for n threads
//   named_bar_or(id, n, v)                       the same, returning v ORed over those threads
//   desc_sw128_k(addr)                           descriptor of a K-major tile in 128-byte-swizzled rows (one row
//                                                = 64 16-bit elements of K; 8-row groups 1024 B apart)
//   desc_sw128_mn(addr, lbo)                     descriptor of an MN-major tile: rows of 64 N elements (128 B,
//                                                swizzled), one row per k, 8-k groups 1024 B apart, 64-wide N
//                                                panels lbo bytes apart
//   keep_acc(r) / keep_regs(r)                   compiler barriers that pin registers in place
//   TmaDesc                                      a CUtensorMap (128 bytes, encoded on the host by
//                                                cuTensorMapEncodeTiled), passed as a __grid_constant__ parameter
//   mbar_init / mbar_expect_tx / mbar_wait       mbarrier init (arrival count), arrive with an expected byte
//                                                count, spin until the phase of the given parity completes
//   mbar_arrive / mbar_test                      a plain arrival (a consumer releasing a buffer); whether a
//                                                phase has completed, without waiting
//   tma_load_4d / _2d(dst, map, bar, c0, ...)    one TMA box from global into shared memory (coordinates
//                                                innermost first), completing `bar`'s transaction bytes
//   bulk_load(dst, src, bytes, bar)              a plain contiguous bulk copy (no tensor map), same completion
//   tma_load_2d_mc(dst, map, bar, c0, c1, mask)  the same box written to every CTA of the cluster in `mask` (at
//                                                the same shared offsets), completing each one's `bar`
//   cluster_rank / cluster_sync                  this CTA's rank in its cluster; barrier.cluster (all threads)
//   mbar_arrive_cta(bar, cta)                    an arrival on the mbarrier at `bar`'s offset in CTA `cta` of the
//                                                cluster
// 128-byte swizzle: 16-byte chunk c of row r (r counted from a 1024-byte-aligned base) lives at chunk c ^ (r % 8).
// wgmma must be issued by all 128 threads of a warpgroup; everything here is compiled only for sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL); the kernels that use it trap on other targets.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "mma.cuh"

namespace vbw {

using u64 = unsigned long long;

// The wrappers differ only in N (N/2 fp32 accumulators a thread), the operand type and the B transpose, so
// macros stamp them out: VBW_ACC_<N> lists the accumulator operands, VBW_REGS_<N> their "%i" names.
#define VBW_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define VBW_ACC32(i) VBW_ACC8(i), VBW_ACC8(i + 8), VBW_ACC8(i + 16), VBW_ACC8(i + 24)
#define VBW_ACC_64 VBW_ACC32(0)
#define VBW_ACC_80 VBW_ACC32(0), VBW_ACC8(32)
#define VBW_ACC_112 VBW_ACC32(0), VBW_ACC8(32), VBW_ACC8(40), VBW_ACC8(48)
#define VBW_ACC_128 VBW_ACC32(0), VBW_ACC32(32)
#define VBW_ACC_144 VBW_ACC32(0), VBW_ACC32(32), VBW_ACC8(64)
#define VBW_ACC_192 VBW_ACC32(0), VBW_ACC32(32), VBW_ACC32(64)
#define VBW_ACC_208 VBW_ACC32(0), VBW_ACC32(32), VBW_ACC32(64), VBW_ACC8(96)
#define VBW_ACC_256 VBW_ACC32(0), VBW_ACC32(32), VBW_ACC32(64), VBW_ACC32(96)
#define VBW_REGS_64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define VBW_REGS_80 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39"
#define VBW_REGS_112 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55"
#define VBW_REGS_128 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define VBW_REGS_144 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71"
#define VBW_REGS_192 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define VBW_REGS_208 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103"
#define VBW_REGS_256 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// Operands after the accumulators: %NACC (da), %NACC+1 (db), %NACC+2 (scale-d predicate source).
#define VBW_WGMMA_SS(T, TS, N, TB, NACC, IA, IB, IP)                                                      \
  template <> struct WgmmaSS<T, N, TB> {                                                                  \
    static __device__ __forceinline__ void run(float (&d)[NACC], u64 da, u64 db, int acc = 1) {           \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TS "." TS " {" VBW_REGS_##N          \
                   "}, %" #IA ", %" #IB ", p, 1, 1, 0, " #TB ";\n}\n"                                      \
                   : VBW_ACC_##N : "l"(da), "l"(db), "r"(acc));                                         \
    }                                                                                                     \
  };

// Operands after the accumulators: a0..a3 (%NACC..%NACC+3), desc (%NACC+4), scale-d source (%NACC+5).
#define VBW_WGMMA_RS(T, TS, N, TB, NACC, IA0, IA1, IA2, IA3, ID, IP)                                      \
  template <> struct WgmmaRS<T, N, TB> {                                                                  \
    static __device__ __forceinline__ void run(float (&d)[NACC], u32 a0, u32 a1, u32 a2, u32 a3,          \
                                               u64 desc) {                                                \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TS "." TS " {" VBW_REGS_##N          \
                   "}, {%" #IA0 ", %" #IA1 ", %" #IA2 ", %" #IA3 "}, %" #ID ", p, 1, 1, " #TB ";\n}\n"     \
                   : VBW_ACC_##N : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));              \
    }                                                                                                     \
  };

// FP8: m64nNk32, e4m3 x e4m3 -> fp32, both operands K-major from shared memory (8-bit wgmma has no transpose).
#define VBW_WGMMA_SS8(N, NACC, IA, IB, IP)                                                                \
  template <> struct WgmmaSS8<N> {                                                                        \
    static __device__ __forceinline__ void run(float (&d)[NACC], u64 da, u64 db, int acc = 1) {           \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" VBW_REGS_##N              \
                   "}, %" #IA ", %" #IB ", p, 1, 1;\n}\n"                                                  \
                   : VBW_ACC_##N : "l"(da), "l"(db), "r"(acc));                                         \
    }                                                                                                     \
  };

// Operands after the accumulators: a0..a3 (%NACC..%NACC+3), desc (%NACC+4), scale-d source (%NACC+5).
#define VBW_WGMMA_RS8(N, NACC, IA0, IA1, IA2, IA3, ID, IP)                                                \
  template <> struct WgmmaRS8<N> {                                                                        \
    static __device__ __forceinline__ void run(float (&d)[NACC], u32 a0, u32 a1, u32 a2, u32 a3,          \
                                               u64 desc) {                                                \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" VBW_REGS_##N              \
                   "}, {%" #IA0 ", %" #IA1 ", %" #IA2 ", %" #IA3 "}, %" #ID ", p, 1, 1;\n}\n"            \
                   : VBW_ACC_##N : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));              \
    }                                                                                                     \
  };

template <typename T, int N, int TB = 0> struct WgmmaSS;
template <typename T, int N, int TB = 0> struct WgmmaRS;
template <int N> struct WgmmaSS8;
template <int N> struct WgmmaRS8;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VBW_WGMMA_ALL(TB)                                                                                 \
  VBW_WGMMA_SS(__half, "f16", 64, TB, 32, 32, 33, 34)                                                     \
  VBW_WGMMA_SS(__nv_bfloat16, "bf16", 64, TB, 32, 32, 33, 34)                                             \
  VBW_WGMMA_SS(__half, "f16", 80, TB, 40, 40, 41, 42)                                                     \
  VBW_WGMMA_SS(__nv_bfloat16, "bf16", 80, TB, 40, 40, 41, 42)                                             \
  VBW_WGMMA_SS(__half, "f16", 112, TB, 56, 56, 57, 58)                                                    \
  VBW_WGMMA_SS(__nv_bfloat16, "bf16", 112, TB, 56, 56, 57, 58)                                            \
  VBW_WGMMA_SS(__half, "f16", 128, TB, 64, 64, 65, 66)                                                    \
  VBW_WGMMA_SS(__nv_bfloat16, "bf16", 128, TB, 64, 64, 65, 66)                                            \
  VBW_WGMMA_SS(__half, "f16", 144, TB, 72, 72, 73, 74)                                                    \
  VBW_WGMMA_SS(__nv_bfloat16, "bf16", 144, TB, 72, 72, 73, 74)                                            \
  VBW_WGMMA_SS(__half, "f16", 192, TB, 96, 96, 97, 98)                                                    \
  VBW_WGMMA_SS(__nv_bfloat16, "bf16", 192, TB, 96, 96, 97, 98)                                            \
  VBW_WGMMA_SS(__half, "f16", 208, TB, 104, 104, 105, 106)                                                \
  VBW_WGMMA_SS(__nv_bfloat16, "bf16", 208, TB, 104, 104, 105, 106)                                        \
  VBW_WGMMA_SS(__half, "f16", 256, TB, 128, 128, 129, 130)                                                \
  VBW_WGMMA_SS(__nv_bfloat16, "bf16", 256, TB, 128, 128, 129, 130)                                        \
  VBW_WGMMA_RS(__half, "f16", 64, TB, 32, 32, 33, 34, 35, 36, 37)                                         \
  VBW_WGMMA_RS(__nv_bfloat16, "bf16", 64, TB, 32, 32, 33, 34, 35, 36, 37)                                 \
  VBW_WGMMA_RS(__half, "f16", 128, TB, 64, 64, 65, 66, 67, 68, 69)                                        \
  VBW_WGMMA_RS(__nv_bfloat16, "bf16", 128, TB, 64, 64, 65, 66, 67, 68, 69)                                \
  VBW_WGMMA_RS(__half, "f16", 192, TB, 96, 96, 97, 98, 99, 100, 101)                                       \
  VBW_WGMMA_RS(__nv_bfloat16, "bf16", 192, TB, 96, 96, 97, 98, 99, 100, 101)                               \
  VBW_WGMMA_RS(__half, "f16", 256, TB, 128, 128, 129, 130, 131, 132, 133)                                 \
  VBW_WGMMA_RS(__nv_bfloat16, "bf16", 256, TB, 128, 128, 129, 130, 131, 132, 133)
VBW_WGMMA_ALL(0)
VBW_WGMMA_ALL(1)
#undef VBW_WGMMA_ALL
VBW_WGMMA_SS8(128, 64, 64, 65, 66)
VBW_WGMMA_SS8(192, 96, 96, 97, 98)
VBW_WGMMA_RS8(128, 64, 64, 65, 66, 67, 68, 69)
VBW_WGMMA_RS8(256, 128, 128, 129, 130, 131, 132, 133)
#endif

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N_> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N_) : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void named_bar(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(n) : "memory");
}
// Arrive at named barrier `id` (n threads in all) without waiting: the other side of a named_bar.
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(n) : "memory");
}
// bar.sync on named barrier `id` for n threads that also ORs `v` over them.
__device__ __forceinline__ bool named_bar_or(int id, int n, bool v) {
  u32 r;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 q, %1, 0;\nbar.red.or.pred p, %2, %3, q;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(r) : "r"((u32)v), "r"(id), "r"(n) : "memory");
  return r != 0u;
}

// Descriptor bits: start >> 4 (0-13), leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45),
// layout 1 = 128-byte swizzle (62-63).
__device__ __forceinline__ u64 desc_sw128_k(u32 saddr) {
  return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ u64 desc_sw128_mn(u32 saddr, u32 lbo) {
  return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)((lbo >> 4) & 0x3FFFu) << 16) | ((u64)(1024 >> 4) << 32) |
         ((u64)1 << 62);
}

struct __align__(64) TmaDesc {
  u64 w[16];
};

// FENCE = false: the caller initializes several and then calls mbar_init_fence() once.
template <bool FENCE = true>
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
  if constexpr (FENCE) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // -> the async proxy (TMA)
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_test(u32 bar, u32 parity) {  // has that phase completed? (no waiting)
  u32 done;
  asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0u;
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile("{\n.reg .pred p;\nVBW_MBAR_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               "@!p bra VBW_MBAR_WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
               :: "r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%3, %4}], [%2];\n"
               :: "r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load_2d_mc(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1,
                                               unsigned short mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%3, %4}], [%2], %5;\n"
               :: "r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask) : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_cta(u32 bar, u32 cta) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
  // default semantics (release, CTA scope): .release.cluster fenced every arrive and made fp8_gemm_mx 2x slower
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" :: "r"(remote) : "memory");
}
// Warp specialization (sm_90a): a warpgroup gives back registers (a producer) or takes them (consumers), so a
// CTA of 384 threads, compiled for 168 each, runs its consumers with up to 232.
template <int R> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(R));
}
template <int R> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(R));
}
// A contiguous copy of `bytes` (a multiple of 16; both addresses 16-byte aligned), completing `bar`'s bytes.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

template <int R> __device__ __forceinline__ void keep_acc(float (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
template <int R> __device__ __forceinline__ void keep_regs(u32 (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

}  // namespace vbw
