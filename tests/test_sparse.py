"""block_sparse_attention / bsr_from_mask: the float64 reference against a dense masked softmax (CPU), and the GPU
kernel against the reference with SPEC section 7's attention bound (tests/test_attention.py's rule: at most 2x
the error of the same-dtype computation with float32 softmax, and at most 2e-3 fp16 / 1e-2 bf16). GPU outputs
are NaN-prefilled, so an unwritten element fails.
"""
import ml_dtypes
import numpy as np
import pytest

import vbw_cupy
from vbw_cupy import _runtime as rt
from vbw_cupy import reference as ref
from vbw_cupy import sparse as SP

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}
CAP = {"float16": 2e-3, "bfloat16": 1e-2}
gpu = pytest.mark.gpu


def _rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _pattern(rng, B, Hkv, nqb, nkb, density, *, per_pattern=False, empty_rows=0, causal=False):
    """(mask, indptr, indices): a random block mask (shared, or [B, Hkv, ...]) with `empty_rows` rows cleared."""
    lead = (B, Hkv) if per_pattern else ()
    mask = rng.random(lead + (nqb, nkb)) < density
    if causal:  # keep the diagonal so most rows see something
        mask[..., np.arange(nqb), np.minimum(np.arange(nqb) * nkb // nqb, nkb - 1)] = True
    if empty_rows:
        mask[..., rng.choice(nqb, size=min(empty_rows, nqb), replace=False), :] = False
    indptr, indices = SP.bsr_from_mask(mask)
    return mask, indptr, indices


def _shuffle_rows(rng, indptr, indices):
    """The same pattern with each row's block ids in random order (the API does not require sorted rows)."""
    indices = indices.copy()
    ptr = indptr.reshape(-1, indptr.shape[-1])
    idx = indices.reshape(ptr.shape[0], -1)
    for p in range(ptr.shape[0]):
        for a, e in zip(ptr[p, :-1], ptr[p, 1:]):
            idx[p, a:e] = rng.permutation(idx[p, a:e])
    return indptr, indices


def _dense_masked(q, k, v, mask, block_q, block_k, causal, scale=None, softcap=0.0):
    """An independent float64 computation: expand the block mask to [.., Sq, Sk] and softmax densely."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = 1 / np.sqrt(D) if scale is None else scale
    full = np.repeat(np.repeat(mask, block_q, axis=-2), block_k, axis=-1)[..., :Sq, :Sk]
    full = np.broadcast_to(full, (B, Hkv, Sq, Sk)) if full.ndim == 4 else np.broadcast_to(full, (B, Hkv, Sq, Sk))
    full = np.repeat(full, g, axis=1)                                           # [B, Hq, Sq, Sk]
    if causal:
        full = full & (np.arange(Sk)[None, :] <= np.arange(Sq)[:, None])
    qq = q.astype(np.float64).transpose(0, 2, 1, 3)
    kk = np.repeat(k.astype(np.float64), g, axis=2).transpose(0, 2, 1, 3)
    vv = np.repeat(v.astype(np.float64), g, axis=2).transpose(0, 2, 1, 3)
    s = qq @ kk.transpose(0, 1, 3, 2) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    s = np.where(full, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    o = np.divide(p @ vv, l, out=np.zeros(qq.shape), where=l > 0)
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1)), -np.inf)
    return o.transpose(0, 2, 1, 3), lse


# ---------------------------------------------------------------------------------------------- CPU: patterns
def test_bsr_from_mask_shared_and_per_head():
    rng = np.random.default_rng(0)
    mask = rng.random((7, 5)) < 0.4
    mask[3] = False
    indptr, indices = SP.bsr_from_mask(mask)
    assert indptr.dtype == indices.dtype == np.int32 and indptr.shape == (8,) and indices.shape == (35,)
    for i in range(7):
        assert indices[indptr[i]:indptr[i + 1]].tolist() == np.flatnonzero(mask[i]).tolist()
    assert (indices[indptr[-1]:] == 0).all()
    m4 = rng.random((2, 3, 4, 6)) < 0.5
    p4, i4 = SP.bsr_from_mask(m4)
    assert p4.shape == (2, 3, 5) and i4.shape == (2, 3, 24)
    for b in range(2):
        for h in range(3):
            assert np.array_equal(SP.bsr_from_mask(m4[b, h])[0], p4[b, h])
            assert np.array_equal(SP.bsr_from_mask(m4[b, h])[1], i4[b, h])


def test_bsr_from_mask_rejects(monkeypatch):
    for cupy in (rt.cupy, None):  # what is no array is a TypeError naming `mask`, CuPy installed or not
        monkeypatch.setattr(rt, "cupy", cupy)
        with pytest.raises(TypeError, match="mask"):
            SP.bsr_from_mask([[True]])
    monkeypatch.undo()
    with pytest.raises(TypeError, match="mask: expected a boolean"):
        SP.bsr_from_mask(np.ones((2, 2), np.int32))
    with pytest.raises(ValueError, match="mask: expected a 2-d"):
        SP.bsr_from_mask(np.ones((2, 2, 2), bool))
    for shape in ((0, 3), (3, 0), (0, 1, 2, 2)):   # (NumPy's reshape error named nothing)
        with pytest.raises(ValueError, match=r"mask: expected at least one query block"):
            SP.bsr_from_mask(np.ones(shape, bool))


# ---------------------------------------------------------------------------------------------- CPU: reference
@pytest.mark.parametrize("density", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_q,block_k", [(64, 16), (16, 64), (128, 128), (64, 128)])
def test_reference_matches_dense_masked(density, causal, block_q, block_k):
    rng = np.random.default_rng(int(density * 100) + 7 * causal + block_q + block_k)
    B, Sq, Sk, Hq, Hkv, D = 2, 333, 333 if causal else 517, 4, 2, 24   # padded edges, GQA
    q, k, v = _rand(rng, (B, Sq, Hq, D)), _rand(rng, (B, Sk, Hkv, D)), _rand(rng, (B, Sk, Hkv, D))
    nqb, nkb = -(-Sq // block_q), -(-Sk // block_k)
    mask, indptr, indices = _pattern(rng, B, Hkv, nqb, nkb, density, empty_rows=1, causal=causal)
    indptr, indices = _shuffle_rows(rng, indptr, indices)
    o, lse = vbw_cupy.block_sparse_attention(q, k, v, indptr, indices, block_q=block_q, block_k=block_k,
                                             causal=causal, return_lse=True)
    o64, lse64 = _dense_masked(q, k, v, mask, block_q, block_k, causal)
    assert o.dtype == np.float32 and lse.shape == (B, Hq, Sq)
    assert np.allclose(o, o64, atol=1e-6, rtol=1e-5)
    assert np.array_equal(np.isfinite(lse), np.isfinite(lse64))
    seen = np.isfinite(lse64)
    assert np.allclose(lse[seen], lse64[seen], atol=1e-5)
    assert (o.transpose(0, 2, 1, 3)[~seen] == 0).all(), "a row that sees no key is 0"


def test_reference_per_pattern_layout_and_softcap():
    rng = np.random.default_rng(3)
    B, S, Hq, Hkv, D = 2, 200, 6, 3, 16
    q, k, v = _rand(rng, (B, S, Hq, D)), _rand(rng, (B, S, Hkv, D)), _rand(rng, (B, S, Hkv, D))
    mask, indptr, indices = _pattern(rng, B, Hkv, 4, 13, 0.3, per_pattern=True, empty_rows=1)
    assert indptr.shape == (B, Hkv, 5)
    o = vbw_cupy.block_sparse_attention(q, k, v, indptr, indices, block_q=64, block_k=16, softcap=5.0,
                                        softmax_scale=0.3)
    o64, _ = _dense_masked(q, k, v, mask, 64, 16, False, scale=0.3, softcap=5.0)
    assert np.allclose(o, o64, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_full_pattern_is_dense_attention(causal):
    rng = np.random.default_rng(5)
    B, S, Hq, Hkv, D = 1, 300, 4, 1, 32
    q, k, v = _rand(rng, (B, S, Hq, D)), _rand(rng, (B, S, Hkv, D)), _rand(rng, (B, S, Hkv, D))
    indptr, indices = SP.bsr_from_mask(np.ones((-(-S // 128), -(-S // 64)), bool))
    o, lse = vbw_cupy.block_sparse_attention(q, k, v, indptr, indices, block_q=128, block_k=64, causal=causal,
                                             return_lse=True)
    o2, lse2 = ref.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert np.allclose(o, o2, rtol=0, atol=1e-6) and np.allclose(lse, lse2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_and_inf_reach_exactly_the_rows_that_see_them(causal):
    # docs/nan.md rule 1 on the reference: a NaN key / query or an Inf value reaches the rows that see it, and
    # only those, as in flash_attention (the block-sparse reference once turned a NaN row into 0 / -inf and
    # spread 0 * Inf to rows that cannot see the key)
    rng = np.random.default_rng(6)
    B, S, Hq, Hkv, D = 1, 96, 2, 1, 16
    q, k, v = _rand(rng, (B, S, Hq, D)), _rand(rng, (B, S, Hkv, D)), _rand(rng, (B, S, Hkv, D))
    k[0, 40, 0, 3], q[0, 7, 1, 0], v[0, 70, 0, 5] = np.nan, np.nan, np.inf
    indptr, indices = SP.bsr_from_mask(np.ones((S // 16, S // 16), bool))
    with np.errstate(all="raise"):  # (and quietly: no RuntimeWarning)
        o, lse = vbw_cupy.block_sparse_attention(q, k, v, indptr, indices, block_q=16, block_k=16, causal=causal,
                                                 return_lse=True)
    o2, lse2 = ref.flash_attention(q, k, v, causal=causal, return_lse=True)
    for f in (np.isnan, np.isinf):
        np.testing.assert_array_equal(f(o), f(o2))
        np.testing.assert_array_equal(f(lse), f(lse2))
    assert np.isnan(o[0, 7, 1]).all() and np.isnan(lse[0, 1, 7])
    if causal:   # rows before key 40 see no bad key (but row 7's NaN query)
        assert np.isfinite(np.delete(o[0, :40], 7, axis=0)).all()
    ok = np.isfinite(o2)
    assert np.allclose(o[ok], o2[ok], rtol=0, atol=1e-6)


def test_lowp_baseline_is_close():
    rng = np.random.default_rng(9)
    q, k, v = (_rand(rng, (1, 256, 2, 64), np.float16) for _ in range(3))
    _, indptr, indices = _pattern(rng, 1, 1, 4, 4, 0.5, causal=True)
    kw = dict(block_q=64, block_k=64, causal=True)
    o64 = ref.block_sparse_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), indptr,
                                     indices, **kw)
    low = ref.block_sparse_attention(q, k, v, indptr, indices, lowp=True, **kw)
    assert 0 < ref.rel_error(low.astype(np.float32), o64) < 2e-3


# ---------------------------------------------------------------------------------------------- CPU: argument checks
def _args(rng=None, Sq=200, Sk=200):
    rng = rng or np.random.default_rng(0)
    q, k, v = _rand(rng, (1, Sq, 2, 16)), _rand(rng, (1, Sk, 1, 16)), _rand(rng, (1, Sk, 1, 16))
    indptr, indices = SP.bsr_from_mask(np.ones((-(-Sq // 64), -(-Sk // 64)), bool))
    return q, k, v, indptr, indices


def _bad(what):
    q, k, v, indptr, indices = _args()
    kw = dict(block_q=64, block_k=64)
    if what == "block id":
        indices = indices.copy(); indices[3] = 4
    elif what == "negative id":
        indices = indices.copy(); indices[0] = -1
    elif what == "decreasing":
        indptr = indptr.copy(); indptr[2] = indptr[1] - 1
    elif what == "start":
        indptr = indptr + np.int32(1)
    elif what == "past":
        indices = indices[:-1].copy()
    elif what == "duplicate":
        indices = indices.copy(); indices[1] = indices[0]
    elif what == "indptr len":
        indptr = indptr[:-1].copy()
    elif what == "int64":
        indices = indices.astype(np.int64)
    elif what == "block_q":
        kw["block_q"] = 32
    elif what == "block_k bool":
        kw["block_k"] = True
    elif what == "per-head shape":
        indptr, indices = indptr[None, None].repeat(2, 1), indices[None, None]
    elif what == "mixed rank":
        indices = indices[None, None]
    elif what == "q a list":
        q = q.tolist()
    elif what == "indices None":
        indices = None
    return (q, k, v, indptr, indices), kw


@pytest.mark.parametrize("what,exc,match", [
    ("block id", ValueError, r"indices: expected key block ids in \[0, 4\)"),
    ("negative id", ValueError, "indices: expected key block ids"),
    ("decreasing", ValueError, "indptr: expected non-decreasing"),
    ("start", ValueError, "indptr: expected offsets starting at 0"),
    ("past", ValueError, "indptr: expected offsets up to the length of indices"),
    ("duplicate", ValueError, "indices: expected distinct key blocks"),
    ("indptr len", ValueError, r"indptr: expected shape \[n_q_blocks \+ 1\] = \[5\]"),
    ("int64", TypeError, "indices: expected an int32"),
    ("block_q", ValueError, r"block_q: expected one of \(16, 64, 128\)"),
    ("block_k bool", TypeError, "block_k: expected an int"),
    ("per-head shape", ValueError, r"indptr: expected shape \[B, Hkv, n_q_blocks \+ 1\]"),
    ("mixed rank", ValueError, "indices: expected a 1-d"),
    ("q a list", TypeError, "q: expected a NumPy or GPU array, got list"),   # (k was named)
    ("indices None", TypeError, "indices: expected a NumPy array with NumPy q, k, v .*got NoneType"),
])
def test_bad_inputs_raise_on_the_host_path(what, exc, match):
    args, kw = _bad(what)
    with pytest.raises(exc, match=match):
        vbw_cupy.block_sparse_attention(*args, **kw)


def test_empty_pattern_gives_zeros_and_minus_inf():
    q, k, v, _, _ = _args()
    indptr = np.zeros(5, np.int32)
    o, lse = vbw_cupy.block_sparse_attention(q, k, v, indptr, np.zeros(0, np.int32), block_q=64, block_k=64,
                                             return_lse=True)
    assert (o == 0).all() and (lse == -np.inf).all()


def test_instances_and_tiles():
    inst = SP.kernel_instances()
    names = [n for _, n in inst]
    assert len(names) == len(set(names))
    assert all(n.startswith("attn_sparse_fwd<") for f, n in inst if f == SP.SOURCE)
    wg = [n for f, n in inst if f != SP.SOURCE]   # the SPARSE instances of the wgmma kernel (sm_90a)
    assert wg and all(n.startswith("attn_fwd_wg<") and n.endswith(", true>") for n in wg)
    assert SP.block_n(128, 128, 232448) == 64 and SP.block_n(128, 128, 101376) == 32
    assert SP.block_n(256, 128, 101376) == 16
    for hd in SP.HEAD_DIMS:
        for bq in SP.BLOCK_Q:
            assert SP.smem_bytes(hd, bq, SP.block_n(hd, bq, 166912)) <= 166912
    assert SP.head_dim_bucket(80) == 128 and SP.head_dim_bucket(1) == 64
    assert "sparse" in __import__("vbw_cupy.cli", fromlist=["OP_MODULES"]).OP_MODULES


def test_error_code_in_step_with_the_header():
    from vbw_cupy import _errors
    text = (rt.SOURCE_DIR / "errors.cuh").read_text()
    assert "SPARSE_INDICES = 9" in text and _errors.CODES[9][0] == "block_sparse_attention"


# ---------------------------------------------------------------------------------------------- GPU
def _bound(base, dtype):
    return min(2.0 * base, CAP[dtype]) + 1e-7


def run_sparse(B, Sq, Sk, Hq, Hkv, D, dtype, *, block_q, block_k, density, causal=False, per_pattern=False,
               empty_rows=1, softcap=0.0, seed=0, shuffle=False):
    """One GPU launch into NaN-prefilled buffers against the float64 reference; returns (err, bound)."""
    cp = pytest.importorskip("cupy")
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    qh, kh, vh = _rand(rng, (B, Sq, Hq, D), dt), _rand(rng, (B, Sk, Hkv, D), dt), _rand(rng, (B, Sk, Hkv, D), dt)
    nqb, nkb = -(-Sq // block_q), -(-Sk // block_k)
    _, indptr, indices = _pattern(rng, B, Hkv, nqb, nkb, density, per_pattern=per_pattern, empty_rows=empty_rows,
                                  causal=causal)
    if shuffle:
        indptr, indices = _shuffle_rows(rng, indptr, indices)
    kw = dict(block_q=block_q, block_k=block_k, causal=causal, softcap=softcap)
    o = cp.full((B, Sq, Hq, D), cp.nan, dtype=dt)
    lse = cp.full((B, Hq, Sq), cp.nan, dtype=cp.float32)
    SP._sparse_gpu(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), cp.asarray(indptr), cp.asarray(indices),
                   softmax_scale=None, return_lse=True, out=o, lse_out=lse, **kw)
    vbw_cupy.check_errors()
    oh = cp.asnumpy(o).astype(np.float32)
    assert not np.isnan(oh).any(), "output has NaN (an element was not written)"
    f32 = lambda x: x.astype(np.float32)
    o64, lse64 = ref.block_sparse_attention(f32(qh), f32(kh), f32(vh), indptr, indices, return_lse=True, **kw)
    low = ref.block_sparse_attention(qh, kh, vh, indptr, indices, lowp=True, **kw)
    lh = cp.asnumpy(lse)
    assert not np.isnan(lh).any(), "lse has NaN (unwritten?)"
    seen = np.isfinite(lse64)
    assert np.array_equal(np.isfinite(lh), seen) and (lh[~seen] == -np.inf).all()
    assert np.allclose(lh[seen], lse64[seen], rtol=1e-4, atol=1e-3)
    assert (oh.transpose(0, 2, 1, 3)[~seen] == 0).all()
    err, base = ref.rel_error(oh, o64), ref.rel_error(f32(low), o64)
    assert err <= _bound(base, dtype), f"error {err:.3e} > bound {_bound(base, dtype):.3e} (lowp {base:.3e})"
    return err, _bound(base, dtype)


@gpu
@pytest.mark.parametrize("block_q,block_k", [(64, 16), (64, 64), (128, 128), (128, 16), (16, 64), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_blocks(block_q, block_k, causal, dtype):
    run_sparse(2, 1000, 1000, 8, 2, 128, dtype, block_q=block_q, block_k=block_k, density=0.3, causal=causal,
               seed=block_q + block_k, shuffle=True)


@gpu
@pytest.mark.parametrize("D", [64, 128, 80, 32, 256, 200])
def test_gpu_head_dims(D):
    run_sparse(1, 777, 777, 4, 1, D, "float16", block_q=64, block_k=64, density=0.4, causal=True, seed=D)


@gpu
@pytest.mark.parametrize("density", [0.01, 0.1, 0.5, 1.0])
def test_gpu_densities_per_pattern(density):
    run_sparse(2, 2048, 2048, 8, 4, 64, "bfloat16", block_q=128, block_k=64, density=density, per_pattern=True,
               empty_rows=2 if density < 1 else 0, seed=int(density * 100))


@gpu
def test_gpu_sq_ne_sk_and_softcap():
    run_sparse(1, 300, 1100, 4, 2, 128, "float16", block_q=64, block_k=16, density=0.3, causal=True, softcap=20.0)
    run_sparse(1, 1100, 300, 4, 2, 64, "float16", block_q=128, block_k=64, density=0.5)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_16k(dtype):
    run_sparse(1, 16384, 16384, 4, 1, 128, dtype, block_q=128, block_k=128, density=0.05, causal=True, empty_rows=3)


@gpu
def test_gpu_full_pattern_matches_flash_attention():
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(11)
    q, k, v = (cp.asarray(_rand(rng, (2, 1024, 8, 128), np.float16)) for _ in range(3))
    indptr, indices = SP.bsr_from_mask(cp.ones((8, 16), dtype=bool))
    for causal in (False, True):
        o = vbw_cupy.block_sparse_attention(q, k, v, indptr, indices, block_q=128, block_k=64, causal=causal)
        od = vbw_cupy.flash_attention(q, k, v, causal=causal)
        f = lambda x: cp.asnumpy(x).astype(np.float32)
        o64 = ref.flash_attention(f(q), f(k), f(v), causal=causal)
        assert ref.rel_error(f(o), o64) <= 2e-3 and ref.rel_error(f(o), f(od)) <= 2e-3


@gpu
def test_gpu_bsr_from_mask_matches_numpy():
    cp = pytest.importorskip("cupy")
    m = np.random.default_rng(2).random((2, 3, 17, 9)) < 0.3
    for mm in (m, m[0, 0]):
        p, i = SP.bsr_from_mask(mm)
        pd, id_ = SP.bsr_from_mask(cp.asarray(mm))
        assert np.array_equal(p, pd.get()) and np.array_equal(i, id_.get())


@gpu
@pytest.mark.parametrize("what", ["block id", "negative id", "decreasing", "start", "past"])
def test_gpu_bad_indices_give_nan_rows_and_a_flag(what):
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(4)
    B, S, Hq, Hkv, D = 1, 500, 4, 2, 64
    q, k, v = (cp.asarray(_rand(rng, s, np.float16)) for s in ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)))
    pattern = np.zeros((8, 8), bool)
    pattern[:, ::4] = True   # 2 blocks a row: the "decreasing" case's neighbour row (5 entries) stays valid
    indptr, indices = SP.bsr_from_mask(pattern)    # block_q = block_k = 64
    indptr, indices = indptr.copy(), indices[:indptr[-1]].copy()
    bad_qb = {"block id": 2, "negative id": 5, "decreasing": 3, "start": 0, "past": 7}[what]
    if what == "block id":
        indices[indptr[2] + 1] = 8
    elif what == "negative id":
        indices[indptr[5]] = -5
    elif what == "decreasing":
        indptr[4] = indptr[3] - 1          # row 3 decreases; row 4 (indptr[4] .. indptr[5]) is in range
    elif what == "start":
        indptr[0] = 1
    elif what == "past":
        indptr[8] = len(indices) + 8
    bad = {3} if what == "decreasing" else {bad_qb}
    vbw_cupy.check_errors()
    o, lse = vbw_cupy.block_sparse_attention(q, k, v, cp.asarray(indptr), cp.asarray(indices), block_q=64,
                                             block_k=64, return_lse=True)
    oh, lh = o.get().astype(np.float32), lse.get()
    for qb in range(8):
        rows = slice(qb * 64, min(S, qb * 64 + 64))
        if qb in bad:
            assert np.isnan(oh[:, rows]).all() and np.isnan(lh[:, :, rows]).all(), qb
        else:
            assert not np.isnan(oh[:, rows]).any() and not np.isnan(lh[:, :, rows]).any(), qb
    with pytest.raises(ValueError, match=rf"block_sparse_attention: indptr / indices: .*query block {min(bad)}"):
        vbw_cupy.check_errors()
    vbw_cupy.check_errors()  # cleared
    with pytest.raises(ValueError, match="indptr|indices"):
        vbw_cupy.block_sparse_attention(q, k, v, cp.asarray(indptr), cp.asarray(indices), block_q=64, block_k=64,
                                        check="host")


@gpu
def test_gpu_public_api_empty_rows_and_dlpack():
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(6)
    q = cp.asarray(_rand(rng, (1, 256, 2, 64), np.float16))
    indptr = cp.zeros(5, dtype=cp.int32)
    o, lse = vbw_cupy.block_sparse_attention(q, q[:, :, :1], q[:, :, :1], indptr, cp.zeros(0, cp.int32),
                                             block_q=64, block_k=64, return_lse=True)
    assert isinstance(o, cp.ndarray) and (o == 0).all() and (lse == -cp.inf).all()
    with pytest.raises(TypeError, match="NumPy and GPU"):
        vbw_cupy.block_sparse_attention(q, q.get(), q, indptr, indptr, block_q=64, block_k=64)


@gpu
def test_gpu_warp_specialized_tile_bad_list_and_empty_rows():
    """The 128 x 128 tile at D = 128 (the warp-specialized kernel on sm_90: list staging by 384 threads, the
    producer's early exit): a bad block id gives that query block NaN rows and the flag, an empty row gives
    0 and lse -inf, and every other row equals the reference."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(8)
    B, S, Hq, Hkv, D = 1, 512, 4, 2, 128
    qh, kh, vh = (_rand(rng, s, np.float16) for s in ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)))
    pattern = np.array([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 1], [0, 1, 1, 1]], bool)
    indptr, indices = SP.bsr_from_mask(pattern)
    indptr, indices = indptr.copy(), indices[:indptr[-1]].copy()
    good = indices.copy()
    indices[indptr[2] + 1] = 4                       # query block 2 names key block 4 of 4
    vbw_cupy.check_errors()
    o, lse = vbw_cupy.block_sparse_attention(cp.asarray(qh), cp.asarray(kh), cp.asarray(vh), cp.asarray(indptr),
                                             cp.asarray(indices), block_q=128, block_k=128, return_lse=True)
    oh, lh = o.get().astype(np.float32), lse.get()
    want, want_lse = vbw_cupy.block_sparse_attention(qh.astype(np.float32), kh.astype(np.float32),
                                                     vh.astype(np.float32), indptr, good, block_q=128,
                                                     block_k=128, return_lse=True)
    assert np.isnan(oh[:, 256:384]).all() and np.isnan(lh[:, :, 256:384]).all()
    assert (oh[:, 128:256] == 0).all() and (lh[:, :, 128:256] == -np.inf).all()
    for rows in (slice(0, 128), slice(384, 512)):
        np.testing.assert_allclose(oh[:, rows], want[:, rows], atol=2e-3, rtol=2e-2)
        np.testing.assert_allclose(lh[:, :, rows], want_lse[:, :, rows], atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match=r"block_sparse_attention: indptr / indices: .*query block 2"):
        vbw_cupy.check_errors()
