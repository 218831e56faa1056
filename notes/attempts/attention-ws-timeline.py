import sys, numpy as np, cupy as cp
import vbw_cupy as vc
from vbw_cupy import attention_fp8 as F, attention as A, _runtime as rt
CTA = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
S, B, H, D = 4096, 8, 16, 128
opts = (f"-DVBW_TIMELINE={CTA}",) + tuple(sys.argv[2:])
xs = [cp.random.standard_normal((B, S, H, D), dtype=cp.float32).astype(cp.float16) for _ in range(3)]
qs = [vc.quantize_e4m3(x) for x in xs]
codes = [c for c, _ in qs]; ds = cp.concatenate([d for _, d in qs])
NAMES = {0: "top", 1: "kv ready", 2: "turn got", 3: "issued+passed", 4: "S done", 5: "softmax done", 6: "PV done", 7: "end"}
def analyse(tag, name):
    k = rt.get_kernel(A.SOURCE, name, opts)
    g = k.kernel.module.get_global_var("vbw_tl")
    g = int(getattr(g, "ptr", g))
    mem = cp.cuda.UnownedMemory(g, 4096 * 8, k)
    buf = cp.ndarray((4096,), cp.uint64, memptr=cp.cuda.MemoryPointer(mem, 0))
    return buf
for causal in (False,):
    for tag in ("fp8", "fp16"):
        A._EXTRA_OPTIONS = opts; F._fast_plans.clear(); A._fast_plans.clear()
        if tag == "fp8":
            name = A.instance_name(np.uint8, 128, F._CONFIG, True, True, False, np.float16)
            fn = lambda: vc.flash_attention_fp8(*codes, ds, causal=causal)
        else:
            name = A.instance_name(np.float16, 128, A._ws(128), True, True, False)
            fn = lambda: vc.flash_attention(*xs, causal=causal)
        fn(); cp.cuda.Device().synchronize()
        buf = analyse(tag, name); buf[:] = 0
        fn(); cp.cuda.Device().synchronize()
        e = buf.get()
        print(f"===== {tag} causal={causal} CTA {CTA}")
        t0 = None
        recs = {}
        for role in range(3):
            r = e[role * 1024:(role + 1) * 1024]
            r = r[r != 0]
            ev = (r >> 56).astype(int); it = ((r >> 40) & 0xffff).astype(int); c = (r & 0xffffffffff).astype(np.int64)
            recs[role] = (ev, it, c)
            if len(c): t0 = c.min() if t0 is None else min(t0, c.min())
        for role in (0, 1):
            ev, it, c = recs[role]
            c = c - t0
            d = {}
            for a, b in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 0)]:
                xs_ = []
                for i in sorted(set(it[ev == a])):
                    ca = c[(ev == a) & (it == i)]
                    nb = i + 1 if b == 0 else i
                    cb = c[(ev == b) & (it == nb)]
                    if len(ca) and len(cb): xs_.append(int(cb[0] - ca[0]))
                d[f"{NAMES[a]}->{NAMES[b]}"] = (int(np.median(xs_)) if xs_ else -1)
            tops = np.sort(c[ev == 0]); per = int(np.median(np.diff(tops))) if len(tops) > 2 else -1
            print(f"WG{role}: iters {len(tops)} period {per} start {c[ev == 15].min() if (ev == 15).any() else -1} end {c[ev == 7].max() if (ev == 7).any() else -1} | " +
                  " ".join(f"{k} {v}" for k, v in d.items()))
        ev, it, c = recs[2]
        c = c - t0
        k_t = c[ev == 8]; v_t = c[ev == 9]
        print(f"producer: K issues {list(k_t[:6])} ... V issues {list(v_t[:6])} ...")
        # the two WGs' GEMM issue times interleaved
        g0 = np.sort(recs[0][2][recs[0][0] == 2] - t0); g1 = np.sort(recs[1][2][recs[1][0] == 2] - t0)
        print("turn got WG0:", list(g0[:8]), " WG1:", list(g1[:8]))
        s0 = np.sort(recs[0][2][recs[0][0] == 4] - t0); print("S done WG0:", list(s0[:8]))
        p0 = np.sort(recs[0][2][recs[0][0] == 6] - t0); print("PV done WG0:", list(p0[:8]))
A._EXTRA_OPTIONS = ()
