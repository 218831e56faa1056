"""Per-CTA timeline of the warp-specialized attention kernel (attn_fwd_wg): where a short CTA's clocks go.

Copies cuda_src/ to a temporary directory, adds clock64 stamps to attn_fwd_wg there (entry, thread 0's first
loads issued, the producer's start, Q and the first K tile landed, the loop's end, the epilogue's end of each of
the first two warpgroups; the SM id), compiles it with -DVBW_GTL, runs the public flash_attention once per shape
and prints the medians and [p10, p90] of each phase and of the gap between consecutive CTAs on an SM (a
persistent default, "wsp", is timed in its non-persistent form "ws" here). With --persistent, the persistent tile
instead, stamped per work tile (-DVBW_GTW): each warpgroup's wait for Q and K(0), loop and epilogue, and how long
the producer waits for Q's buffer. The stamp anchors follow the kernel as of 2026-11-27 (v14: Q is double-
buffered, so "waits for Q's buffer" is the wait for the Q of the tile two back, and "epilogue" is normalize and
stage, the storer warps sending O; with -DVBW_WSP_QDB=0 no Q stamps are recorded); a failed assert names the
anchor that moved.

    PYTHONPATH=. python notes/attempts/attention-cta-timeline.py [--persistent]     (on a GPU machine, sm_90)
"""
import os
import pathlib
import shutil
import sys
import tempfile

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
import numpy as np  # noqa: E402
import cupy as cp  # noqa: E402
from vbw_cupy import _runtime as rt  # noqa: E402

tmp = pathlib.Path(tempfile.mkdtemp()) / "cuda_src"
shutil.copytree(rt.SOURCE_DIR, tmp)
p = tmp / "attention_fwd.cu"
s = p.read_text()


def rep(old, new):
    global s
    assert s.count(old) == 1, old
    s = s.replace(old, new)


rep('''static_assert(128 * VBW_WS_PRODUCER_REGS''','''#if defined(VBW_GTL) || defined(VBW_GTW)
extern "C" __device__ unsigned long long vbw_gt[16 * 65536];
#endif
#ifdef VBW_GTL
#define GTL(i) do { if (blockIdx.x < 65536) vbw_gt[16 * blockIdx.x + (i)] = clock64(); } while (0)
#else
#define GTL(i) do {} while (0)
#endif
#ifdef VBW_GTW
#define GTW(w, i) do { if ((w) >= 0 && (w) < 65536) vbw_gt[16 * (w) + (i)] = clock64(); } while (0)
#else
#define GTW(w, i) do {} while (0)
#endif
static_assert(128 * VBW_WS_PRODUCER_REGS''')
rep('''  const vbw_attn::Cta cta = EDGE ? VBW_CTA_LEAN_AT(work) : VBW_CTA_AT(work);
''','''#ifdef VBW_GTL
  if (tid == 0) {
    GTL(0);
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    vbw_gt[16 * blockIdx.x + 7] = sm;
  }
#endif
  const vbw_attn::Cta cta = EDGE ? VBW_CTA_LEAN_AT(work) : VBW_CTA_AT(work);
''')
rep('''  if (CTA_SH && tid == 0) cta_sh = cta;''','''  if (CTA_SH && tid == 0) cta_sh = cta;
  if (tid == 0) GTL(8);''')
rep('''            load_v(0, 0);
          }
        }''','''            load_v(0, 0);
          }
          GTL(11);
        }''')
rep('''        if (tid == NT) {
          for (int i = EARLY_KV''','''        if (tid == NT) {
          GTL(1);
          for (int i = EARLY_KV''')
rep('''      mbar_wait(q_full(nq), q_phase(nq));  // Q
      wait_k(0);
''','''      mbar_wait(q_full(nq), q_phase(nq));  // Q
      wait_k(0);
      if (tid == 0) GTL(2);
''')
rep('''      if (PERSIST || wg != WGS - 1) turn_pass();  // (without PERSIST the last warpgroup's last turn has no taker)
      wg_wait<0>();''','''      if (PERSIST || wg != WGS - 1) turn_pass();  // (without PERSIST the last warpgroup's last turn has no taker)
      wg_wait<0>();
      if (tid == 0) GTL(3);''')
rep('''  const vbw_attn::Cta ce = CTA_SH ? cta_sh : PERSIST ? VBW_CTA_AT(work) : VBW_CTA_LEAN_AT(work);''','''  const vbw_attn::Cta ce = CTA_SH ? cta_sh : PERSIST ? VBW_CTA_AT(work) : VBW_CTA_LEAN_AT(work);
  if (tid == 0) GTL(15);''')
rep('''  named_bar(1 + wg, 128);
  {
    constexpr int CPR = HEAD_DIM / 8;''','''  if (tid == 0) GTL(13);
  named_bar(1 + wg, 128);
  if (tid == 0) GTL(14);
  {
    constexpr int CPR = HEAD_DIM / 8;''')
i = s.index('#else\n  __trap();  // sm_90a only: the launcher never picks this kernel elsewhere', s.index('named_bar(1 + wg, 128);'))
s = s[:i] + '  if (tid == 0) GTL(4);\n  if (tid == 128) GTL(5);\n' + s[i:]

# the persistent tile ("wsp"): stamps per work tile (index w), by each consumer warpgroup's first thread and the
# producer: [0] / [5] body start (wg 0 / 1), [1] / [6] Q and K(0) landed, [2] / [10] loop end, [3] / [4] epilogue
# end, [9] the producer starts the tile, [11] it waits for Q's buffer, [8] Q issued
rep('''  const vbw_attn::Cta cta = EDGE ? VBW_CTA_LEAN_AT(work) : VBW_CTA_AT(work);
''', '''  const vbw_attn::Cta cta = EDGE ? VBW_CTA_LEAN_AT(work) : VBW_CTA_AT(work);
  if (PERSIST && (tid & 127) == 0) GTW(work, wg ? 5 : 0);
''')
rep('''      if (tid == 0) GTL(2);
''', '''      if (tid == 0) GTL(2);
      if (PERSIST && (tid & 127) == 0) GTW(work, wg ? 6 : 1);
''')
rep('''      if constexpr (PERSIST) release(vempty(cnt - 1));  // the ring runs on into the next tile''',
    '''      if constexpr (PERSIST) release(vempty(cnt - 1));  // the ring runs on into the next tile
      if (PERSIST && (tid & 127) == 0) GTW(work, wg ? 10 : 2);''')
rep('''  };  // body''', '''  if (PERSIST && (tid & 127) == 0) GTW(work, wg ? 4 : 3);
  };  // body''')
rep('''    mbar_arrive(o_staged + 8 * wg);
    return;''', '''    mbar_arrive(o_staged + 8 * wg);
    if ((tid & 127) == 0) GTW(work, wg ? 4 : 3);
    return;''')
rep('''        tma_rows(q_buf(nq), &tm_q, q_full(nq), BLOCK_M, c.h, c.m0, c.b);''', '''        GTW(work, 11);
        tma_rows(q_buf(nq), &tm_q, q_full(nq), BLOCK_M, c.h, c.m0, c.b);
        GTW(work, 8);''')
rep('''      if (cnt <= 0) return;  // (its consumers write zero rows; no loads, no Q)''',
    '''      if (cnt <= 0) return;  // (its consumers write zero rows; no loads, no Q)
      GTW(work, 9);''')

p.write_text(s)
rt.SOURCE_DIR = tmp
import bench_attention as BA  # noqa: E402
from vbw_cupy import attention as A  # noqa: E402
PERSISTENT = "--persistent" in sys.argv
opts = ("-DVBW_GTW",) if PERSISTENT else ("-DVBW_GTL",)
A._EXTRA_OPTIONS = opts
clk_ghz = cp.cuda.Device().attributes["ClockRate"] / 1e6
print("clock GHz (max)", clk_ghz)


def stamps(case, cfg, D):
    """Run cfg once with the stamp buffer zeroed: (the rows of the stamped CTAs / work tiles, the call)."""
    f = case.ours(cfg)
    f()
    cp.cuda.Device().synchronize()
    name = A.instance_name(np.float16, D, cfg, True, True, False)
    k = rt.get_kernel(A.SOURCE, name, opts)
    g = k.kernel.module.get_global_var("vbw_gt")
    ptr = int(getattr(g, "ptr", g))
    mem = cp.cuda.UnownedMemory(ptr, 16 * 65536 * 8, k)
    buf = cp.ndarray((65536, 16), cp.uint64, memptr=cp.cuda.MemoryPointer(mem, 0))
    for _ in range(3):
        f()
    buf[:] = 0
    f()
    cp.cuda.Device().synchronize()
    e = buf.get().astype(np.int64)
    return e[:int((e[:, 0] != 0).sum())], f


def c(x):
    return f"{np.median(x):7.0f} [{np.percentile(x, 10):6.0f},{np.percentile(x, 90):6.0f}]"


if PERSISTENT:
    for S, causal in [(512, False), (2048, False), (2048, True)]:
        case = BA.Case(128, S, causal, "float16")
        e, _ = stamps(case, A._wsp(128), 128)
        print(f"wsp D=128 S={S} causal={causal}: work tiles {len(e)}")
        print("  wg0: start -> Q, K0 landed", c(e[:, 1] - e[:, 0]), " loop", c(e[:, 2] - e[:, 1]), " epilogue",
              c(e[:, 3] - e[:, 2]))
        print("  wg1: start -> landed", c(e[:, 6] - e[:, 5]), " loop", c(e[:, 10] - e[:, 6]), " epilogue",
              c(e[:, 4] - e[:, 10]), " wg1 loop end - wg0 loop end", c(e[:, 10] - e[:, 2]))
        print("  producer: waits for Q's buffer", c(e[:, 8] - e[:, 11]))
        del case
    sys.exit(0)
for D, S, causal in [(128, 512, False), (128, 512, True), (128, 2048, False), (256, 512, False)]:
    case = BA.Case(D, S, causal, "float16")
    cfg = A.default_config(D, 90, shape={"Sk": S})
    if cfg["KIND"] == "wsp":  # (a CTA per work tile: its non-persistent form)
        cfg = A._ws(cfg["BLOCK_N"])
    e, f = stamps(case, cfg, D)
    n = len(e)
    sm = e[:, 7]
    entry, pstart, ready, loopd, end0, end1 = (e[:, i] for i in range(6))
    end = np.maximum(end0, end1)
    ms = BA.cuda_ms(f)
    print(f"D={D} S={S} causal={causal} cfg ws{cfg['BLOCK_N']}x{cfg['BLOCK_M'] // 64}: CTAs {n}, "
          f"{case.tflops(ms):.0f} TFLOP/s single call")
    print("  clocks median [p10,p90]: entry->producer", c(pstart - entry), " entry->Q,K0 ready", c(ready - entry),
          " loop", c(loopd - ready), " loop end->epilogue end(wg0)", c(end0 - loopd),
          " wg1 end - wg0 end", c(end1 - end0), " CTA total", c(end - entry))
    print("  prologue: cta_info", c(e[:, 8] - entry), " thread 0 issued", c(e[:, 11] - entry),
          " producer start", c(pstart - entry))
    print("  epilogue: CTA read back", c(e[:, 15] - loopd), " normalize+stage", c(e[:, 13] - e[:, 15]),
          " named_bar", c(e[:, 14] - e[:, 13]), " stores issue", c(end0 - e[:, 14]))
    gaps, busy, span = [], 0, 0
    for s_ in np.unique(sm):
        idx = np.where(sm == s_)[0]
        o = idx[np.argsort(entry[idx])]
        gaps += list(entry[o[1:]] - end[o[:-1]])
        busy += int((end[o] - entry[o]).sum())
        span += int(end[o].max() - entry[o].min())
    gaps = np.array(gaps)
    print(f"  between CTAs on an SM: gap {c(gaps)} clocks; busy fraction {busy / span:.3f}; "
          f"CTAs per SM {n / len(np.unique(sm)):.1f}")
    del case
