// lse_merge.cu: fold one block's attention result into a running one by log-sum-exp (ring attention,
// vbw_cupy/dist/ring.py).
//
// What: for each row (b, r, h) of the block: lse' = log(exp(lse) + exp(lse_b)),
// out <- exp(lse - lse') out + exp(lse_b - lse') o_b, lse <- lse'. A row whose lse' is -inf (no key seen yet)
// stays 0 / -inf; a side whose weight is 0 is not read (the first block a row sees overwrites out).
//
// Layout (all contiguous): out float32 [B, L, H, D] and lse float32 [B, H, L], of which rows row0 .. row0+n-1
// are merged; o_b T [B, n, H, D] (float16 / bfloat16) and lse_b float32 [B, H, n] as flash_attention returns
// them.
//
// Tiling: one warp per (b, r, h) row, lanes striding D (a warp reads 128 contiguous bytes of out); 8 warps a
// CTA, a grid-stride loop. Memory-bound: it reads out and o_b and writes out once, where the six CuPy
// elementwise passes it replaces read and wrote the float32 accumulator about four times each.
//
// History: v1 (this) replaces ring.py's CuPy merge; ring attention, causal S = 256k over 2 H100s: see
// notes/multi-gpu.md.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "fp4.cuh"

namespace vbw_ring {

using vbw::to_float;

template <typename T>
__global__ void __launch_bounds__(256) lse_merge(float* __restrict__ out, float* __restrict__ lse,
                                                 const T* __restrict__ ob, const float* __restrict__ lseb, int B,
                                                 int L, int row0, int n, int H, int D) {
    const long long rows = (long long)B * n * H;
    const int lane = threadIdx.x & 31;
    for (long long w = (long long)blockIdx.x * 8 + (threadIdx.x >> 5); w < rows; w += (long long)gridDim.x * 8) {
        const int h = (int)(w % H);
        const long long bt = w / H;
        const int r = (int)(bt % n), b = (int)(bt / n);
        float* lp = lse + ((long long)b * H + h) * L + row0 + r;
        const float la = *lp, lb = lseb[((long long)b * H + h) * n + r];
        const float m = fmaxf(la, lb);
        float wa = 0.f, wb = 0.f, ln = __int_as_float(0xff800000);   // -inf
        if (m != __int_as_float(0xff800000)) {
            wa = expf(la - m);
            wb = expf(lb - m);
            const float s = wa + wb;
            ln = m + logf(s);
            wa /= s;
            wb /= s;
        }
        float* op = out + (((long long)b * L + row0 + r) * H + h) * D;
        const T* bp = ob + (((long long)b * n + r) * H + h) * D;
        for (int d = lane; d < D; d += 32) {   // a weight of 0 reads nothing: no 0 * NaN from an unseen row
            float v = 0.f;
            if (wa != 0.f) v = wa * op[d];
            if (wb != 0.f) v += wb * to_float(bp[d]);
            op[d] = v;
        }
        if (lane == 0) *lp = ln;
    }
}

}  // namespace vbw_ring
