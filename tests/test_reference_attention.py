"""The float64 attention reference (vbw_cupy.reference, attention section) against a naive per-element
loop, against invariants, at 8k tokens; and the argument checks (vbw_cupy._checks) on bad input to the public
functions' NumPy path. CPU only."""
import math
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import vbw_cupy
from vbw_cupy import _checks
from vbw_cupy import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32)]


def rnd(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def f64(x):
    return np.asarray(x).astype(np.float64)


def naive_attention(q, k, v, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0):
    """SPEC section 3 written out one (batch, head, query, key) at a time in float64.
    Returns o float64 [B, Sq, Hq, D] and lse float64 [B, Hq, Sq]."""
    q, k, v = f64(q), f64(k), f64(v)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    left, right = window
    if causal:
        right = 0
    o = np.zeros((B, Sq, Hq, D))
    lse = np.full((B, Hq, Sq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(Sq):
                diag = i + Sk - Sq
                keys, scores = [], []
                for j in range(Sk):
                    if left >= 0 and j < diag - left:
                        continue
                    if right >= 0 and j > diag + right:
                        continue
                    s = scale * float(np.dot(q[b, i, h], k[b, j, kh]))
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    keys.append(j)
                    scores.append(s)
                if not keys:
                    continue
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                l = math.fsum(w)
                for d in range(D):
                    o[b, i, h, d] = math.fsum(wj * v[b, j, kh, d] for wj, j in zip(w, keys)) / l
                lse[b, h, i] = m + math.log(l)
    return o, lse


def rel_err(x, y):
    x, y = f64(x), f64(y)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300))


def bf16_round_exact(x):
    """Round-to-nearest-even of float64 to bfloat16 by integer arithmetic on the float64 bits (normal range)."""
    bits = np.asarray(x, dtype=np.float64).view(np.uint64)
    shift = np.uint64(52 - 7)
    low = bits & np.uint64((1 << 45) - 1)
    half = np.uint64(1 << 44)
    top = bits >> shift
    up = (low > half) | ((low == half) & ((top & np.uint64(1)) == 1))
    return ((top + up.astype(np.uint64)) << shift).view(np.float64)


# (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap, softmax_scale)
CASES = [
    (2, 7, 7, 4, 4, 8, False, (-1, -1), 0.0, None),
    (1, 5, 11, 4, 2, 16, True, (-1, -1), 0.0, None),        # causal, Sq < Sk
    (2, 11, 5, 4, 1, 8, True, (-1, -1), 0.0, None),         # causal, Sq > Sk: first 6 rows see nothing
    (1, 9, 9, 2, 2, 3, False, (2, 1), 0.0, None),           # two-sided window
    (1, 6, 13, 6, 3, 5, False, (3, 0), 0.0, None),          # left window, right 0 without causal
    (1, 13, 6, 2, 1, 4, False, (0, 2), 0.0, None),          # Sq > Sk window: rows with no key
    (1, 8, 12, 4, 2, 8, True, (4, -1), 0.0, None),          # causal + left window
    (1, 10, 10, 2, 1, 8, True, (2, 5), 0.0, None),          # causal overrides right = 5
    (2, 6, 9, 4, 2, 8, True, (-1, -1), 5.0, None),          # softcap, GQA, causal
    (1, 7, 7, 3, 1, 6, False, (1, 1), 2.0, 0.7),            # softcap + window + explicit scale (MQA)
    (1, 1, 1, 1, 1, 1, False, (-1, -1), 0.0, None),         # smallest
    (1, 3, 5, 2, 2, 256, True, (-1, -1), 0.0, None),        # largest D
    (1, 9, 9, 2, 2, 8, False, (0, 0), 0.0, None),           # only the diagonal
    (1, 6, 8, 2, 1, 4, False, (-1, -1), 0.0, 40.0),         # large logits: softmax must stay stable
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_Sq{}_Sk{}_H{}-{}_D{}_c{}_w{}_{}_cap{}_sc{}".format(
    *c[:7], *c[7], c[8], c[9]))
def test_matches_naive_loop(case, dtype):
    B, Sq, Sk, Hq, Hkv, D, causal, window, softcap, scale = case
    rng = np.random.default_rng(hash(case) % 2**32)
    q, k, v = rnd(rng, (B, Sq, Hq, D), dtype), rnd(rng, (B, Sk, Hkv, D), dtype), rnd(rng, (B, Sk, Hkv, D), dtype)
    o, lse = ref.flash_attention(q, k, v, causal=causal, softmax_scale=scale, window=window, softcap=softcap,
                                 return_lse=True)
    o_n, lse_n = naive_attention(q, k, v, causal, scale, window, softcap)
    assert o.dtype == dtype and o.shape == (B, Sq, Hq, D)
    assert lse.dtype == np.float32 and lse.shape == (B, Hq, Sq)
    assert not np.isnan(f64(o)).any() and not np.isnan(lse).any()
    # float64 math rounded once: equal to the naive float64 result rounded to the dtype
    if dtype == np.float32:
        np.testing.assert_allclose(f64(o), o_n, rtol=1e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(f64(o), f64(ref._round_from_f64(o_n, dtype)))
    empty = np.isneginf(lse_n)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], lse_n[~empty], rtol=1e-6, atol=1e-6)
    assert (f64(o).transpose(0, 2, 1, 3)[empty] == 0).all()


def test_cases_cover_rows_without_keys():
    # guard for the grid above: some cases must have rows that see no key
    for c in (CASES[2], CASES[5]):
        B, Sq, Sk, Hq, Hkv, D, causal, window, softcap, scale = c
        rng = np.random.default_rng(0)
        _, lse = ref.flash_attention(rnd(rng, (B, Sq, Hq, D)), rnd(rng, (B, Sk, Hkv, D)), rnd(rng, (B, Sk, Hkv, D)),
                                     causal=causal, window=window, return_lse=True)
        assert np.isneginf(lse).any() and np.isfinite(lse).any()


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2)), (True, (2, -1)),
                                           (False, (0, 1))])
@pytest.mark.parametrize("Sq,Sk", [(9, 9), (5, 17), (17, 5)])
def test_rows_sum_to_one(causal, window, Sq, Sk):
    rng = np.random.default_rng(1)
    q, k = rnd(rng, (2, Sq, 4, 16), np.float16), rnd(rng, (2, Sk, 2, 16), np.float16)
    v = np.ones((2, Sk, 2, 16), np.float16)
    o, lse = ref.flash_attention(q, k, v, causal=causal, window=window, softcap=3.0, return_lse=True)
    seen = np.isfinite(lse).transpose(0, 2, 1)                    # [B, Sq, Hq]
    assert (f64(o)[seen] == 1.0).all()
    assert (f64(o)[~seen] == 0.0).all()


def test_key_permutation_leaves_output_unchanged():
    rng = np.random.default_rng(2)
    q, k, v = rnd(rng, (2, 13, 4, 24)), rnd(rng, (2, 29, 2, 24)), rnd(rng, (2, 29, 2, 24))
    perm = rng.permutation(29)
    for softcap in (0.0, 1.5):
        o, lse = ref.flash_attention(q, k, v, softcap=softcap, return_lse=True)
        o2, lse2 = ref.flash_attention(q, k[:, perm], v[:, perm], softcap=softcap, return_lse=True)
        np.testing.assert_allclose(o2, o, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(lse2, lse, rtol=1e-6)


@pytest.mark.parametrize("Hq,Hkv", [(8, 1), (8, 2), (6, 3)])
def test_gqa_equals_repeated_kv_heads(Hq, Hkv):
    rng = np.random.default_rng(3)
    q, k, v = rnd(rng, (2, 11, Hq, 8)), rnd(rng, (2, 14, Hkv, 8)), rnd(rng, (2, 14, Hkv, 8))
    for kw in (dict(), dict(causal=True), dict(window=(3, 1), softcap=2.0)):
        o, lse = ref.flash_attention(q, k, v, return_lse=True, **kw)
        g = Hq // Hkv
        o2, lse2 = ref.flash_attention(q, np.repeat(k, g, axis=2), np.repeat(v, g, axis=2), return_lse=True, **kw)
        np.testing.assert_allclose(o, o2, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(lse, lse2, rtol=1e-6)


def test_batches_are_independent_and_inputs_untouched():
    rng = np.random.default_rng(4)
    q, k, v = rnd(rng, (3, 6, 2, 8), BF16), rnd(rng, (3, 9, 2, 8), BF16), rnd(rng, (3, 9, 2, 8), BF16)
    saved = [x.copy() for x in (q, k, v)]
    o = ref.flash_attention(q, k, v, causal=True)
    for x, s in zip((q, k, v), saved):
        np.testing.assert_array_equal(f64(x), f64(s))
    for b in range(3):
        np.testing.assert_array_equal(f64(o[b:b + 1]), f64(ref.flash_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                                                causal=True)))


def test_non_contiguous_inputs():
    rng = np.random.default_rng(5)
    qt = rnd(rng, (2, 4, 7, 8), np.float16)             # [B, Hq, Sq, D] then viewed as [B, Sq, Hq, D]
    kt = rnd(rng, (2, 2, 10, 8), np.float16)
    vt = rnd(rng, (2, 2, 10, 8), np.float16)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (qt, kt, vt))
    assert not q.flags.c_contiguous
    o = ref.flash_attention(q, k, v, causal=True)
    o2 = ref.flash_attention(*(np.ascontiguousarray(x) for x in (q, k, v)), causal=True)
    np.testing.assert_array_equal(f64(o), f64(o2))


def test_lse_is_log_of_softmax_denominator():
    rng = np.random.default_rng(6)
    q, k, v = rnd(rng, (1, 5, 2, 8)), rnd(rng, (1, 7, 2, 8)), rnd(rng, (1, 7, 2, 8))
    _, lse = ref.flash_attention(q, k, v, softmax_scale=0.5, return_lse=True)
    s = 0.5 * np.einsum("bihd,bjhd->bhij", f64(q), f64(k))
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-6)
    # the output is sum_j exp(s_ij - lse_i) v_j
    o = ref.flash_attention(q, k, v, softmax_scale=0.5)
    o2 = np.einsum("bhij,bjhd->bihd", np.exp(s - f64(lse)[..., None]), f64(v))
    np.testing.assert_allclose(o, o2, rtol=1e-5, atol=1e-6)


def test_round_from_f64_rounds_once():
    rng = np.random.default_rng(7)
    base = rng.standard_normal(20000).astype(BF16).astype(np.float64)
    ulp = np.abs(base) * 2.0**-7
    # values near ties (half an ulp, nudged by far less than float32 resolution) plus plain random values
    near_tie = base + 0.5 * ulp * rng.choice([-1, 1], base.size) * (1 + rng.choice([-1, 0, 1], base.size) * 2.0**-30)
    x = np.concatenate([near_tie, rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)])
    got = ref._round_from_f64(x, BF16).astype(np.float64)
    np.testing.assert_array_equal(got, bf16_round_exact(x))
    assert ref._round_from_f64(np.array([1 + 2**-8 + 2**-30]), BF16).astype(np.float64)[0] == 1 + 2**-7
    with np.errstate(over="ignore"):
        for dt in (np.float16, np.float32):
            np.testing.assert_array_equal(ref._round_from_f64(x, dt), x.astype(dt))


# ---- varlen --------------------------------------------------------------------------------------

def _pack(rng, lens, H, D, dtype):
    return rnd(rng, (int(sum(lens)), H, D), dtype), np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(2, 1), softcap=3.0), dict(causal=True,
                                window=(4, -1), softmax_scale=0.2)], ids=str)
def test_varlen_equals_per_sequence(kw):
    rng = np.random.default_rng(8)
    lq, lk = [5, 1, 17, 0, 9, 3], [5, 7, 11, 4, 9, 1]     # includes Sq > Sk, Sq < Sk and an empty query
    q, cu_q = _pack(rng, lq, 4, 12, np.float16)
    k, cu_k = _pack(rng, lk, 2, 12, np.float16)
    v, _ = _pack(rng, lk, 2, 12, np.float16)
    o, lse = ref.flash_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk),
                                        return_lse=True, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (4, q.shape[0]) and lse.dtype == np.float32
    for b in range(len(lq)):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        o_b, lse_b = ref.flash_attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], return_lse=True, **kw)
        np.testing.assert_array_equal(f64(o[qs:qe]), f64(o_b[0]))
        np.testing.assert_array_equal(lse[:, qs:qe], lse_b[0])


def test_varlen_sequence_without_keys():
    rng = np.random.default_rng(9)
    q, cu_q = _pack(rng, [3, 4], 2, 8, np.float32)
    k, cu_k = _pack(rng, [0, 6], 2, 8, np.float32)
    o, lse = ref.flash_attention_varlen(q, k, k, cu_q, cu_k, return_lse=True)
    assert (o[:3] == 0).all() and np.isneginf(lse[:, :3]).all()
    assert np.isfinite(lse[:, 3:]).all()


# ---- paged ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kw", [dict(), dict(window=(5, -1)), dict(softcap=2.0, softmax_scale=0.3),
                                dict(window=(0, 3))], ids=str)
def test_paged_equals_contiguous(block_size, kw):
    rng = np.random.default_rng(10 + block_size)
    lens = np.array([1, 37, block_size, 2 * block_size + 1, 23], dtype=np.int32)
    B, Hq, Hkv, D = len(lens), 6, 2, 20
    need = [-(-int(n) // block_size) for n in lens]
    max_blocks = max(need) + 2
    num_blocks = sum(need) + 5
    k_cache = rnd(rng, (num_blocks, block_size, Hkv, D), BF16)
    v_cache = rnd(rng, (num_blocks, block_size, Hkv, D), BF16)
    ids = rng.permutation(num_blocks)                                  # shuffled, non-contiguous blocks
    table = np.full((B, max_blocks), -1, dtype=np.int32)               # unused entries are never read
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[at:at + n]
        at += n
    q = rnd(rng, (B, Hq, D), BF16)
    saved = table.copy()
    o = ref.paged_attention(q, k_cache, v_cache, table, lens, **kw)
    np.testing.assert_array_equal(table, saved)
    assert o.shape == (B, Hq, D) and o.dtype == BF16
    for b in range(B):
        n = int(lens[b])
        tok = [table[b, t // block_size] * block_size + t % block_size for t in range(n)]
        k = k_cache.reshape(-1, Hkv, D)[tok][None]
        v = v_cache.reshape(-1, Hkv, D)[tok][None]
        o_b = ref.flash_attention(q[b][None, None], k, v, **kw)
        np.testing.assert_array_equal(f64(o[b]), f64(o_b[0, 0]))


def test_paged_matches_naive_with_window():
    rng = np.random.default_rng(11)
    k_cache, v_cache = rnd(rng, (4, 4, 1, 8)), rnd(rng, (4, 4, 1, 8))
    table = np.array([[2, 0, 3]], dtype=np.int32)
    lens = np.array([10], dtype=np.int32)
    q = rnd(rng, (1, 2, 8))
    o = ref.paged_attention(q, k_cache, v_cache, table, lens, window=(3, -1))
    k = np.concatenate([k_cache[2], k_cache[0], k_cache[3]])[:10][None]
    v = np.concatenate([v_cache[2], v_cache[0], v_cache[3]])[:10][None]
    o_n, _ = naive_attention(q[:, None], k, v, window=(3, -1))      # sees keys 6..9
    np.testing.assert_allclose(o, o_n[:, 0], rtol=1e-6, atol=1e-7)


# ---- the low-precision baseline (docs/accuracy.md) -------------------------------------------------

def naive_lowp(q, k, v, causal=False, window=(-1, -1), softcap=0.0):
    """sdpa_lowp's steps written per query row (float32 scores and softmax, P rounded to the dtype)."""
    dt = q.dtype
    f32 = np.float32
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = f32(1 / math.sqrt(D))
    left, right = (window[0], 0) if causal else window
    o = np.zeros(q.shape, dt)
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(Sq):
                diag = i + Sk - Sq
                j = np.arange(Sk)
                vis = ((left < 0) | (j >= diag - left)) & ((right < 0) | (j <= diag + right))
                if not vis.any():
                    continue
                s = (k[b, vis, kh].astype(f32) @ q[b, i, h].astype(f32)) * scale
                if softcap > 0:
                    s = f32(softcap) * np.tanh(s / f32(softcap))
                p = np.exp(s - s.max())
                l = p.sum(dtype=f32)
                acc = p.astype(dt).astype(f32) @ v[b, vis, kh].astype(f32)
                o[b, i, h] = (acc / l).astype(dt)
    return o


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(3, 0), softcap=4.0)], ids=str)
def test_sdpa_lowp_steps(dtype, kw):
    rng = np.random.default_rng(12)
    q, k, v = rnd(rng, (1, 9, 4, 16), dtype), rnd(rng, (1, 12, 2, 16), dtype), rnd(rng, (1, 12, 2, 16), dtype)
    o = ref.sdpa_lowp(q, k, v, **kw)
    o_n = naive_lowp(q, k, v, **kw)
    assert o.dtype == dtype
    # only float32 summation order differs, which can move P or O by one rounding step of the dtype
    tol = 2 * float(ml_dtypes.finfo(dtype).eps) * np.abs(f64(o_n)).max()
    assert np.abs(f64(o) - f64(o_n)).max() <= tol


@pytest.mark.parametrize("dtype,cap", [(np.dtype(np.float16), 2e-3), (BF16, 1e-2)], ids=str)
def test_sdpa_lowp_error_is_small_but_real(dtype, cap):
    rng = np.random.default_rng(13)
    q, k, v = rnd(rng, (2, 200, 4, 64), dtype), rnd(rng, (2, 203, 2, 64), dtype), rnd(rng, (2, 203, 2, 64), dtype)
    for kw in (dict(), dict(causal=True)):
        exact = ref.flash_attention(q, k, v, **kw)
        lowp = ref.sdpa_lowp(q, k, v, **kw)
        # compare both against float64 without the final rounding
        o_f64 = f64(ref.flash_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), **kw))
        e_lowp, e_exact = rel_err(lowp, o_f64), rel_err(exact, o_f64)
        assert 0 < e_exact <= e_lowp < cap


def test_sdpa_lowp_float32_matches_reference_and_rows_without_keys():
    rng = np.random.default_rng(14)
    q, k, v = rnd(rng, (1, 11, 2, 8)), rnd(rng, (1, 5, 1, 8)), rnd(rng, (1, 5, 1, 8))
    o = ref.sdpa_lowp(q, k, v, causal=True)
    np.testing.assert_allclose(o, ref.flash_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-6)
    assert (o[0, :6] == 0).all() and not np.isnan(o).any()


# ---- 8k tokens -----------------------------------------------------------------------------------

def test_8k_tokens_memory_and_time():
    rng = np.random.default_rng(15)
    S, Hq, Hkv, D = 8192, 4, 2, 64
    q, k, v = rnd(rng, (1, S, Hq, D), np.float16), rnd(rng, (1, S, Hkv, D), np.float16), \
        rnd(rng, (1, S, Hkv, D), np.float16)
    tracemalloc.start()
    t0 = time.perf_counter()
    o, lse = ref.flash_attention(q, k, v, causal=True, return_lse=True)
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # one full [Hq, S, S] float64 score array alone would be 2 GiB
    assert peak < 256 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    assert seconds < 40, f"{seconds:.1f} s"
    assert np.isfinite(lse).all()
    for i in (0, 1, 4097, S - 1):          # spot rows against the naive loop
        o_n, lse_n = naive_attention(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], causal=True)
        np.testing.assert_array_equal(f64(o[:, i:i + 1]), f64(o_n.astype(np.float16)))
        np.testing.assert_allclose(lse[:, :, i:i + 1], lse_n, rtol=1e-6)


# ---- the checks, on NumPy and on device-like arrays ----------------------------------------------

class DeviceLike:
    """Stands in for a CuPy array: shape/dtype/ndim, and .get() for a host copy; not a numpy.ndarray."""

    def __init__(self, a):
        self._a = np.asarray(a)
        self.shape, self.dtype, self.ndim = self._a.shape, self._a.dtype, self._a.ndim
        self.gets = 0

    def get(self):
        self.gets += 1
        return self._a.copy()


def test_checks_work_on_device_like_arrays():
    rng = np.random.default_rng(16)
    q, k = rnd(rng, (2, 5, 4, 8), np.float16), rnd(rng, (2, 7, 2, 8), np.float16)
    dq, dk = DeviceLike(q), DeviceLike(k)
    assert _checks.check_attention_args(dq, dk, dk, (-1, -1), 0.0) == (2, 5, 7, 4, 2, 8)
    with pytest.raises(TypeError, match="q: expected dtype float16, bfloat16, got float32"):
        _checks.check_attention_args(DeviceLike(q.astype(np.float32)), DeviceLike(k.astype(np.float32)),
                                 DeviceLike(k.astype(np.float32)), (-1, -1), 0.0,
                                 dtypes=(np.dtype(np.float16), BF16))
    cu_q, cu_k = DeviceLike(np.array([0, 3, 5], np.int32)), DeviceLike(np.array([0, 4, 7], np.int32))
    shape = _checks.check_varlen_args(DeviceLike(q[0]), DeviceLike(k[0]), DeviceLike(k[0]), cu_q, cu_k)
    assert shape[:8] == (2, 5, 7, 4, 2, 8, 3, 4) and cu_q.gets == 1
    shape = _checks.check_varlen_args(DeviceLike(q[0]), DeviceLike(k[0]), DeviceLike(k[0]), cu_q, cu_k,
                                  max_seqlen_q=3, max_seqlen_k=4, check_values=False)
    assert shape.max_seqlen_q == 3 and shape.cu_seqlens_q is None and cu_q.gets == 1      # no copy
    table, lens = DeviceLike(np.array([[1, 0], [2, -1]], np.int32)), DeviceLike(np.array([5, 3], np.int32))
    kc = DeviceLike(rnd(rng, (3, 4, 2, 8), np.float16))
    shape = _checks.check_paged_args(DeviceLike(q[:, 0]), kc, kc, table, lens)
    assert shape[:7] == (2, 4, 2, 8, 3, 4, 2) and table.gets == 1
    with pytest.raises(ValueError, match="seq_lens: expected values from 1 to"):
        _checks.check_paged_args(DeviceLike(q[:, 0]), kc, kc, table, DeviceLike(np.array([9, 3], np.int32)))
    with pytest.raises(TypeError, match="the reference takes numpy.ndarray"):
        _checks._require_numpy(q=dq, k=dk, v=dk)


def test_effective_window_and_scale():
    assert _checks.effective_window((-1, -1), True) == (-1, 0)
    assert _checks.effective_window((3, 7), True) == (3, 0)
    assert _checks.effective_window((3, 7), False) == (3, 7)
    assert _checks.effective_scale(None, 64) == 0.125 and _checks.effective_scale(2, 64) == 2.0


def _dense(**over):
    rng = np.random.default_rng(17)
    a = dict(q=rnd(rng, (1, 4, 4, 8), np.float16), k=rnd(rng, (1, 6, 2, 8), np.float16),
             v=rnd(rng, (1, 6, 2, 8), np.float16))
    kw = {n: over.pop(n) for n in list(over) if n not in a}
    a.update(over)
    return lambda: vbw_cupy.flash_attention(a["q"], a["k"], a["v"], **kw)


def _varlen(**over):
    rng = np.random.default_rng(18)
    a = dict(q=rnd(rng, (7, 4, 8), np.float16), k=rnd(rng, (9, 2, 8), np.float16), v=rnd(rng, (9, 2, 8), np.float16),
             cu_seqlens_q=np.array([0, 3, 7], np.int32), cu_seqlens_k=np.array([0, 4, 9], np.int32))
    kw = {n: over.pop(n) for n in list(over) if n not in a}
    a.update(over)
    return lambda: vbw_cupy.flash_attention_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                                   **kw)


def _paged(**over):
    rng = np.random.default_rng(19)
    a = dict(q=rnd(rng, (2, 4, 8), np.float16), k_cache=rnd(rng, (5, 4, 2, 8), np.float16),
             v_cache=rnd(rng, (5, 4, 2, 8), np.float16), block_table=np.array([[4, 1], [0, -1]], np.int32),
             seq_lens=np.array([6, 3], np.int32))
    kw = {n: over.pop(n) for n in list(over) if n not in a}
    a.update(over)
    return lambda: vbw_cupy.paged_attention(a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["seq_lens"],
                                            **kw)


def test_bad_input_fixtures_are_valid():
    _dense()(), _varlen()(), _paged()()


_H = np.float16
BAD = [
    # dense
    (_dense(q=np.zeros((4, 4, 8), _H)), ValueError, r"q: expected a 4-d array \[B, Sq, Hq, D\], got 3-d"),
    (_dense(k=[[1.0]]), TypeError, "k: expected a NumPy or GPU array, got list"),
    (lambda: _checks.check_attention_args(np.zeros((1, 4, 4, 8), _H), [[1.0]], [[1.0]]), TypeError,
     r"k: expected an array of shape \[B, Sk, Hkv, D\], got list"),
    (_dense(q=np.zeros((1, 4, 4, 8)), k=np.zeros((1, 6, 2, 8)), v=np.zeros((1, 6, 2, 8))), TypeError,
     "q: expected dtype float16, bfloat16, float32, got float64"),
    (_dense(q=np.zeros((1, 4, 4, 8), np.int32)), TypeError, "q: expected dtype .* got int32"),
    (_dense(k=np.zeros((1, 6, 2, 8), np.float32)), TypeError, r"k: expected the same dtype as q \(float16\), got float32"),
    (_dense(v=np.zeros((1, 6, 2, 8), BF16)), TypeError, "v: expected the same dtype as q"),
    (_dense(k=np.zeros((1, 6, 2, 16), _H), v=np.zeros((1, 6, 2, 16), _H)), ValueError,
     r"k: expected shape \[B, Sk, Hkv, D\] with B == q's 1 and D == q's 8, got \(1, 6, 2, 16\)"),
    (_dense(k=np.zeros((2, 6, 2, 8), _H), v=np.zeros((2, 6, 2, 8), _H)), ValueError, "B == q's 1"),
    (_dense(v=np.zeros((1, 5, 2, 8), _H)), ValueError, r"v: expected the shape of k \(1, 6, 2, 8\), got \(1, 5, 2, 8\)"),
    (_dense(k=np.zeros((1, 6, 3, 8), _H), v=np.zeros((1, 6, 3, 8), _H)), ValueError,
     "k: expected a number of KV heads that divides q's 4 heads .*, got 3"),
    (_dense(q=np.zeros((1, 4, 4, 257), _H), k=np.zeros((1, 6, 2, 257), _H), v=np.zeros((1, 6, 2, 257), _H)),
     ValueError, "q: expected a head dimension D from 1 to 256, got 257"),
    (_dense(q=np.zeros((1, 4, 4, 0), _H), k=np.zeros((1, 6, 2, 0), _H), v=np.zeros((1, 6, 2, 0), _H)),
     ValueError, "q: expected a head dimension D from 1 to 256, got 0"),
    (_dense(q=np.zeros((1, 0, 4, 8), _H)), ValueError, r"q: expected a non-empty array .*got shape \(1, 0, 4, 8\)"),
    (_dense(k=np.zeros((1, 0, 2, 8), _H), v=np.zeros((1, 0, 2, 8), _H)), ValueError, "k: expected a non-empty"),
    (_dense(window=(-2, 0)), ValueError, r"window: expected values >= -1 \(-1 is unbounded\), got \(-2, 0\)"),
    (_dense(window=(0, -5)), ValueError, "window: expected values >= -1"),
    (_dense(window=(3,)), TypeError, r"window: expected a pair of ints"),
    (_dense(window=(1.5, 2)), TypeError, r"window: expected a pair of ints"),
    (_dense(window=None), TypeError, r"window: expected a pair of ints"),
    (_dense(softcap=-1.0), ValueError, r"softcap: expected a finite float >= 0 \(0 is off\), got -1.0"),
    (_dense(softcap=float("nan")), ValueError, "softcap: expected a finite float >= 0"),
    (_dense(softcap="big"), TypeError, "softcap: expected a float >= 0, got str"),
    (_dense(softmax_scale=float("inf")), ValueError, "softmax_scale: expected a finite float .*, got inf"),
    (_dense(softmax_scale="x"), TypeError, "softmax_scale: expected None or a float, got str"),
    (_dense(softmax_scale=-10**400), ValueError, "softmax_scale: expected a finite float .*, got -inf"),
    (_dense(softcap=10**400), ValueError, "softcap: expected a finite float >= 0 .*, got inf"),
    (_dense(causal="yes"), TypeError, "causal: expected a bool, got str"),
    (_dense(return_lse=1), TypeError, "return_lse: expected a bool, got int"),
    # varlen
    (_varlen(q=np.zeros((1, 7, 4, 8), _H)), ValueError, r"q: expected a 3-d array \[total_q, Hq, D\], got 4-d"),
    (_varlen(k=np.zeros((9, 2, 4), _H), v=np.zeros((9, 2, 4), _H)), ValueError, "k: expected shape .* D == q's 8"),
    (_varlen(k=np.zeros((9, 3, 8), _H), v=np.zeros((9, 3, 8), _H)), ValueError, "divides q's 4 heads"),
    (_varlen(cu_seqlens_q=np.array([0, 3, 7])), TypeError, r"cu_seqlens_q: expected an int32 array \[B \+ 1\], got dtype int64"),
    (_varlen(cu_seqlens_k=[0, 4, 9]), TypeError, "cu_seqlens_k: expected NumPy offsets with NumPy q, k, v .*got list"),
    (_varlen(cu_seqlens_q=np.array([[0, 3, 7]], np.int32)), ValueError, "cu_seqlens_q: expected a 1-d array"),
    (_varlen(cu_seqlens_q=np.array([7], np.int32)), ValueError, "cu_seqlens_q: expected B \\+ 1 >= 2 offsets, got 1"),
    (_varlen(cu_seqlens_k=np.array([0, 9], np.int32)), ValueError, r"cu_seqlens_k: expected 3 offsets .*, got 2"),
    (_varlen(cu_seqlens_q=np.array([1, 3, 7], np.int32)), ValueError, "cu_seqlens_q: expected offsets starting at 0, got 1"),
    (_varlen(cu_seqlens_k=np.array([0, 5, 4, 9], np.int32), cu_seqlens_q=np.array([0, 3, 5, 7], np.int32)),
     ValueError, "cu_seqlens_k: expected non-decreasing offsets, got 5 then 4 at index 1"),
    (_varlen(cu_seqlens_q=np.array([0, 3, 6], np.int32)), ValueError,
     "cu_seqlens_q: expected the last offset to equal q's packed length 7, got 6"),
    (_varlen(cu_seqlens_k=np.array([0, 4, 10], np.int32)), ValueError, "packed length 9, got 10"),
    (_varlen(max_seqlen_q=3), ValueError, r"max_seqlen_q: expected at least the longest sequence \(4\), got 3"),
    (_varlen(max_seqlen_k=-1), ValueError, "max_seqlen_k: expected an int >= 0, got -1"),
    (_varlen(max_seqlen_k=5.0), TypeError, "max_seqlen_k: expected None or an int"),
    (_varlen(window=(0, -2)), ValueError, "window: expected values >= -1"),
    (_varlen(causal=None), TypeError, "causal: expected a bool"),
    # paged
    (_paged(q=np.zeros((2, 1, 4, 8), _H)), ValueError, r"q: expected a 3-d array \[B, Hq, D\], got 4-d"),
    (_paged(k_cache=np.zeros((5, 4, 8), _H)), ValueError, r"k_cache: expected a 4-d array \[num_blocks, block_size"),
    (_paged(v_cache=np.zeros((5, 4, 2, 8), np.float32)), TypeError, "v_cache: expected the same dtype as q"),
    (_paged(v_cache=np.zeros((6, 4, 2, 8), _H)), ValueError, r"v_cache: expected the shape of k_cache \(5, 4, 2, 8\)"),
    (_paged(k_cache=np.zeros((5, 4, 2, 6), _H), v_cache=np.zeros((5, 4, 2, 6), _H)), ValueError, "D == q's 8"),
    (_paged(k_cache=np.zeros((5, 3, 2, 8), _H), v_cache=np.zeros((5, 3, 2, 8), _H)), ValueError,
     "k_cache: expected a block_size .* power of two from 1 to 256, got 3"),
    (_paged(k_cache=np.zeros((1, 512, 2, 8), _H), v_cache=np.zeros((1, 512, 2, 8), _H)), ValueError,
     "power of two from 1 to 256, got 512"),
    (_paged(k_cache=np.zeros((5, 4, 3, 8), _H), v_cache=np.zeros((5, 4, 3, 8), _H)), ValueError,
     "k_cache: expected a number of KV heads that divides q's 4 heads"),
    (_paged(block_table=np.array([[4, 1], [0, 2]], np.int64)), TypeError, "block_table: expected an int32 array"),
    (_paged(block_table=np.array([[4, 1]], np.int32)), ValueError, r"block_table: expected shape \[B, max_blocks\] with B == q's 2"),
    (_paged(block_table=np.zeros((2, 0), np.int32)), ValueError, "max_blocks >= 1"),
    (_paged(seq_lens=np.array([6, 3], np.int64)), TypeError, r"seq_lens: expected an int32 array \[B\]"),
    (_paged(seq_lens=np.array([6, 3, 1], np.int32)), ValueError, r"seq_lens: expected shape \[B\] with B == q's 2"),
    (_paged(seq_lens=np.array([6, 0], np.int32)), ValueError, "seq_lens: expected values from 1 to max_blocks .* = 8, got 0 at index 1"),
    (_paged(seq_lens=np.array([9, 3], np.int32)), ValueError, "got 9 at index 0"),
    (_paged(block_table=np.array([[4, 5], [0, -1]], np.int32)), ValueError,
     r"block_table: expected block ids in \[0, 5\) .*got 5 at \[0, 1\]"),
    (_paged(block_table=np.array([[4, 1], [-1, 0]], np.int32)), ValueError, r"got -1 at \[1, 0\]"),
    (_paged(window=(-3, -1)), ValueError, "window: expected values >= -1"),
    (_paged(softcap=-0.5), ValueError, "softcap: expected a finite float >= 0"),
    # the argument at fault is named, before any question of CuPy (issue 18)
    (_paged(seq_lens=[6, 3]), TypeError, "seq_lens: expected a NumPy or GPU array, got list"),
    (_paged(block_table=np.int32(4)), TypeError, r"block_table: expected a NumPy or GPU array, got a NumPy scalar"),
    (_dense(v=np.zeros((1, 6, 2, 8), _H).tolist()), TypeError, "v: expected a NumPy or GPU array, got list"),
    (_dense(q=np.float16(1.0)), TypeError, r"q: expected a NumPy or GPU array, got a NumPy scalar \(float16\)"),
    (_varlen(q=[1.0]), TypeError, "q: expected a NumPy or GPU array, got list"),
    # scores must fit float32 in the kernels: bounded softmax_scale, softcap 0 or in [2^-32, 2^64]
    (_dense(softmax_scale=1e37), ValueError, r"softmax_scale: .*\|softmax_scale\| <= 2\^64 .*got 1e\+37"),
    (_dense(softmax_scale=-1e37), ValueError, "softmax_scale: "),
    (_paged(softmax_scale=1e37), ValueError, "softmax_scale: "),
    (_dense(softcap=1e-40), ValueError, r"softcap: expected 0 \(off\) or a float from 2\^-32 to 2\^64 .*got 1e-40"),
    (_paged(softcap=1e70), ValueError, "softcap: expected 0 .off. or a float from 2"),
]


@pytest.mark.parametrize("call,exc,msg", BAD, ids=[f"{i}-{b[2][:40]}" for i, b in enumerate(BAD)])
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_lists_and_numpy_scalars_never_ask_for_cupy(monkeypatch):
    """Without CuPy a non-array is still a TypeError naming it, not a RuntimeError about installing CuPy."""
    from vbw_cupy import _runtime as rt
    monkeypatch.setattr(rt, "cupy", None)
    q = np.zeros((1, 4, 4, 8), _H).tolist()
    for call, name in ((lambda: vbw_cupy.flash_attention(q, q, q), "q"),
                       (lambda: vbw_cupy.quantize(np.float32(1.0)), "x"),
                       (lambda: vbw_cupy.quantize([1.0, 2.0]), "x"),
                       (_paged(q=np.float16(0), k_cache=[0], v_cache=[0]), "q")):
        with pytest.raises(TypeError, match=f"{name}: expected a NumPy or GPU array"):
            call()


def test_extreme_but_valid_options_are_accepted():
    _dense(softmax_scale=2.0 ** 64, softcap=2.0 ** -32)()
    _dense(softmax_scale=0.0)()
    _paged(window=(2 ** 40, 0))()   # an unreachable window is unbounded (the GPU path clamps it)
    np.testing.assert_array_equal(_paged(window=(2 ** 40, 0))(), _paged()())


# ---------------------------------------------------------------- NaN rules (issue 18)
# NaN / Inf in an input reach exactly the outputs that depend on it; rows that see no key stay 0 with lse -inf.

def _nan_case(S=1024, Hq=2, D=16, seed=31):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, S, Hq, D)).astype(np.float32),
            rng.standard_normal((1, S, 1, D)).astype(np.float32),
            rng.standard_normal((1, S, 1, D)).astype(np.float32))


def _bad_rows(o):
    return np.flatnonzero(~np.isfinite(o[0]).all(axis=(1, 2)))


def test_nan_query_row_is_nan():
    q, k, v = _nan_case()
    q[0, 5, 1, 3] = np.nan
    o, lse = vbw_cupy.flash_attention(q, k, v, return_lse=True)
    assert np.isnan(o[0, 5, 1]).all() and np.isnan(lse[0, 1, 5])
    assert np.isfinite(np.delete(o[0, :, 1], 5, axis=0)).all() and np.isfinite(o[0, :, 0]).all()
    assert np.isfinite(np.delete(lse[0, 1], 5)).all()
    # a NaN query row that sees no key (causal, Sq > Sk) still gets 0 and -inf
    o, lse = vbw_cupy.flash_attention(q[:, :8], k[:, :4], v[:, :4], causal=True, return_lse=True)
    q2 = q[:, :8].copy()
    q2[0, 0] = np.nan
    o2, lse2 = vbw_cupy.flash_attention(q2, k[:, :4], v[:, :4], causal=True, return_lse=True)
    assert (o2[0, 0] == 0).all() and (lse2[0, :, 0] == -np.inf).all()
    np.testing.assert_array_equal(o2, o)


@pytest.mark.parametrize("what", ["k", "v"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_causal_bad_key_reaches_only_later_rows(what, bad):
    q, k, v = _nan_case()
    clean = vbw_cupy.flash_attention(q, k, v, causal=True)
    (k if what == "k" else v)[0, 200, 0, 3] = bad
    o = vbw_cupy.flash_attention(q, k, v, causal=True)
    if what == "k" and not np.isnan(bad):   # a score of -inf is a weight of 0: only the +inf rows go bad
        assert 0 < len(_bad_rows(o)) < 824 and _bad_rows(o).min() >= 200
    else:
        assert _bad_rows(o).tolist() == list(range(200, 1024))
    np.testing.assert_array_equal(o[:, :200], clean[:, :200])


def test_window_inf_value_reaches_only_rows_that_see_it():
    q, k, v = _nan_case()
    clean = vbw_cupy.flash_attention(q, k, v, window=(8, 8))
    v[0, 900, 0] = np.inf
    o = vbw_cupy.flash_attention(q, k, v, window=(8, 8))
    assert _bad_rows(o).tolist() == list(range(892, 909))  # the 17 rows that see key 900
    rest = np.r_[0:892, 909:1024]
    np.testing.assert_array_equal(o[:, rest], clean[:, rest])


def test_windows_wider_than_any_distance_are_unbounded():
    # (0, 2^63) used to overflow int64 in the reference's masks
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((1, 40, 2, 16)).astype(np.float16) for _ in range(3))
    for wide, same in (((0, 2**63), (0, -1)), ((2**40, 3), (-1, 3)), ((10**30, 10**30), (-1, -1))):
        np.testing.assert_array_equal(vbw_cupy.flash_attention(q, k, v, window=wide),
                                      vbw_cupy.flash_attention(q, k, v, window=same))


def test_varlen_and_paged_bad_values_stay_in_their_rows():
    q, k, v = _nan_case(S=64)
    v[0, 40, 0] = np.nan                                      # sequence 1 (keys 32..63), key 8 of it
    cu = np.array([0, 32, 64], np.int32)
    o = vbw_cupy.flash_attention_varlen(q[0], k[0], v[0], cu, cu, causal=True)
    assert _bad_rows(o[None]).tolist() == list(range(40, 64))
    # paged: a NaN past a sequence's length, or outside its window, is never seen
    h = list(_paged_inputs())
    h[2] = h[2].copy()
    h[2][1, 3] = np.nan                   # block 1, slot 3: token 7 of sequence 0, which has 6 tokens
    h[2][4, 0] = np.nan                   # block 4, slot 0: token 0 of sequence 0
    o = vbw_cupy.paged_attention(*h, window=(4, 0))           # sequence 0 (6 tokens) sees tokens 1..5
    assert np.isfinite(o).all()
    assert np.isnan(vbw_cupy.paged_attention(*h)[0]).all() and np.isfinite(vbw_cupy.paged_attention(*h)[1]).all()


def _paged_inputs():
    rng = np.random.default_rng(19)
    return (rnd(rng, (2, 4, 8), np.float16), rnd(rng, (5, 4, 2, 8), np.float16), rnd(rng, (5, 4, 2, 8), np.float16),
            np.array([[4, 1], [0, -1]], np.int32), np.array([6, 3], np.int32))
