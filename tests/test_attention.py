"""flash_attention / flash_attention_varlen: the GPU kernel against the float64 reference (SPEC section 3; bounds: docs/accuracy.md).

GPU tests compare at real sizes with the bound of docs/accuracy.md: the relative Frobenius error against float64 must be at
most 2x that of `reference.sdpa_lowp` (the same computation in the input dtype with float32 softmax) and at most
2e-3 (float16) / 1e-2 (bfloat16). Output and LSE buffers are NaN-poisoned before every launch, so an unwritten
element fails. CPU tests check the argument errors (raised before any launch, also for NumPy inputs), the
dispatch to the reference and the tile tables.
"""
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from vbw_cupy import _device
from vbw_cupy import _runtime as rt
from vbw_cupy import attention as A
from vbw_cupy import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}
CAP = {"float16": 2e-3, "bfloat16": 1e-2}


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _bound(base, dtype):
    # docs/accuracy.md: no worse than 2x the same-dtype/fp32-softmax error, and under the dtype's cap. The 1e-7 only
    # keeps "both exact" (e.g. every row sees one key) from failing on a 0 <= 0 comparison of rounding noise.
    return min(2.0 * base, CAP[dtype]) + 1e-7


def _check_lse(lse, lse64):
    lse, lse64 = np.asarray(lse), np.asarray(lse64)
    seen = np.isfinite(lse64)
    assert not np.isnan(lse).any(), "lse has NaN (unwritten?)"
    assert np.array_equal(np.isfinite(lse), seen), "lse is -inf exactly where a row sees no key"
    assert np.all(lse[~seen] == -np.inf)
    if seen.any():
        assert np.allclose(lse[seen], lse64[seen], rtol=1e-4, atol=1e-3), \
            float(np.abs(lse[seen] - lse64[seen]).max())


def run_dense(B, Sq, Sk, Hq, Hkv, D, dtype, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, seed=0,
              config=None, layout=None):
    """One GPU launch against the reference; returns (err, bound). layout: None, "noncontig" or "unaligned"."""
    cp = pytest.importorskip("cupy")
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    qh, kh, vh = _rand(rng, (B, Sq, Hq, D), dt), _rand(rng, (B, Sk, Hkv, D), dt), _rand(rng, (B, Sk, Hkv, D), dt)
    q, k, v = cp.asarray(qh), cp.asarray(kh), cp.asarray(vh)
    if layout == "noncontig":  # q as a strided view (heads interleaved with junk), k transposed twice
        big = cp.full((B, Sq, Hq, 2 * D), cp.nan, dtype=dt)
        big[..., D:] = q
        q = big[..., D:]
        k = cp.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        assert not q.flags.c_contiguous and not k.flags.c_contiguous
    elif layout == "unaligned":  # contiguous but 2 bytes off a 16-byte boundary: the element-wise path
        def shift(x):
            buf = cp.empty(x.size + 1, dtype=dt)
            y = buf[1:].reshape(x.shape)
            y[...] = x
            return y
        q, k, v = shift(q), shift(k), shift(v)
        assert q.data.ptr % 16 != 0
    o = cp.full((B, Sq, Hq, D), cp.nan, dtype=dt)
    lse = cp.full((B, Hq, Sq), cp.nan, dtype=cp.float32)
    A._flash_gpu(q, k, v, causal=causal, softmax_scale=scale, window=window, softcap=softcap, return_lse=True,
                 out=o, lse_out=lse, config=config)
    oh = cp.asnumpy(o).astype(np.float32)
    assert not np.isnan(oh).any(), "output has NaN (an element was not written)"
    f32 = lambda x: x.astype(np.float32)  # exact: the reference then runs on the very same values
    o64, lse64 = ref.flash_attention(f32(qh), f32(kh), f32(vh), causal=causal, softmax_scale=scale, window=window,
                                     softcap=softcap, return_lse=True)
    _check_lse(cp.asnumpy(lse), lse64)
    empty = ~np.isfinite(lse64)  # [B, Hq, Sq]: rows that see no key must be exactly 0
    if empty.any():
        assert np.all(oh.transpose(0, 2, 1, 3)[empty] == 0)
    low = ref.sdpa_lowp(qh, kh, vh, causal=causal, softmax_scale=scale, window=window, softcap=softcap)
    err, base = ref.rel_error(oh, o64), ref.rel_error(low.astype(np.float32), o64)
    assert err <= _bound(base, dtype), f"error {err:.3e} > bound {_bound(base, dtype):.3e} (sdpa_lowp {base:.3e})"
    return err, _bound(base, dtype)


gpu = pytest.mark.gpu

# ---- (Sq, Sk) pairs in the spirit of flash-attn's grid, at D = 64 and 128 ---------------------------------
PAIRS = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (2048, 2048),
         (1, 239), (3, 799), (4096, 4096)]


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Sq,Sk", PAIRS)
def test_shapes(Sq, Sk, D, causal):
    i = PAIRS.index((Sq, Sk))
    dtype = ("float16", "bfloat16")[(i + D // 64 + causal) % 2]
    big = Sq * Sk >= 2048 * 2048
    B, Hq, Hkv = (1, 2, 1) if big else (2, 4, 2)
    run_dense(B, Sq, Sk, Hq, Hkv, D, dtype, causal=causal, seed=i)


# ---- every head dim from the issue, at one medium shape, both dtypes, cycling GQA and mask kinds ----------
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
MODES = [dict(), dict(causal=True), dict(window=(100, 20)), dict(softcap=30.0), dict(causal=True, softcap=5.0)]


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_head_dims(D, dtype):
    i = HEAD_DIMS.index(D) + (dtype == "bfloat16")
    Hkv = (6, 2, 1)[i % 3]
    run_dense(1, 300, 517, 6, Hkv, D, dtype, seed=100 + i, **MODES[i % len(MODES)])


# ---- windows, rows that see nothing, Sq != Sk ---------------------------------------------------------------
@gpu
@pytest.mark.parametrize("window", [(0, 0), (64, -1), (-1, 32), (256, 0), (7, 5), (2000, 3)])
@pytest.mark.parametrize("Sq,Sk", [(1024, 1024), (500, 1200), (1200, 500)])
def test_windows(Sq, Sk, window):
    D = 128 if window[0] % 2 == 0 else 64
    run_dense(1, Sq, Sk, 4, 2, D, "float16" if Sq <= Sk else "bfloat16", window=window, seed=Sq + window[0])


@gpu
@pytest.mark.parametrize("kw", [dict(softcap=5.0), dict(softcap=50.0, causal=True), dict(scale=0.05),
                                dict(scale=-0.1), dict(scale=0.0), dict(scale=-0.2, softcap=3.0)])
def test_scale_and_softcap(kw):
    run_dense(2, 333, 700, 4, 4, 128, "bfloat16" if kw.get("causal") else "float16", seed=7, **kw)


@gpu
@pytest.mark.parametrize("layout", ["noncontig", "unaligned"])
@pytest.mark.parametrize("D", [64, 59])
def test_layouts(layout, D):
    run_dense(2, 257, 390, 4, 2, D, "float16", causal=True, seed=D, layout=layout)


@gpu
def test_fast_path_replays_only_matching_calls(monkeypatch):
    """The second identical call replays the first one's launch; an unaligned or strided input of the same
    shape, or other options, must not (each result is checked against the reference)."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(7)
    B, S, Hq, Hkv, D = 2, 700, 4, 2, 64
    qh, kh, vh = _rand(rng, (B, S, Hq, D), np.float16), _rand(rng, (B, S, Hkv, D), np.float16), \
        _rand(rng, (B, S, Hkv, D), np.float16)

    def check(got, **kw):
        o, lse = got
        oh = cp.asnumpy(o).astype(np.float32)
        assert not np.isnan(oh).any()
        f32 = lambda x: x.astype(np.float32)  # noqa: E731
        o64, lse64 = ref.flash_attention(f32(qh), f32(kh), f32(vh), return_lse=True, **kw)
        _check_lse(cp.asnumpy(lse), lse64)
        base = ref.rel_error(ref.sdpa_lowp(qh, kh, vh, **kw).astype(np.float32), o64)
        assert ref.rel_error(oh, o64) <= _bound(base, "float16")

    q, k, v = cp.asarray(qh), cp.asarray(kh), cp.asarray(vh)
    A._fast_plans.clear()
    check(A.flash_attention(q, k, v, causal=True, return_lse=True), causal=True)
    assert len(A._fast_plans) == 1
    full = A._flash_gpu
    monkeypatch.setattr(A, "_flash_gpu", lambda *a, **kw: pytest.fail("the full path ran for a replayable call"))
    check(A.flash_attention(q, k, v, causal=True, return_lse=True), causal=True)
    # new arrays of the same shape replay too, and must be the ones read (the TMA maps hold the addresses)
    qh, kh, vh = (x[::-1].copy() for x in (qh, kh, vh))
    q, k, v = cp.asarray(qh), cp.asarray(kh), cp.asarray(vh)
    check(A.flash_attention(q, k, v, causal=True, return_lse=True), causal=True)
    calls = []
    monkeypatch.setattr(A, "_flash_gpu", lambda *a, **kw: calls.append(1) or full(*a, **kw))

    def shift(x):  # contiguous, 2 bytes off a 16-byte boundary
        y = cp.empty(x.size + 1, dtype=x.dtype)[1:].reshape(x.shape)
        y[...] = x
        return y
    check(A.flash_attention(shift(q), k, v, causal=True, return_lse=True), causal=True)
    strided = cp.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    check(A.flash_attention(q, strided, v, causal=True, return_lse=True), causal=True)
    check(A.flash_attention(q, k, v, window=(50, 10), return_lse=True), window=(50, 10))
    assert len(calls) == 3


@gpu
def test_wgmma_launch_loads_by_tma():
    """On sm_90 an aligned input of a wgmma config takes tensor maps (TMA loads), dense or packed (varlen);
    _USE_TMA = False takes the cp.async kernel. The sweep and the shape tests check both give right answers."""
    cp = pytest.importorskip("cupy")
    if _device.device_arch() != 90:
        pytest.skip("TMA loads are the sm_90 wgmma kernel's")
    q = cp.ones((2, 300, 4, 64), dtype=cp.float16)
    k = cp.ones((2, 200, 2, 64), dtype=cp.float16)
    launch = A._Launch.dense(q, k, k, scale=0.125, window=(-1, 0), softcap=0.0, out=cp.empty_like(q), lse=None)
    cfg = A._wg(128, 1)
    assert launch.bound(cfg)[5:] == (True, (64, 128))
    maps = A._map_args(q, k, k, (64, 128))
    assert all(m.dtype.itemsize == rt.TENSOR_MAP_BYTES and m.size == 1 for m in maps)
    assert bytes(maps[0].tobytes()) != bytes(maps[1].tobytes())
    cu_q, cu_k = cp.asarray([0, 300, 600], dtype=cp.int32), cp.asarray([0, 200, 400], dtype=cp.int32)
    qv, kv = q.reshape(600, 4, 64), k.reshape(400, 2, 64)
    varlen = A._Launch(qv, kv, kv, cp.empty_like(qv), None, cu_q, cu_k, 2, 0, 0, 300, 200, 4, 2, 64, 0.125, -1,
                       0, 0.0, 600)
    assert varlen.bound(cfg)[5:] == (True, (64, 128))
    A._USE_TMA = False
    try:
        assert launch.bound(cfg)[5:] == varlen.bound(cfg)[5:] == (True, None)
    finally:
        A._USE_TMA = True


@gpu
def test_fast_key_is_strict():
    """Options that hash alike but are different objects (True vs 1, lists) never share a replay key."""
    cp = pytest.importorskip("cupy")
    q = cp.empty((1, 8, 1, 8), dtype=cp.float16)
    k1 = A._fast_key(q, q, q, True, None, (-1, -1), 0.0, False)
    assert k1 != A._fast_key(q, q, q, 1, None, (-1, -1), 0.0, False)
    assert k1 != A._fast_key(q, q, q, True, None, (-1, -1), 0, False)
    assert A._fast_key(q, q, q, True, None, [-1, -1], 0.0, False) is None


@gpu
@pytest.mark.parametrize("D,Sk,causal", [(192, 3000, True), (160, 2100, False), (64, 5000, False), (48, 4500, True)])
def test_long_key_default_tiles_bfloat16(D, Sk, causal):
    """The long-key default tiles (_WS_FROM: 112 keys at D = 160 / 192, three consumer warpgroups at D <= 64) in
    bfloat16, with the default config picked from the shape: partial last key tiles, masked and not."""
    if _device.device_arch() != 90:
        pytest.skip("the wgmma kernels run on sm_90 only")
    run_dense(1, 333, Sk, 4, 2, D, "bfloat16", causal=causal, seed=D + Sk)


# ---- varlen ---------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("D,causal,tail", [(64, False, 300), (128, True, 300), (192, True, 300), (256, False, 300),
                                          (64, True, 5000), (192, False, 3000)])
def test_varlen_next_sequence_never_leaks(D, causal, tail):
    """Packed TMA loads read past a sequence's end into the next sequence's tokens: those keys must be masked
    and those values zeroed. The second sequence's K and V are +-Inf / NaN; the first sequence's output (100
    and 37 tokens: partial tiles) must still match the reference, with no NaN. A long second sequence (`tail`)
    takes the long-key default tiles (_WS_FROM: three consumer warpgroups at D = 64, 112 keys at D = 192)."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(D)
    for n0 in (100, 37):
        total = n0 + tail
        qh, kh, vh = (_rand(rng, (total, 4, D), np.float16) for _ in range(3))
        kh[n0:] = np.inf
        vh[n0::2] = -np.inf
        vh[n0 + 1::2] = np.nan
        cu = cp.asarray([0, n0, total], dtype=cp.int32)
        o = A.flash_attention_varlen(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), cu, cu, causal=causal)
        got = cp.asnumpy(o[:n0]).astype(np.float32)
        assert not np.isnan(got).any(), "a NaN from the next sequence leaked"
        f32 = lambda x: x[None, :n0].astype(np.float32)  # noqa: E731
        o64 = ref.flash_attention(f32(qh), f32(kh), f32(vh), causal=causal)[0]
        base = ref.rel_error(ref.sdpa_lowp(qh[None, :n0], kh[None, :n0], vh[None, :n0], causal=causal)[0]
                             .astype(np.float32), o64)
        assert ref.rel_error(got, o64) <= _bound(base, "float16"), (D, n0)


VARLEN = [
    ([0, 1, 130, 1000, 64], [5, 0, 300, 1000, 64], dict(causal=True)),
    ([517, 33, 2048], [517, 700, 2000], dict()),
    ([128, 128, 128, 127, 1], [128, 1, 400, 127, 999], dict(window=(50, 10))),
    ([700, 3], [0, 900], dict(causal=True, softcap=20.0)),
    ([100, 2500, 1], [3000, 2600, 4100], dict(causal=True)),   # past 2k / 4k keys: the long-key default tiles
]


@gpu
@pytest.mark.parametrize("case", range(len(VARLEN)))
@pytest.mark.parametrize("D", [64, 80, 128, 160])
def test_varlen(case, D):
    cp = pytest.importorskip("cupy")
    lq, lk, kw = VARLEN[case]
    dtype = ("float16", "bfloat16")[(case + D) % 2]
    dt = DTYPES[dtype]
    Hq, Hkv = 4, (4, 2, 1)[case % 3]
    rng = np.random.default_rng(case * 7 + D)
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    qh = _rand(rng, (int(cu_q[-1]), Hq, D), dt)
    kh, vh = _rand(rng, (int(cu_k[-1]), Hkv, D), dt), _rand(rng, (int(cu_k[-1]), Hkv, D), dt)
    o = cp.full(qh.shape, cp.nan, dtype=dt)
    lse = cp.full((Hq, qh.shape[0]), cp.nan, dtype=cp.float32)
    cu_q_arg = cp.asarray(cu_q) if case % 2 == 0 else cu_q  # offsets on the device or on the host
    A._varlen_gpu(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), cu_q_arg, cp.asarray(cu_k), max_seqlen_q=None,
                  max_seqlen_k=None, softmax_scale=None, return_lse=True, out=o, lse_out=lse,
                  **{"causal": False, "window": (-1, -1), "softcap": 0.0, **kw})
    oh = cp.asnumpy(o).astype(np.float32)
    assert not np.isnan(oh).any()
    f32 = lambda x: x.astype(np.float32)
    o64, lse64 = ref.flash_attention_varlen(f32(qh), f32(kh), f32(vh), cu_q, cu_k, return_lse=True, **kw)
    _check_lse(cp.asnumpy(lse), lse64)
    # the baseline error, sequence by sequence with the dense sdpa_lowp
    low = np.zeros_like(oh)
    for b in range(len(lq)):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe > qs and ke > ks:
            low[qs:qe] = ref.sdpa_lowp(qh[None, qs:qe], kh[None, ks:ke], vh[None, ks:ke], **kw)[0]
    err, base = ref.rel_error(oh, o64), ref.rel_error(low, o64)
    assert err <= _bound(base, dtype), f"error {err:.3e} > bound {_bound(base, dtype):.3e}"


@gpu
def test_public_api_and_dlpack():
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(3)
    qh, kh, vh = (_rand(rng, (2, 200, 4, 64), np.float16) for _ in range(3))
    o = A.flash_attention(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), causal=True)
    assert isinstance(o, cp.ndarray) and o.shape == qh.shape and o.dtype == np.float16
    o2, lse = A.flash_attention(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), causal=True, return_lse=True)
    assert lse.shape == (2, 4, 200) and lse.dtype == np.float32
    assert cp.array_equal(o, o2)
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x.copy()).cuda() for x in (qh, kh, vh))
    o3 = A.flash_attention(tq, tk, tv, causal=True)
    assert isinstance(o3, cp.ndarray) and cp.array_equal(o, o3)
    tb = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert A.flash_attention(tb, tb, tb).dtype == BF16


@gpu
def test_default_instances_do_not_spill():
    arch = _device.device_arch()
    for hd in A.HEAD_DIMS:
        # the short-sequence default by TMA and by cp.async (no tensor maps), and each long one (_WS_FROM's tiers)
        tiers = A._WS_FROM.get(A._WG_HEAD_DIM.get(hd), ())
        for shape, tma in ((None, True), (None, False), *(({"Sk": frm}, True) for frm, _ in tiers)):
            cfg = A.default_config(hd, arch, shape=shape)
            for dtype in ("float16", "bfloat16"):
                name = A.instance_name(dtype, hd, cfg, True, tma=tma and cfg["KIND"] != "mma")
                kern = rt.get_kernel(A.SOURCE, name)
                assert kern.attributes["local_size_bytes"] == 0, (hd, cfg, dtype, kern.attributes)
                # the launchers' fit checks allow WG_STATIC_SMEM of static shared memory beside the dynamic size
                assert kern.attributes["shared_size_bytes"] <= A.static_smem_bytes(cfg), (hd, cfg, kern.attributes)


def _sweep_configs():
    """Every launchable config (what the tuner may pick) on one masked shape; prints JSON lines."""
    out = []
    for hd in A.HEAD_DIMS:
        for vec in (True, False):
            for cfg, tma in _sweep_cases(hd, vec):
                D = hd if vec else hd - 3
                A._USE_TMA = tma
                try:
                    err, bound = run_dense(1, 150, 333, 2, 1, D, "float16", causal=True, seed=hd, config=cfg)
                    out.append({"hd": hd, "vec": vec, "tma": tma, "cfg": cfg, "err": err, "bound": bound, "ok": True})
                except AssertionError as e:
                    out.append({"hd": hd, "vec": vec, "tma": tma, "cfg": cfg, "ok": False, "why": str(e)[:200]})
    A._USE_TMA = True
    print(json.dumps(out))


def _sweep_cases(hd, vec):
    """(config, TMA loads) pairs of the sweep: wgmma configs with Q, K, V by TMA and by cp.async."""
    return [(c, t) for c in A._all_configs(hd, vec) for t in A._tma_variants(c)]


@gpu
@pytest.mark.parametrize("Sq,Sk,causal,window", [
    (512, 256, True, (-1, -1)),    # the first 192-row CTA sees no key: cnt = 0 (turn barriers never used)
    (300, 100, False, (-1, -1)),   # one key tile a CTA: cnt = 1
    (1, 128, False, (-1, -1)),     # one query row, one tile
    (600, 700, True, (200, 0)),    # causal + window: tiles masked at both ends, short CTAs
    (1000, 1000, False, (-1, -1)),
])
def test_three_warpgroup_tile(Sq, Sk, causal, window):
    """The warp-specialized tiles with three consumer warpgroups (D = 64: 192 query rows, the turn passed round
    0 -> 1 -> 2; 112 keys, the default above 2k keys, and 128, a candidate) at the edges of its turn counting:
    CTAs with no key tile, with one, masked ones."""
    if _device.device_arch() != 90:
        pytest.skip("the wgmma kernels run on sm_90 only")
    for n in (112, 128):
        for D, dtype in ((64, "float16"), (56, "bfloat16")):   # 56: columns past D zero-filled in the 64-wide tile
            run_dense(2, Sq, Sk, 4, 2, D, dtype, causal=causal, window=window, seed=Sq + D + n,
                      config=A._ws(n, wgs=3))


@gpu
@pytest.mark.parametrize("sms", [1, 3, 7])
@pytest.mark.parametrize("Sq,Sk,causal,window,softcap,D,dtype", [
    (512, 256, True, (-1, -1), 0.0, 128, "float16"),   # the last Q tiles see no key: cnt = 0 between others
    (300, 100, False, (-1, -1), 0.0, 128, "bfloat16"),  # one key tile a work tile
    (700, 700, True, (-1, -1), 5.0, 96, "float16"),     # heavy-first causal tiles, softcap, D = 96 on the 128 tile
    (600, 900, False, (150, 40), 0.0, 128, "float16"),  # a window: tiles masked at both ends
    (512, 256, True, (-1, -1), 0.0, 256, "bfloat16"),  # D = 256: O staged in Q's buffer; rows without keys
    (300, 450, False, (100, 0), 0.0, 224, "float16"),   # D = 224 on the 256 tile, a window
    (700, 700, True, (-1, -1), 0.0, 256, "float16"),
])
def test_persistent_tiles_walk_many_work_tiles(monkeypatch, sms, Sq, Sk, causal, window, softcap, D, dtype):
    """The persistent warp-specialized tile ("wsp") on a grid of `sms` CTAs, so each walks many work tiles: the
    K / V ring, Q's buffers and their barrier phases, the turn between the warpgroups and O's staging area (its
    own up to D = 128, with two Q buffers and the storer warps' hand-off; Q's buffer above) carry over from tile
    to tile (forwards and backwards rounds), through tiles with no key at all."""
    if _device.device_arch() != 90:
        pytest.skip("the wgmma kernels run on sm_90 only")
    monkeypatch.setattr(A._device, "num_sms", lambda: sms)
    run_dense(3, Sq, Sk, 4, 2, D, dtype, causal=causal, window=window, softcap=softcap, seed=Sq + sms,
              config=A._wsp(128 if D <= 128 else 64))


@gpu
@pytest.mark.parametrize("D,window", [(128, (-1, 0)), (256, (-1, 0)), (128, (200, 30))])
def test_persistent_schedule_changes_no_result(monkeypatch, D, window):
    """Under a mask the persistent tile follows the launcher's schedule; the same call walking the static rounds
    (no schedule) gives bitwise the same output and lse: a tile's arithmetic does not depend on its CTA."""
    if _device.device_arch() != 90:
        pytest.skip("the wgmma kernels run on sm_90 only")
    cp = pytest.importorskip("cupy")
    monkeypatch.setattr(A._device, "num_sms", lambda: 5)
    rng = np.random.default_rng(D)
    q, k, v = (cp.asarray(_rand(rng, (3, 700, 4, D), np.float16)) for _ in range(3))
    cfg = A._wsp(128 if D <= 128 else 64)

    def run():
        o = cp.full(q.shape, cp.nan, dtype=q.dtype)
        lse = cp.full((3, 4, 700), cp.nan, dtype=cp.float32)
        A._flash_gpu(q, k, v, causal=False, softmax_scale=None, window=window, softcap=0.0, return_lse=True,
                     out=o, lse_out=lse, config=cfg)
        return cp.asnumpy(o), cp.asnumpy(lse)

    planned = run()
    assert any(key[-1] == 5 for key in A._schedules)  # (a schedule was made for this 5-CTA grid)
    monkeypatch.setattr(A._Launch, "schedule", lambda self, *a: rt.NULL)
    static = run()
    for x, y in zip(planned, static):
        assert not np.isnan(x).any()
        np.testing.assert_array_equal(x, y)


@gpu
def test_every_config_subprocess():
    """Every candidate the tuner may pick is correct; in a subprocess, so an illegal address cannot poison the
    CUDA context of the rest of the suite."""
    code = "import sys; sys.path.insert(0, 'tests'); import test_attention as t; t._sweep_configs()"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert len(rows) == sum(len(_sweep_cases(hd, v)) for hd in A.HEAD_DIMS for v in (True, False))


# ---- CPU: argument errors before launch, dispatch, tables -----------------------------------------------------
def _np(shape, dtype=np.float16):
    return np.zeros(shape, dtype=dtype)


BAD_DENSE = [
    (dict(q=_np((2, 8, 4))), ValueError, "q: expected a 4-d"),
    (dict(k=_np((2, 8, 2, 32))), ValueError, "D == q's 64"),
    (dict(k=_np((2, 8, 2, 64), np.float32)), TypeError, "same dtype"),
    (dict(k=_np((2, 8, 3, 64)), v=_np((2, 8, 3, 64))), ValueError, "divides"),
    (dict(q=_np((2, 8, 4, 300)), k=_np((2, 8, 2, 300)), v=_np((2, 8, 2, 300))), ValueError, "from 1 to 256"),
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(window=(3,)), TypeError, "window"),
    (dict(v=_np((2, 9, 2, 64))), ValueError, "v: expected the shape of k"),
    (dict(q=_np((0, 8, 4, 64))), ValueError, "non-empty"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(causal="yes"), TypeError, "causal"),
]


@pytest.mark.parametrize("bad,exc,match", BAD_DENSE)
def test_bad_dense_inputs(bad, exc, match):
    args = dict(q=_np((2, 8, 4, 64)), k=_np((2, 8, 2, 64)), v=_np((2, 8, 2, 64)))
    kw = {n: bad[n] for n in ("window", "softcap", "softmax_scale", "causal") if n in bad}
    args.update({n: bad[n] for n in ("q", "k", "v") if n in bad})
    with pytest.raises(exc, match=match):  # the reference path (NumPy inputs)
        A.flash_attention(args["q"], args["k"], args["v"], **kw)
    with pytest.raises(exc, match=match):  # the GPU path's checks, which run before anything touches the GPU
        A._check_dense(args["q"], args["k"], args["v"], causal=kw.get("causal", False),
                       softmax_scale=kw.get("softmax_scale"), window=kw.get("window", (-1, -1)),
                       softcap=kw.get("softcap", 0.0), return_lse=False)


def test_gpu_path_rejects_float32():
    q = _np((1, 8, 2, 64), np.float32)
    with pytest.raises(TypeError, match="float16"):
        A._check_dense(q, q, q, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False)


BAD_VARLEN = [
    (dict(cu_q=np.array([0, 4, 8], np.int64)), TypeError, "int32"),
    (dict(cu_q=np.array([0, 6, 5], np.int32)), ValueError, "non-decreasing"),
    (dict(cu_q=np.array([0, 4, 7], np.int32)), ValueError, "packed length"),
    (dict(cu_k=np.array([0, 4], np.int32)), ValueError, "offsets"),
    (dict(max_seqlen_q=2), ValueError, "longest"),
    (dict(q=_np((8, 4, 64, 1))), ValueError, "3-d"),
]


@pytest.mark.parametrize("bad,exc,match", BAD_VARLEN)
def test_bad_varlen_inputs(bad, exc, match):
    a = dict(q=_np((8, 4, 64)), k=_np((10, 2, 64)), v=_np((10, 2, 64)), cu_q=np.array([0, 4, 8], np.int32),
             cu_k=np.array([0, 3, 10], np.int32), max_seqlen_q=None)
    a.update(bad)
    with pytest.raises(exc, match=match):
        A.flash_attention_varlen(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], max_seqlen_q=a["max_seqlen_q"])
    with pytest.raises(exc, match=match):
        A._check_varlen(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], max_seqlen_q=a["max_seqlen_q"],
                        max_seqlen_k=None, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                        return_lse=False)


def test_numpy_inputs_run_the_reference():
    rng = np.random.default_rng(0)
    q, k, v = _rand(rng, (1, 37, 4, 40), np.float16), _rand(rng, (1, 50, 2, 40), np.float16), \
        _rand(rng, (1, 50, 2, 40), np.float16)
    o, lse = A.flash_attention(q, k, v, causal=True, return_lse=True)
    o_ref, lse_ref = ref.flash_attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(o, np.ndarray) and np.array_equal(o, o_ref) and np.array_equal(lse, lse_ref)
    cu = np.array([0, 37], np.int32)
    cuk = np.array([0, 50], np.int32)
    ov = A.flash_attention_varlen(q[0], k[0], v[0], cu, cuk, causal=True)
    assert np.array_equal(ov, o_ref[0])


def test_tuning_bucket_counts_batch_and_heads():
    """Tiles tuned on a small batch must not be reused for a large one (they ran 0.67x there on an H200)."""
    small = A._bucket({"Sq": 4096, "Sk": 4096, "masked": 0, "BH": 2, "SMS": 132})
    large = A._bucket({"Sq": 4096, "Sk": 4096, "masked": 0, "BH": 128, "SMS": 132})
    assert small != large
    assert A._bucket({"Sq": 4000, "Sk": 4096, "masked": 0, "BH": 100, "SMS": 132}) == large
    # tune()'s standard shapes give B and H; with no SMS the current device's count is used
    assert A._bucket({"Sq": 1024, "Sk": 1024, "masked": 1, "B": 16, "H": 16, "SMS": 132})[-1] == 16


def test_tuning_bucket_is_relative_to_the_sm_count():
    """B x H in eighths of the SM count, pow2, clamped to [1, 16]: one (b, h) pair per SM is bucket 8."""
    assert [A.bh_bucket(bh, 132) for bh in (1, 16, 17, 33, 34, 66, 67, 132, 133, 264, 100000)] == \
        [1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 16]
    # the same B x H is a full wave on a small GPU and a fraction of one on a large one
    assert A.bh_bucket(64, 132) == 4 and A.bh_bucket(64, 64) == 8 and A.bh_bucket(64, 16) == 16
    shape = {"Sq": 2048, "Sk": 2048, "masked": 0, "BH": 64}
    assert A._bucket({**shape, "SMS": 132}) != A._bucket({**shape, "SMS": 16})
    assert A._bucket({**shape, "SMS": 132})[:3] == (2048, 2048, 0)


def test_tuning_bucket_takes_the_sm_count_from_the_device(monkeypatch):
    """Without SMS in the shape (tune()'s standard shapes) the bucket asks the tuner's device info."""
    from vbw_cupy import autotune
    monkeypatch.setattr(autotune, "_device_info", lambda: {"limits": {"num_sms": 16}})
    assert A._bucket({"Sq": 1024, "Sk": 1024, "masked": 0, "BH": 64})[-1] == 16
    monkeypatch.setattr(autotune, "_device_info", lambda: {"limits": {"num_sms": 132}})
    assert A._bucket({"Sq": 1024, "Sk": 1024, "masked": 0, "BH": 64})[-1] == 4

    def no_device():
        raise RuntimeError("no GPU")
    monkeypatch.setattr(autotune, "_device_info", no_device)
    assert A._bucket({"Sq": 1024, "Sk": 1024, "masked": 0, "BH": 64})[-1] == 4  # an H100's 132


def _fast_div(a, d, m):
    """attention_mask.cuh's fast_div, in Python: the kernels' division of a CTA index by a launch constant."""
    if m == 0:
        return a
    q = (a * m) >> 32
    return q - 1 if (q * d) & 0xFFFFFFFF > a else q


def test_cta_division_multipliers_are_exact():
    """The launcher's multipliers (_div_magic) give floor(a / d) for every a, d < 2^31 the CTA mapping can meet."""
    rng = np.random.default_rng(0)
    top = (1 << 31) - 1
    ds = [1, 2, 3, 5, 7, 31, 32, 33, 127, 4096, 65535, 65536, 65537, 1 << 30, (1 << 30) + 1, top - 1, top]
    ds += [int(x) for x in rng.integers(1, 5000, 200)] + [int(x) for x in rng.integers(1, top, 200)]
    for d in ds:
        m = int(A._div_magic(d))
        As = {0, 1, d - 1, d, d + 1, top, top - 1, (top // d) * d, (top // d) * d - 1}
        As |= {int(x) for x in rng.integers(0, top, 50)} | {d * int(k) + int(r) for k, r in
                                                              zip(rng.integers(0, top // d + 1, 20),
                                                                  rng.integers(-1, 2, 20))}
        for a in sorted(x for x in As if 0 <= x <= top):
            assert _fast_div(a, d, m) == a // d, (a, d, m)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_cta_sections_with_a_short_last_one(monkeypatch, D, causal):
    """CTA index -> (section, Q tile, b, h) through the multipliers, with sections of 4 (b, h) pairs and a last one
    of 2 (its division is the plain one): a tiny 'L2' makes the launcher cut 18 pairs that way."""
    kv_bytes = 2 * 300 * D * 2
    monkeypatch.setattr(A, "_l2_bytes", lambda: 2 * 2 * kv_bytes)  # 2 KV heads a section = 4 query heads
    cp = pytest.importorskip("cupy")
    q, k = cp.zeros((3, 300, 6, D), cp.float16), cp.zeros((3, 300, 3, D), cp.float16)
    assert A._Launch.dense(q, k, k, scale=1.0, window=(-1, -1), softcap=0.0, out=q, lse=None).sect_heads == 4
    err, bound = run_dense(3, 300, 300, 6, 3, D, "float16", causal=causal, seed=D)
    assert err <= bound, (err, bound)


def test_head_dim_bucket():
    assert [A.head_dim_bucket(d) for d in (1, 32, 33, 59, 64, 65, 111, 128, 129, 200, 256)] == \
        [32, 32, 64, 64, 64, 96, 128, 128, 160, 224, 256]
    with pytest.raises(ValueError):
        A.head_dim_bucket(257)


# Max dynamic shared memory per block after opt-in (bytes).
SMEM_OPTIN = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def test_tile_tables():
    for hd in A.HEAD_DIMS:
        for arch, limit in SMEM_OPTIN.items():
            cfg = A.default_config(hd, arch)
            assert A.smem_bytes(hd, cfg) <= limit, (hd, arch, cfg)
        for cfg in A._all_configs(hd, True):
            assert cfg["BLOCK_M"] % (16 * A._row_warps(cfg)) == 0 and cfg["BLOCK_N"] % 16 == 0, cfg
            assert A.smem_bytes(hd, cfg) + A.static_smem_bytes(cfg) <= SMEM_OPTIN[90], (hd, cfg)
    names = {n for _, n in A.kernel_instances()}
    for hd in A.HEAD_DIMS:
        for arch in SMEM_OPTIN:
            for vec in (True, False):
                for dt in ("float16", "bfloat16"):
                    assert A.instance_name(dt, hd, A.default_config(hd, arch, vec), vec) in names


def _tile_costs(num_m, pairs, sect, sq, sk, left, right, bm, bn):
    """Per work tile, cta_info's order and tile_range's key tiles, one tile at a time (attention_mask.cuh)."""
    costs = []
    for w in range(num_m * pairs):
        sec, r = divmod(w, sect * num_m)
        size = min(sect, pairs - sec * sect)
        m0 = (num_m - 1 - r // size) * bm
        rows = min(bm, sq - m0)
        lo_base = m0 + sk - sq - left if left >= 0 else -2**30
        hi_base = m0 + sk - sq + right + 1 if right >= 0 else 2**30
        lo, hi = max(0, lo_base), min(sk, hi_base + rows - 1)
        costs.append((-(-hi // bn) - lo // bn if hi > lo else 0) + A._TILE_OVERHEAD)
    return costs


@pytest.mark.parametrize("num_m,pairs,sect,sq,sk,left,right,bm,bn,ctas", [
    (4, 1024, 100, 512, 512, -1, 0, 128, 128, 132),      # D = 128, S = 512 causal (B * S = 32k, H = 16)
    (16, 256, 24, 2048, 2048, -1, 0, 128, 128, 132),     # S = 2k causal
    (128, 16, 1, 16384, 16384, -1, 0, 128, 64, 132),     # D = 256, S = 16k causal: one head a section
    (3, 5, 2, 300, 1000, 100, 5, 128, 64, 7),             # a window, Sk > Sq, a short last section, 7 CTAs
    (2, 3, 3, 200, 150, -1, 0, 128, 128, 11),             # fewer tiles than CTAs: no schedule
    (2, 9, 3, 200, 150, -1, 0, 128, 128, 5),              # Sq > Sk: tiles with no key
    (1, 300, 100, 1, 4000, -1, 0, 128, 128, 132),         # a decode step (one query row): all alike, no schedule
])
def test_persistent_schedule(num_m, pairs, sect, sq, sk, left, right, bm, bn, ctas):
    """The persistent tile's schedule under a mask runs every work tile once, round r exactly the tiles of the
    kernel's static round r, and ends no later than the static alternating rounds by the same cost model (and
    within one tile of the average where there are many tiles a CTA)."""
    sched = A._persistent_schedule(num_m, pairs, sect, sq, sk, left, right, bm, bn, ctas)
    total = num_m * pairs
    rounds = -(-total // ctas)
    cost = _tile_costs(num_m, pairs, sect, sq, sk, left, right, bm, bn)
    if rounds == 1 or min(cost) == max(cost):  # the static rounds are as even: no schedule
        assert sched is None
        return
    assert sched.dtype == np.int32 and sched.shape == (rounds + 1, ctas)
    assert (sched[-1] == -1).all()
    for r in range(rounds):
        row = sched[r]
        assert sorted(row[row >= 0].tolist()) == list(range(r * ctas, min(total, (r + 1) * ctas)))
    load = [sum(cost[w] for w in sched[:, c] if w >= 0) for c in range(ctas)]
    static = [0.0] * ctas
    for r in range(rounds):
        for c in range(ctas):
            w = r * ctas + (ctas - 1 - c if r % 2 else c)
            if w < total:
                static[c] += cost[w]
    assert max(load) <= max(static) + 1e-9
    if rounds >= 4:
        assert max(load) <= sum(cost) / ctas + max(cost), (max(load), sum(cost) / ctas)


def test_wgmma_kernel_only_where_it_can_run():
    """The wgmma kernel is the sm_90 default for aligned inputs of head dims above 32; never elsewhere
    (a wgmma on another target is an illegal instruction), and the tuner may not time it elsewhere."""
    for hd in A.HEAD_DIMS:
        assert (A.default_config(hd, 90)["KIND"] != "mma") == (hd != 32)
        for arch in (80, 86, 89, 100, 120):
            assert A.default_config(hd, arch)["KIND"] == "mma", (hd, arch)
        assert A.default_config(hd, 90, vec=False)["KIND"] == "mma"
        assert all(c["KIND"] == "mma" for c in A._all_configs(hd, False))
        fits = A._fits(hd)
        lim = {"arch": 100, "max_threads": 1024, "smem_optin": 232448}
        assert not any(fits(c, lim) for c in A._all_configs(hd, True) if c["KIND"] != "mma")
        # on sm_90 the tuner times the wgmma configs only where that kernel runs, the mma.sync ones elsewhere
        hopper = dict(lim, arch=90)
        timed = [c for c in A._all_configs(hd, True) if fits(c, hopper)]
        assert timed and all((c["KIND"] != "mma") == (hd != 32) for c in timed), (hd, timed)
        # every wgmma config compiles for a wgmma width (64 / 128 / 192 / 256) at or above the bucket
        for c in A._all_configs(hd, True):
            if c["KIND"] != "mma":
                name = A.instance_name("float16", hd, c, True, True)
                wd = int(name.split(",")[1])
                assert wd in (64, 128, 192, 256) and hd <= wd, name
        from vbw_cupy import autotune as at
        for arch in (100, 120):  # the tuner's default above sm_90 is a runnable (mma) config
            assert at.default_config(A._tunable_name(hd), arch)["KIND"] == "mma", (hd, arch)
    with pytest.raises(ValueError, match="aligned"):
        A.instance_name("float16", 64, A.default_config(64, 90), vec=False)


def test_wgmma_config_falls_back_where_it_cannot_run(monkeypatch):
    """An explicit wgmma config (config= / the sweep) at a head dim the wgmma kernel does not cover (<= 32), on
    unaligned inputs or off sm_90 runs the mma.sync default instead of failing or launching wgmma."""
    wg = A._wg(128)
    monkeypatch.setattr(A._device, "device_arch", lambda: 90)
    assert A._runnable(128, wg, True) is wg
    assert A._runnable(32, wg, True) == A.default_config(32, 90, vec=False)
    assert A._runnable(128, wg, False) == A.default_config(128, 90, vec=False)
    monkeypatch.setattr(A._device, "device_arch", lambda: 80)
    assert A._runnable(128, wg, True) == A.default_config(128, 80, vec=False)
    assert all(A._runnable(hd, wg, True)["KIND"] == "mma" for hd in A.HEAD_DIMS)


# ---------------------------------------------------------------- NaN rules on the GPU (docs/nan.md)
# What the kernels meet of the reference's rules (tests/test_reference_attention.py): a NaN query row is NaN
# alone, every row that sees a bad key is NaN, and rows whose query tile never loads it stay bit-identical to a
# clean run (dense, varlen, block-sparse, paged). Rows that share a key tile with a masked bad key may be NaN
# (their p = 0 times Inf or NaN): docs/nan.md states the guarantee per tile, and these tests hold it to that.

@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])   # (the lock-step and the warp-specialized kernel on sm_90)
def test_gpu_nan_query_row_and_far_rows(D):
    cp = rt.require_cupy()
    rng = np.random.default_rng(41)
    q, k, v = (_rand(rng, (1, 1024, 2, D), np.float16), _rand(rng, (1, 1024, 1, D), np.float16),
               _rand(rng, (1, 1024, 1, D), np.float16))
    q[0, 5, 1, 3] = np.nan
    o, lse = A.flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True)
    o, lse = o.get(), lse.get()
    assert np.isnan(o[0, 5, 1]).all() and np.isnan(lse[0, 1, 5])
    assert np.isfinite(np.delete(o[0, :, 1], 5, axis=0)).all() and np.isfinite(o[0, :, 0]).all()
    q[0, 5, 1, 3] = 0
    clean = A.flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True).get()
    v[0, 600, 0, 3] = np.nan
    o = A.flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True).get()
    assert np.isnan(o[0, 600:]).any(axis=(1, 2)).all()          # every row that sees key 600
    np.testing.assert_array_equal(o[0, :256], clean[0, :256])  # query tiles that never load it


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_varlen_nan_stays_in_its_sequence(D):
    """Packed sequences: a NaN query row is NaN alone; a NaN value of one sequence makes that sequence's rows
    that see it NaN and leaves every other sequence bit-identical to a clean run."""
    cp = rt.require_cupy()
    rng = np.random.default_rng(43)
    lens = [300, 517, 129]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1])
    q, k, v = (_rand(rng, (T, 4, D), np.float16), _rand(rng, (T, 2, D), np.float16), _rand(rng, (T, 2, D), np.float16))
    run = lambda q, v: A.flash_attention_varlen(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(cu),
                                                cp.asarray(cu), causal=True).get()
    clean = run(q, v)
    q2 = q.copy()
    q2[cu[1] + 40, 3, 7] = np.nan
    o = run(q2, v)
    bad = np.zeros(T, bool)
    bad[cu[1] + 40] = True
    assert np.isnan(o[cu[1] + 40, 3]).all() and np.isfinite(o[cu[1] + 40, :3]).all()
    np.testing.assert_array_equal(o[~bad], clean[~bad])
    v2 = v.copy()
    v2[cu[1] + 200, 1, 5] = np.nan                     # kv head 1 = query heads 2, 3; key 200 of sequence 1
    o = run(q, v2)
    seq1 = o[cu[1]:cu[2]]
    assert np.isnan(seq1[200:, 2:]).any(axis=-1).all()  # every row of sequence 1 that sees key 200
    np.testing.assert_array_equal(seq1[:128], clean[cu[1]:cu[1] + 128])   # query tiles that never load it
    np.testing.assert_array_equal(o[:cu[1]], clean[:cu[1]])
    np.testing.assert_array_equal(o[cu[2]:], clean[cu[2]:])
    # sequence 1's first tokens sit in the key tile that ends sequence 0 (tokens 256 .. 383 of the packed
    # array): sequence 0 reads that tile and must not see them (masked in S, zeroed in V)
    k3, v3 = k.copy(), v.copy()
    k3[cu[1] + 3, :, 1] = np.nan
    v3[cu[1] + 5, :, 2] = np.inf
    o = A.flash_attention_varlen(cp.asarray(q), cp.asarray(k3), cp.asarray(v3), cp.asarray(cu), cp.asarray(cu),
                                 causal=True).get()
    np.testing.assert_array_equal(o[:cu[1]], clean[:cu[1]])
    assert (~np.isfinite(o[cu[1] + 5:cu[2]])).any(axis=-1).all()  # sequence 1's rows that see keys 3 and 5
    np.testing.assert_array_equal(o[cu[2]:], clean[cu[2]:])


@pytest.mark.gpu
def test_gpu_block_sparse_nan_reaches_only_the_blocks_that_keep_it():
    """A NaN key in key block j reaches the query blocks whose list holds j (every row of them, non-causal) and
    no other: those are bit-identical to a clean run."""
    cp = rt.require_cupy()
    from vbw_cupy import sparse
    rng = np.random.default_rng(47)
    S, D = 1024, 128
    q, k, v = (_rand(rng, (1, S, 2, D), np.float16) for _ in range(3))
    mask = rng.random((S // 128, S // 128)) < 0.4
    mask[:, 3] = False
    mask[[1, 6], 3] = True                                # key block 3: query blocks 1 and 6 only
    indptr, indices = (cp.asarray(a) for a in sparse.bsr_from_mask(mask))
    run = lambda k: sparse.block_sparse_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), indptr, indices,
                                                  block_q=128, block_k=128).get()
    clean = run(k)
    k2 = k.copy()
    k2[0, 3 * 128 + 17, 1, 9] = np.nan
    o = run(k2)
    for qb in range(S // 128):
        rows = slice(qb * 128, (qb + 1) * 128)
        if qb in (1, 6):
            assert np.isnan(o[0, rows, 1]).all(), qb
            np.testing.assert_array_equal(o[0, rows, 0], clean[0, rows, 0])
        else:
            np.testing.assert_array_equal(o[0, rows], clean[0, rows])


@pytest.mark.gpu
def test_gpu_paged_nan_reaches_only_the_sequences_that_read_it():
    """A NaN in a cache block reaches the sequences whose block table lists it (within their length) and no
    other; a NaN query row is NaN alone."""
    cp = rt.require_cupy()
    from vbw_cupy import paged
    rng = np.random.default_rng(53)
    nb, bs, Hkv, D = 64, 16, 2, 128
    kc, vc = (_rand(rng, (nb, bs, Hkv, D), np.float16) for _ in range(2))
    q = _rand(rng, (4, 8, D), np.float16)
    table = rng.permutation(nb)[:4 * 16].reshape(4, 16).astype(np.int32)
    lens = np.array([200, 37, 256, 100], np.int32)
    run = lambda q, vc: paged.paged_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cp.asarray(table),
                                              cp.asarray(lens)).get()
    clean = run(q, vc)
    vc2 = vc.copy()
    vc2[table[2, 5], 3, 0, 11] = np.nan                  # sequence 2, token 83: kv head 0 = query heads 0-3
    o = run(q, vc2)
    assert np.isnan(o[2, :4]).any(axis=-1).all() and np.isfinite(o[2, 4:]).all()
    for b in (0, 1, 3):
        np.testing.assert_array_equal(o[b], clean[b])
    q2 = q.copy()
    q2[1, 6, 0] = np.nan
    o = run(q2, vc)
    assert np.isnan(o[1, 6]).all()
    rest = np.ones((4, 8), bool)
    rest[1, 6] = False
    np.testing.assert_array_equal(o[rest], clean[rest])


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [None, 1e6, 2.0 ** 64])
def test_gpu_huge_scores_stay_finite(scale):
    """Scores far past 2^24 (large fp16 inputs, or a huge softmax_scale): the softmax subtracts the row max before
    scaling, so the largest score's weight is exactly 1, never the rounding error of a product (an infinite
    weight and a NaN row before). The output equals the float64 reference (softmax nearly one-hot)."""
    import cupy as cp
    rng = np.random.default_rng(21)
    q, k, v = (rng.standard_normal((1, 64, 2, 64)).astype(np.float16) for _ in range(3))
    q, k = q * np.float16(300.0), k * np.float16(300.0)        # dot products ~1e6-1e7
    for causal in (False, True):
        o = A.flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal,
                               softmax_scale=scale).get().astype(np.float32)
        want = ref.flash_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                   causal=causal, softmax_scale=scale)
        assert np.isfinite(o).all()
        np.testing.assert_allclose(o, want, atol=2e-2, rtol=2e-2)


def test_long_sequences_default_to_the_warp_specialized_tiles():
    """On sm_90 the default follows the key length (_WS_FROM): the lock-step "wg" tiles below the first threshold,
    each tier's warp-specialized "ws" / "wsp" tile from its threshold on; every such default is a compiled instance,
    and other archs and the element-wise path never see one."""
    names = {n for _, n in A.kernel_instances(arch=90)}
    for hd in A._WG_DEFAULTS:
        tiers = A._WS_FROM.get(A._WG_HEAD_DIM[hd], ())
        short = A.default_config(hd, 90)   # without a shape: the lock-step tile (also the TMA-less fallback)
        assert short["KIND"] == "wg"
        if not tiers:
            assert A.default_config(hd, 90, shape={"Sk": 1 << 20}) == short
            continue
        assert [f for f, _ in tiers] == sorted({f for f, _ in tiers}), tiers  # ascending, distinct
        # thresholds inside the tuning bucket's range, on its powers of two (frm == 1: every length)
        assert all(f == 1 or (64 <= f <= 16384 and f & (f - 1) == 0) for f, _ in tiers), tiers
        assert A.default_config(hd, 90, shape={"Sk": 1 << 20}) == tiers[-1][1]  # past the last bucket: the last tier
        before = short
        for frm, ws in tiers:
            if frm > 1:   # (by the power of two at or above Sk: frm / 2 + 1 .. frm is one tuning bucket)
                assert A.default_config(hd, 90, shape={"Sk": frm // 2}) == before
                assert A.default_config(hd, 90, shape={"Sk": frm // 2 + 1}) == ws
            long = A.default_config(hd, 90, shape={"Sk": frm})
            assert long == ws and long["KIND"] in ("ws", "wsp"), (hd, long)
            before = ws
            from vbw_cupy import autotune as at
            assert at.default_config(A._tunable_name(hd), 90, {"Sk": frm, "Sq": 1, "masked": 0}) == long
            assert A.instance_name("float16", hd, long, True, tma=True) in names
            # without tensor maps the producer cannot load: the name is the lock-step default's
            assert A.instance_name("float16", hd, long, True, tma=False) == A.instance_name("float16", hd, short, True)
            for arch in (80, 86, 89):
                assert A.default_config(hd, arch, shape={"Sk": frm})["KIND"] == "mma"
            assert A.default_config(hd, 90, vec=False, shape={"Sk": frm})["KIND"] == "mma"
