"""block_sparse_attention: time against dense vbw_cupy.flash_attention on the same problem and torch SDPA with the
equivalent boolean mask (its EFFICIENT backend, the one that takes masks), issue 20's bars.

    python bench/bench_sparse.py                 S = 16384, D = 128, fp16, B = 2, H = 16, 128 x 128 blocks,
                                                 densities 10% and 100% (random patterns, not causal; every
                                                 query block keeps round(density * blocks) key blocks)
    python bench/bench_sparse.py --S 4096 --density 0.05 0.1 0.5 1.0 --block-q 64 --block-k 64
    python -m pytest bench/bench_sparse.py --benchmark-only      the same rows as pytest-benchmark cases

Bars (issue 20, one H100): density 10% <= 0.13x the dense flash_attention time, 100% <= 1.05x; >= 5x faster than
SDPA EFFICIENT with the mask at 10%.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vbw_cupy import _runtime as rt  # noqa: E402
from vbw_cupy import _timing  # noqa: E402

try:
    import pytest
except ImportError:  # the standalone mode needs no pytest
    pytest = None


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def _exact_mask(rng, nq, nk, density):
    """A block mask of the given density exactly: every query block keeps round(density * nk) key blocks, its
    diagonal block and the rest drawn at random (so "10%" is 10% of the blocks, and rows are balanced)."""
    keep = max(1, min(nk, round(density * nk)))
    m = np.zeros((nq, nk), bool)
    for i in range(nq):
        diag = min(i * nk // nq, nk - 1)
        others = np.delete(np.arange(nk), diag)
        m[i, diag] = True
        m[i, rng.choice(others, keep - 1, replace=False)] = True
    return m


class Case:
    def __init__(self, S=16384, D=128, B=2, H=16, density=0.1, block_q=128, block_k=128, seed=0):
        import cupy as cp
        from vbw_cupy import sparse
        self.cp, self.S, self.D, self.B, self.H, self.density = cp, S, D, B, H, density
        self.block_q, self.block_k = block_q, block_k
        rng = cp.random.default_rng(seed)
        self.q, self.k, self.v = (rng.standard_normal((B, S, H, D), dtype=cp.float32).astype(cp.float16)
                                  for _ in range(3))
        nq, nk = -(-S // block_q), -(-S // block_k)
        self.mask = _exact_mask(np.random.default_rng(seed), nq, nk, density)
        self.indptr, self.indices = (cp.asarray(a) for a in sparse.bsr_from_mask(self.mask))
        self.kept = float(self.mask.mean())

    def ours(self):
        from vbw_cupy import block_sparse_attention
        return block_sparse_attention(self.q, self.k, self.v, self.indptr, self.indices, block_q=self.block_q,
                                      block_k=self.block_k)

    def dense(self):
        from vbw_cupy import flash_attention
        return flash_attention(self.q, self.k, self.v)

    def sdpa(self):
        """A callable running torch SDPA (EFFICIENT backend) with the boolean key mask, or None without torch."""
        torch = _torch()
        if torch is None:
            return None
        from torch.nn.attention import SDPBackend, sdpa_kernel
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (self.q, self.k, self.v))  # [B, H, S, D]
        full = np.repeat(np.repeat(self.mask, self.block_q, 0), self.block_k, 1)[:self.S, :self.S]
        tmask = torch.from_numpy(full).cuda()[None, None]
        F = torch.nn.functional

        def run():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask)
        return run


def time_case(c: Case, rep=10, rounds=3) -> dict:
    """Ours and dense interleaved for `rounds` rounds (clock drift hits both), each side's fastest median kept."""
    ms = dense_ms = float("inf")
    for _ in range(rounds):
        ms = min(ms, _timing.time_ms(c.ours, warmup=3, rep=rep))
        dense_ms = min(dense_ms, _timing.time_ms(c.dense, warmup=3, rep=rep))
    row = {"S": c.S, "D": c.D, "B": c.B, "H": c.H, "blocks": f"{c.block_q}x{c.block_k}", "kept": c.kept,
           "ours_ms": ms, "dense_ms": dense_ms, "ours/dense": ms / dense_ms,
           "tflops": 4.0 * c.B * c.H * c.S * c.S * c.D * c.kept / ms / 1e9}
    run = c.sdpa()
    if run is not None:
        try:
            row["sdpa_ms"] = _timing.time_ms(run, warmup=2, rep=max(3, rep // 2))
            row["sdpa/ours"] = row["sdpa_ms"] / ms
        except Exception as e:  # e.g. out of memory for the dense mask
            row["sdpa_ms"] = f"error: {type(e).__name__}"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--density", type=float, nargs="+", default=[0.1, 1.0])
    ap.add_argument("--block-q", type=int, default=128)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--stages", type=int, nargs="*", default=[],
                    help="A/B: also time the sm_90 wgmma tile of these STAGES counts (D = 128, 128 x 128 blocks)")
    ap.add_argument("--ws", type=int, nargs="*", default=[],
                    help="A/B: also time the warp-specialized wgmma tile with these STAGES counts (D = 128, 128 x "
                         "128 blocks)")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, interleaved")
    a = ap.parse_args(argv)
    if not rt.gpu_available():
        print("bench_sparse: no CUDA device")
        return 1
    from vbw_cupy import attention, sparse
    variants = [("default", None)] + [(f"{st} stages", attention._wg(128, stages=st)) for st in a.stages]
    variants += [(f"ws {st} stages", attention._ws(128, stages=st)) for st in a.ws]
    default = sparse._WG_TILES
    for d, _, (label, tile) in itertools.product(a.density, range(a.rounds), variants):
        if tile is not None:
            sparse._WG_TILES = {**default, 128: (tile,)}
        row = time_case(Case(a.S, a.D, a.B, a.H, d, a.block_q, a.block_k), rep=a.rep)
        sparse._WG_TILES = default
        row = {"tile": label, **row}
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
    return 0


if pytest is not None:
    @pytest.mark.gpu
    @pytest.mark.parametrize("density", [0.1, 1.0])
    def test_bench_sparse(benchmark, density):
        c = Case(density=density)
        c.ours()
        stream = c.cp.cuda.get_current_stream()
        benchmark(lambda: (c.ours(), stream.synchronize()))
        benchmark.extra_info.update({k: v for k, v in time_case(c).items() if not isinstance(v, str)})


if __name__ == "__main__":
    sys.exit(main())
