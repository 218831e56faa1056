// pdl.cuh: programmatic dependent launch (Hopper, sm_90+).
//
// A kernel launched with the programmatic-stream-serialization attribute (vbw_cupy/_runtime.py,
// `programmatic_launches`, used when the model captures its decode step) may start while the kernel before it
// in the stream is still running. Such a kernel must call pdl_wait() before it reads anything an earlier
// kernel writes and before it writes anything (an earlier kernel may still read the memory it reuses); before
// the wait it may only read what no kernel of the stream writes (weights). pdl_wait returns once the previous
// grid has finished and its writes are visible. pdl_launch_dependents() lets the next kernel in the stream be
// launched as soon as every block of this one has called it (its blocks then wait in their own pdl_wait).
// Launched without the attribute, or below sm_90, both are no-ops. Kernels that call them are listed in
// _runtime.PDL_KERNELS; only those are ever launched with the attribute.
#pragma once

namespace vbw {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The start of a kernel that reads its inputs right away: wait for the previous kernel, then let the next one
// launch. (The other order, letting the next kernel launch before waiting, ran the 7B decode step 17% slower:
// a chain of waiting kernels then holds SM slots ahead of the one that runs.)
__device__ __forceinline__ void pdl_start() {
  pdl_wait();
  pdl_launch_dependents();
}

}  // namespace vbw
