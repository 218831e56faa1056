// mma.cuh: small, stable tensor-core helpers shared by the vbw_cupy kernels (sm_80+).
//
//   smem_addr(p)                      generic -> .shared address (u32) for ldmatrix / cp.async
//   ldsm_x4 / ldsm_x4_t / ldsm_x2 / ldsm_x2_t
//                                     ldmatrix.m8n8 (.trans) of 4 / 2 8x8 b16 matrices; lane l supplies the
//                                     row address of matrix l/8 (x4) or (l%16)/8 (x2), row l%8
//   mma_16816<T>(d, a, b)             d += a * b, mma.sync.m16n8k16.row.col, fp32 accumulators,
//                                     T = __half or __nv_bfloat16
//   pack2<T>(x, y)                    two floats -> one 32-bit register of T (x in the low half), RN
//   cp_async_16(dst, src, pred)       16-byte cp.async.cg; pred == false zero-fills dst and reads nothing
//   cp_async_commit / cp_async_wait<N>
//   fast_exp2(x)                      ex2.approx.ftz.f32 (2^-inf = 0)
//
// Fragment layouts of m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16 row-major: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8 (stored as B^T, n-major): b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g)
//   C 16x8 fp32: c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
// so two adjacent C tiles (n-tiles 2j, 2j+1) packed pairwise are exactly an A fragment over k = 16j..16j+15.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC has no <stdint.h>: a local alias keeps the helpers self-contained.
namespace vbw { using u32 = unsigned int; }

namespace vbw {

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x2(u32& r0, u32& r1, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x2_t(u32& r0, u32& r1, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

template <typename T> struct MmaOp;

template <> struct MmaOp<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct MmaOp<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  MmaOp<T>::run(d, a, b0, b1);
}

template <typename T> __device__ __forceinline__ u32 pack2(float x, float y);

template <> __device__ __forceinline__ u32 pack2<__half>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<u32*>(&h);
}

template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<u32*>(&h);
}

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(n) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace vbw
