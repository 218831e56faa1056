"""Fuzz of every public op's arguments (hypothesis): each call gives a correct result or a ValueError / TypeError
whose message names the offending argument; nothing else (no IndexError, OverflowError, numpy RuntimeWarning...).

A case is a valid call with at most one argument broken (a wrong type, dtype, rank, size or value). CPU: the
NumPy path, results checked against a naive float64 computation written here. GPU (`gpu` marker): the same cases
on CuPy inputs, one op per subprocess (a sticky CUDA error cannot poison the others), results checked against
the NumPy path's with the kernels' tolerance; a flag raised by `check_errors()` counts as an error of the call.
"""
import math
import os
import re
import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vbw_cupy as vc

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
ON_GPU = os.environ.get("VBW_FUZZ_XP") == "cupy"  # set by the GPU tests below for their subprocess
ATTN_DTYPES = [F16, BF16] if ON_GPU else [F16, BF16, F32]   # the GPU attention kernels take 16-bit inputs
FUZZ = settings(max_examples=int(os.environ.get("VBW_FUZZ_EXAMPLES", 40)), deadline=None, derandomize=not os.environ.get("VBW_FUZZ_RANDOM"),
                suppress_health_check=list(HealthCheck))

NOT_ARRAYS = [None, 3, 2.5, "x", np.float32(1.0)]
ODD_DTYPES = [np.float64, np.int32, np.int64, np.bool_, np.float16, np.float32, ml_dtypes.bfloat16, np.uint8]
#: bad or unusual values of the scalar options, per option
OPTIONS = {
    "causal": [1, "yes", None, np.bool_(True), True],
    "return_lse": [1, None, True],
    "window": [(2**40, 0), (0, 2**40), (1.5, 2), (-2, 0), "a", None, (1,), (1, 2, 3), (True, 0), [3, 4], (0, 0),
               (np.int64(2), -1)],
    "softcap": [-1.0, float("nan"), float("inf"), 1e-40, 1e70, "x", None, True, 0, 30.0, 2.0**-32],
    "softmax_scale": [1e37, float("nan"), float("inf"), 0.0, -1.0, "x", True, [1.0], np.float16(0.5), 2.0**64, 7],
    "check": ["host", "device", "x", 1, None, True, False],
    "max_seqlen_q": [-1, 0, 1.5, 2**40, "x", True, 10**30],
    "max_seqlen_k": [-1, 0, 1.5, 2**40, "x", True],
    "max_seqlen": [-1, 0, 1.5, 2**40, "x", True, 1],
    "block_q": [0, 32, 16.0, "16", True, 256, -16],
    "block_k": [0, 32, 64.0, None, 2**40],
    "format": ["nvfp4", "mxfp4", "NVFP4", None, 3, ["mxfp4"]],
    "global_scale": [None, 0.0, -1.0, float("nan"), float("inf"), 1e-6, 1e30, "x", [1.0], np.float32(2.0), True,
                     1e-45, 5],
    "activation": [None, "relu", "gelu", "gelu_tanh", "silu", "tanh", 3, ["relu"]],
    "out_dtype": [None, np.float16, "float32", np.float64, np.int8, [1], "bfloat16", "nonsense"],
    "dtype": [np.float16, np.float32, np.float64, "bfloat16", np.int32, None, [1], "x"],
    "seqs": [None, [0], [5], [-1], [0, 0], "x", 1.5, [2**40]],
    "seq": [0, -1, 99, 1.5, "x", None, True],
    "tokens": [0, 1, -5, 1.5, "x", None, 2**40],
}
BAD_INTS = [-1, -(2**31), 2**31 - 1, 2**24, 0, 1, 7]


# ---------------------------------------------------------------------------------------------- helpers
def _rand(draw, shape, dtype, scale=1.0):
    seed = draw(st.integers(0, 2**32 - 1))
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _break_array(draw, x):
    """x with one thing wrong (or odd but fine: another dtype, a non-contiguous copy, large values)."""
    how = draw(st.sampled_from(["type", "dtype", "ndim+", "ndim-", "empty", "grow", "shrink", "fortran", "values"]))
    if how == "type":
        other = draw(st.sampled_from(NOT_ARRAYS + ["list"]))
        return x.tolist() if other == "list" else other
    if how == "dtype":
        return x.astype(draw(st.sampled_from(ODD_DTYPES)))
    if how == "ndim+":
        return x[None]
    if how == "ndim-":
        return x[0] if x.ndim else x
    if how == "fortran":
        return np.asfortranarray(x)
    axis = draw(st.integers(0, max(x.ndim - 1, 0))) if x.ndim else None
    if how == "empty" and x.ndim:
        return np.take(x, [], axis=axis)
    if how == "grow" and x.ndim:
        return np.concatenate([x, np.take(x, [0], axis=axis)], axis=axis)
    if how == "shrink" and x.ndim and x.shape[axis] > 1:
        return np.take(x, range(x.shape[axis] - 1), axis=axis)
    y = x.copy()
    if y.size:
        i = draw(st.integers(0, y.size - 1))
        if y.dtype == np.uint8:                 # E4M3 codes: any byte, NaN codes (0x7F, 0xFF) included
            y.flat[i] = draw(st.sampled_from([0x7F, 0xFF, 0x7E, 0xFE, 0, 0x80, 1]))
        elif y.dtype.kind in "iu":
            y.flat[i] = draw(st.sampled_from(BAD_INTS))
        else:
            big = float(ml_dtypes.finfo(y.dtype).max) / 4  # large but finite: no op may give NaN for finite inputs
            y = np.clip(y.astype(np.float64) * 100.0, -big, big).astype(y.dtype)
    return y


def _maybe_break(draw, args, arrays, options):
    """Break at most one argument of `args` (one of `arrays`, or one of `options` set to a value from OPTIONS).
    Returns the broken argument's name, or None."""
    what = draw(st.sampled_from([None, None] + list(arrays) + list(options)))
    if what in arrays:
        args[what] = _break_array(draw, args[what])
    elif what is not None:
        args[what] = draw(st.sampled_from(OPTIONS[what]))
    return what


def _names(msg, name):
    return re.search(rf"(^|[^\w.]){re.escape(name)}([^\w]|$)", msg) is not None


def _check_error(e, args, broken, arrays):
    """The error names the broken option, or (an array broken, or a valid call refused) an argument of the call."""
    msg = str(e)
    assert msg, f"{type(e).__name__} with no message"
    head = ":".join(msg.split(":")[:2])
    if ON_GPU and msg.startswith(tuple(f"{op}: " for op in ("paged_attention", "flash_attention_varlen", "quantize",
                                                           "block_sparse_attention"))):
        head = msg  # a flag raised by check_errors(): "op: argument: what (which may name a max_seqlen_*)"
    if broken is not None and broken not in arrays:
        assert _names(head, broken), f"{type(e).__name__} for a bad {broken}={args[broken]!r}: {msg!r}"
    else:
        assert any(_names(head, n) for n in args), f"{type(e).__name__} names no argument of {list(args)}: {msg!r}"


def _to_gpu(v):
    import cupy as cp
    if isinstance(v, np.ndarray):
        return cp.asarray(v)
    if isinstance(v, (vc.FP4Tensor, vc.FP8Tensor)):
        return v.to_gpu()
    return v


def _call(fn, args, broken, arrays):
    """fn(**args) on NumPy inputs, or on CuPy inputs in the GPU subprocess; (result, None) or (None, error)."""
    allowed = (ValueError, TypeError)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NumPy RuntimeWarning (overflow, invalid value) is a bug here
        try:
            if not ON_GPU:
                return fn(**args), None
            out = fn(**{k: _to_gpu(v) for k, v in args.items()})
            vc.check_errors()
            return out, None
        except allowed as e:
            _check_error(e, args, broken, arrays)
            return None, e


def _host(x):
    if isinstance(x, tuple):
        return tuple(_host(t) for t in x)
    return x.get() if hasattr(x, "get") else x


def _run(fn, args, broken, arrays, oracle, peaked=lambda args: False, gpu_check=None):
    """Call, check the error or the result: against `oracle(args, out)` on the CPU, against the NumPy path on
    the GPU (where the NumPy path must have given a result too; where `peaked(args)`, scores so large that float32
    and float64 may pick different maxima, only shapes and finiteness are compared; `gpu_check(args, out, want)`
    replaces the comparison for ops with a bound of their own)."""
    host_args = dict(args)
    out, err = _call(fn, args, broken, arrays)
    if err is not None:
        return
    if ON_GPU:
        out = _host(out)
        want = fn(**host_args)  # a GPU result where the reference refuses the call is a missed check
        if gpu_check is not None:
            gpu_check(host_args, out, want)
        elif peaked(host_args):
            for g, w in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
                assert g.shape == w.shape and np.isfinite(np.asarray(g, np.float32)[np.isfinite(w)]).all()
        else:
            _close(out, want, gpu=True)
    else:
        oracle(args, out)


def _peaked(args):
    """Whether |scores| can pass 1e3 (float32 and float64 softmaxes may then differ by more than rounding)."""
    q, k = args["q"], args.get("k", args.get("k_cache"))
    s = args.get("softmax_scale")
    s = 1.0 if s is None else abs(float(s))
    with np.errstate(over="ignore", invalid="ignore"):
        bound = float(np.abs(q.astype(np.float64)).max() * np.abs(k.astype(np.float64)).max()) * q.shape[-1] * s
    return not bound <= 1e3


def _tol(dtype, gpu=False):
    return {F16: 4e-3, BF16: 2e-2, F32: 1e-5}.get(np.dtype(dtype), 1e-5) * (4 if gpu else 1)


def _close(got, want, tol=None, gpu=False, scale=None):
    if isinstance(want, tuple):
        for g, w in zip(got, want):
            _close(g, w, tol, gpu)
        return
    if isinstance(want, (vc.FP4Tensor, vc.FP8Tensor)):  # the codecs are bit-exact
        np.testing.assert_array_equal(_host(got.data), want.data)
        np.testing.assert_array_equal(_host(got.scales), want.scales)
        return
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))  # lse of rows that see no key
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all(), "NaN / Inf where the expected value is finite"
    tol = tol if tol is not None else _tol(np.float16 if gpu else np.float32, gpu)
    scale = scale if scale is not None else max(1.0, float(np.abs(want[fin]).max(initial=0.0)))
    err = float(np.abs(got[fin] - want[fin]).max(initial=0.0))
    assert err <= tol * scale, f"max error {err:.3g} > {tol:.1g} x {scale:.3g}"


def _finite(*xs):
    return all(np.isfinite(np.asarray(x, np.float32)).all() for x in xs)


# ------------------------------------------------------------------------------ naive float64 attention
def naive_attention(q, k, v, allowed, scale, softcap):
    """q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D], allowed bool broadcast to [B, Hq, Sq, Sk]: (o, lse [B, Hq, Sq])."""
    g = q.shape[2] // k.shape[2]
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    k64, v64 = np.repeat(k64, g, axis=2), np.repeat(v64, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    allowed = np.broadcast_to(allowed, s.shape)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(allowed, np.exp(s - m), 0.0)
    den = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(den > 0, den, 1.0), v64)
    with np.errstate(divide="ignore"):
        lse = np.where(den[..., 0] > 0, np.log(np.maximum(den[..., 0], 1e-300)) + m[..., 0], -np.inf)
    return o, lse


def window_mask(Sq, Sk, window, causal):
    left, right = window
    right = 0 if causal else right
    i, j = np.arange(Sq)[:, None] + Sk - Sq, np.arange(Sk)[None, :]
    ok = np.ones((Sq, Sk), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _scale(args, D):
    s = args.get("softmax_scale")
    return 1.0 / math.sqrt(D) if s is None else float(s)


def _check_attention(out, o, lse, q, v, args, D):
    """out (o or (o, lse)) against the naive (o, lse); exact comparisons only where scores are well conditioned."""
    got_o, got_lse = out if isinstance(out, tuple) else (out, None)
    assert got_o.shape == q.shape and got_o.dtype == q.dtype
    if not _finite(q, v) or abs(_scale(args, D)) > 16:
        assert not _finite(q, v) or np.isfinite(np.asarray(got_o, np.float32)).all()
        return
    vmax = max(1.0, float(np.abs(np.asarray(v, np.float64)).max()))
    _close(got_o, o, _tol(q.dtype), scale=vmax)
    if got_lse is not None:
        _close(got_lse, lse, 1e-5)


# ------------------------------------------------------------------------------------------- strategies
@st.composite
def attention_case(draw):
    B, Sq, Sk = draw(st.integers(1, 2)), draw(st.integers(1, 20)), draw(st.integers(1, 20))
    Hkv, g, D = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 8, 16]))
    dt = draw(st.sampled_from(ATTN_DTYPES))
    args = dict(q=_rand(draw, (B, Sq, Hkv * g, D), dt), k=_rand(draw, (B, Sk, Hkv, D), dt),
                v=_rand(draw, (B, Sk, Hkv, D), dt), causal=draw(st.booleans()),
                softmax_scale=draw(st.sampled_from([None, 0.3, -0.5])),
                window=(draw(st.integers(-1, 6)), draw(st.integers(-1, 6))),
                softcap=draw(st.sampled_from([0.0, 0.0, 5.0])), return_lse=draw(st.booleans()))
    arrays = ("q", "k", "v")
    return args, _maybe_break(draw, args, arrays, [o for o in args if o not in arrays]), arrays


@st.composite
def varlen_case(draw):
    B = draw(st.integers(1, 3))
    lq = draw(st.lists(st.integers(0, 6), min_size=B, max_size=B).filter(lambda x: sum(x) > 0))
    lk = draw(st.lists(st.integers(0, 8), min_size=B, max_size=B).filter(lambda x: sum(x) > 0))
    Hkv, g, D = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([2, 8, 16]))
    dt = draw(st.sampled_from(ATTN_DTYPES))
    cu = lambda ls: np.concatenate([[0], np.cumsum(ls)]).astype(np.int32)  # noqa: E731
    args = dict(q=_rand(draw, (sum(lq), Hkv * g, D), dt), k=_rand(draw, (sum(lk), Hkv, D), dt),
                v=_rand(draw, (sum(lk), Hkv, D), dt), cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk),
                max_seqlen_q=draw(st.sampled_from([None, max(lq)])), max_seqlen_k=draw(st.sampled_from([None, max(lk)])),
                causal=draw(st.booleans()), window=(draw(st.integers(-1, 4)), draw(st.integers(-1, 4))),
                softcap=0.0, softmax_scale=None, return_lse=draw(st.booleans()), check="device")
    arrays = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
    return args, _maybe_break(draw, args, arrays, [o for o in args if o not in arrays]), arrays


@st.composite
def paged_case(draw):
    B, Hkv, g = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    D, bs, maxb = draw(st.sampled_from([1, 8, 16])), draw(st.sampled_from([1, 2, 4, 16])), draw(st.integers(1, 4))
    dt = draw(st.sampled_from(ATTN_DTYPES))
    lens = np.array(draw(st.lists(st.integers(1, bs * maxb), min_size=B, max_size=B)), np.int32)
    nblk = B * maxb + draw(st.integers(0, 2))
    perm = np.random.default_rng(draw(st.integers(0, 99))).permutation(nblk)[:B * maxb]
    args = dict(q=_rand(draw, (B, Hkv * g, D), dt), k_cache=_rand(draw, (nblk, bs, Hkv, D), dt),
                v_cache=_rand(draw, (nblk, bs, Hkv, D), dt), block_table=perm.reshape(B, maxb).astype(np.int32),
                seq_lens=lens, softmax_scale=None, softcap=draw(st.sampled_from([0.0, 3.0])),
                window=(draw(st.integers(-1, 20)), -1), check="device", max_seqlen=None)
    arrays = ("q", "k_cache", "v_cache", "block_table", "seq_lens")
    return args, _maybe_break(draw, args, arrays, [o for o in args if o not in arrays]), arrays


@st.composite
def sparse_case(draw):
    B, Sq, Sk = draw(st.integers(1, 2)), draw(st.integers(1, 40)), draw(st.integers(1, 40))
    Hkv, g, D = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([4, 16]))
    bq, bk = draw(st.sampled_from([16, 64])), draw(st.sampled_from([16, 64]))
    dt = draw(st.sampled_from(ATTN_DTYPES))
    nqb, nkb = -(-Sq // bq), -(-Sk // bk)
    shape = (nqb, nkb) if draw(st.booleans()) else (B, Hkv, nqb, nkb)
    mask = np.random.default_rng(draw(st.integers(0, 99))).random(shape) < draw(st.sampled_from([0.3, 1.0]))
    indptr, indices = vc.bsr_from_mask(mask)
    args = dict(q=_rand(draw, (B, Sq, Hkv * g, D), dt), k=_rand(draw, (B, Sk, Hkv, D), dt),
                v=_rand(draw, (B, Sk, Hkv, D), dt), indptr=indptr, indices=indices, block_q=bq, block_k=bk,
                causal=draw(st.booleans()), softmax_scale=None, softcap=0.0, return_lse=draw(st.booleans()),
                check="device")
    arrays = ("q", "k", "v", "indptr", "indices")
    return args, _maybe_break(draw, args, arrays, [o for o in args if o not in arrays]), arrays


@st.composite
def quantize_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    x = _rand(draw, shape, draw(st.sampled_from([F16, BF16, F32])), draw(st.sampled_from([1.0, 1e-3, 300.0])))
    args = dict(x=x, format=draw(st.sampled_from(["nvfp4", "mxfp4"])), global_scale=None)
    return args, _maybe_break(draw, args, ("x",), ("format", "global_scale")), ("x",)


@st.composite
def fp8_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    x = _rand(draw, shape, draw(st.sampled_from([F16, BF16, F32])), draw(st.sampled_from([1.0, 1e-3, 300.0])))
    args = dict(x=x)
    return args, _maybe_break(draw, args, ("x",), ()), ("x",)


@st.composite
def fp8_attention_case(draw):
    """E4M3 codes (from quantize_e4m3 of random data) with their descales, or none."""
    B, Sq, Sk = draw(st.integers(1, 2)), draw(st.integers(1, 20)), draw(st.integers(1, 20))
    Hkv, g, D = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 8, 16]))
    qs = [vc.quantize_e4m3(_rand(draw, s, F16)) for s in ((B, Sq, Hkv * g, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D))]
    descale = draw(st.sampled_from(["given", None, (1.0, -2.0, 0.5), (0.0, 1.0, 1.0), "heads", "batch_heads"]))
    if descale == "given":
        descale = np.concatenate([d for _, d in qs])
    elif descale == "heads":   # one a KV head: quantize_e4m3(heads=Hkv) of each input, stacked [3, Hkv]
        qs = [vc.quantize_e4m3(_rand(draw, s, F16), heads=Hkv) for s in ((B, Sq, Hkv * g, D), (B, Sk, Hkv, D),
                                                                           (B, Sk, Hkv, D))]
        descale = np.stack([d for _, d in qs])
    elif descale == "batch_heads":   # [3, B, Hkv], values of either sign
        descale = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).uniform(-2, 2, (3, B, Hkv)).astype(np.float32)
    elif descale is not None:
        descale = np.array(descale, np.float32)
    args = dict(q=qs[0][0], k=qs[1][0], v=qs[2][0], descale=descale, causal=draw(st.booleans()),
                softmax_scale=draw(st.sampled_from([None, 0.3, -0.5])),
                window=(draw(st.integers(-1, 6)), draw(st.integers(-1, 6))),
                softcap=draw(st.sampled_from([0.0, 0.0, 5.0])), return_lse=draw(st.booleans()),
                out_dtype=draw(st.sampled_from([F16, BF16])))
    arrays = ("q", "k", "v")
    broken = _maybe_break(draw, args, arrays, [o for o in args if o not in arrays and o != "descale"])
    if broken is None and draw(st.booleans()):   # a bad descale: shape, type, values
        args["descale"] = draw(st.sampled_from([[1.0, 1.0], np.ones((3, 1), np.float32), "x", [1, 2, 3],
                                                np.array([1.0, float("nan"), 1.0], np.float32), 3.0]))
        broken = "descale"
    return args, broken, arrays


@st.composite
def e4m3_codes_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    codes = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, shape, dtype=np.uint8)
    descale = draw(st.sampled_from([None, np.array([0.5], np.float32), np.array([-3e-3], np.float32),
                                    np.array([np.nan], np.float32), np.array([1e30], np.float32)]))
    args = dict(codes=codes, descale=descale, dtype=draw(st.sampled_from([F16, BF16, F32])))
    return args, _maybe_break(draw, args, ("codes",), ("dtype",)), ("codes",)


@st.composite
def matmul_case(draw):
    M, N, K = draw(st.integers(1, 5)), draw(st.integers(1, 9)), draw(st.integers(1, 40))
    dt, fmt = draw(st.sampled_from([F16, BF16, F32])), draw(st.sampled_from(["nvfp4", "mxfp4"]))
    w = vc.quantize(_rand(draw, (N, K), F32), fmt)
    a_kind = draw(st.integers(0, 5))   # 0: FP4 activations (W4A4), 1: FP8 rows (W4A8), else a plain array
    a = (vc.quantize(_rand(draw, (M, K), F32), fmt) if a_kind == 0 else vc.quantize_fp8(_rand(draw, (M, K), dt))
         if a_kind == 1 else _rand(draw, (M, K), dt))
    quantized = isinstance(a, (vc.FP4Tensor, vc.FP8Tensor))
    bias = draw(st.sampled_from([None, "a", "f32"]))
    bias = None if bias is None else _rand(draw, (N,), F32 if bias == "f32" or quantized else dt)
    args = dict(a=a, w=w, bias=bias, activation=draw(st.sampled_from([None, "relu", "silu"])), out_dtype=None)
    arrays = ("a", "bias") if isinstance(a, np.ndarray) else ("bias",)
    if bias is None:
        arrays = arrays[:-1]
    if draw(st.integers(0, 5)) == 0:  # w: an FP4Tensor of another K, or no FP4Tensor
        args["w"] = draw(st.sampled_from([w.data, None, vc.quantize(_rand(draw, (N, K + 1), F32), fmt)]))
        return args, "w", arrays + ("w",)
    return args, _maybe_break(draw, args, arrays, ("activation", "out_dtype")), arrays + ("w",)


# ------------------------------------------------------------------------------------------------ oracles
def _attention_oracle(args, out):
    q, k, v = args["q"], args["k"], args["v"]
    win = tuple(int(w) for w in args["window"])
    allowed = window_mask(q.shape[1], k.shape[1], win, bool(args["causal"]))
    o, lse = naive_attention(q, k, v, allowed, _scale(args, q.shape[-1]), float(args["softcap"]))
    _check_attention(out, o, lse.transpose(0, 1, 2), q, v, args, q.shape[-1])


def _varlen_oracle(args, out):
    q, k, v, cq, ck = (args[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    o = np.zeros(q.shape, np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    win = tuple(int(w) for w in args["window"])
    for b in range(len(cq) - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b] or ck[b + 1] == ck[b]:
            continue
        ob, lb = naive_attention(q[None, rq], k[None, rk], v[None, rk],
                                 window_mask(cq[b + 1] - cq[b], ck[b + 1] - ck[b], win, bool(args["causal"])),
                                 _scale(args, q.shape[-1]), float(args["softcap"]))
        o[rq], lse[:, rq] = ob[0], lb[0]
    _check_attention(out, o, lse, q, v, args, q.shape[-1])


def _paged_oracle(args, out):
    q, kc, vc_, table, lens = (args[n] for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens"))
    bs = kc.shape[1]
    o = np.zeros(q.shape, np.float64)
    for b, n in enumerate(lens):
        t = np.arange(n)
        kb, vb = kc[table[b, t // bs], t % bs], vc_[table[b, t // bs], t % bs]
        ob, _ = naive_attention(q[None, None, b], kb[None], vb[None],
                                window_mask(1, n, (int(args["window"][0]), -1), False), _scale(args, q.shape[-1]),
                                float(args["softcap"]))
        o[b] = ob[0, 0]
    _check_attention(out, o, None, q, vc_, args, q.shape[-1])


def _sparse_oracle(args, out):
    q, k, v, indptr, indices = (args[n] for n in ("q", "k", "v", "indptr", "indices"))
    B, Sq, Hq, _ = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    bq, bk = args["block_q"], args["block_k"]
    ptr = indptr.reshape(-1, indptr.shape[-1])
    idx = indices.reshape(len(ptr), indices.shape[-1])
    allowed = np.zeros((B, Hq, Sq, Sk), bool)
    for b in range(B):
        for h in range(Hq):
            p = 0 if len(ptr) == 1 else b * Hkv + h // (Hq // Hkv)
            for qb in range(len(ptr[p]) - 1):
                for kb in idx[p, ptr[p][qb]:ptr[p][qb + 1]]:
                    allowed[b, h, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk] = True
    if args["causal"]:
        allowed &= np.tril(np.ones((Sq, Sk), bool))
    o, lse = naive_attention(q, k, v, allowed, _scale(args, q.shape[-1]), float(args["softcap"]))
    _check_attention(out, o, lse, q, v, args, q.shape[-1])


def _quantize_bound(x, t):
    x = np.asarray(x, np.float64)
    return 0.26 * float(np.abs(x).max()) + 6 * 2.0**-9 * float(t.global_scale)


def _quantize_oracle(args, t):
    x = args["x"]
    assert isinstance(t, vc.FP4Tensor) and t.shape == x.shape and t.format == args["format"]
    if _finite(x):
        d = vc.dequantize(t, np.float64)
        assert np.abs(d - np.asarray(x, np.float64)).max() <= _quantize_bound(x, t)


def _fp8_oracle(args, t):
    """E4M3 rounding: each element within 2^-4 of itself, or (below E4M3's normals) 2^-10 of its row's scale."""
    x = np.asarray(args["x"], np.float64)
    assert isinstance(t, vc.FP8Tensor) and t.shape == x.shape and t.scales.shape == x.shape[:-1]
    if _finite(x):
        d = vc.dequantize(t, np.float64)
        s = np.asarray(t.scales, np.float64)[..., None]
        assert (np.abs(d - x) <= np.abs(x) * 2.0**-4 + s * 2.0**-10).all()


def _e4m3_oracle(args, out):
    """quantize_e4m3: the tuple form, and every element within E4M3's rounding of x (finite x), the descale of
    its group of heads (heads=n) or the tensor's."""
    x = np.asarray(args["x"], np.float64)
    codes, ds = out
    n = args.get("heads") or 1
    assert codes.shape == x.shape and codes.dtype == np.uint8 and ds.shape == (n,) and ds.dtype == np.float32
    if _finite(x):
        per = np.float64(ds[0]) if args.get("heads") is None else \
            np.repeat(ds.astype(np.float64), x.shape[-2] // n)[:, None]
        d = np.asarray(vc.reference.e4m3_decode(codes), np.float64) * per
        assert (np.abs(d - x) <= np.abs(x) * 2.0**-4 + per * 2.0**-10).all()


def _fp8_attention_oracle(args, out):
    """flash_attention_fp8 (NumPy): the naive float64 attention on the decoded inputs."""
    ds = np.ones(3) if args["descale"] is None else np.asarray(args["descale"], np.float64)
    q, k, v = (np.asarray(vc.reference.e4m3_decode(args[n]), np.float64) *
               vc.reference.fp8_head_descale(ds[i], args[n].shape) for i, n in enumerate("qkv"))
    win = tuple(int(w) for w in args["window"])
    allowed = window_mask(q.shape[1], k.shape[1], win, bool(args["causal"]))
    o, lse = naive_attention(q, k, v, allowed, _scale(args, q.shape[-1]), float(args["softcap"]))
    got_o, got_lse = out if isinstance(out, tuple) else (out, None)
    assert got_o.shape == q.shape and got_o.dtype == np.dtype(args["out_dtype"])
    if not (_finite(q, k, v) and abs(_scale(args, q.shape[-1])) * max(1.0, float(np.abs(ds[:2]).max())) <= 16):
        return   # NaN codes / descales propagate as the reference's rules say; huge scores: shapes only
    vmax = max(1.0, float(np.abs(v).max()))
    _close(got_o, o, _tol(args["out_dtype"]), scale=vmax)
    if got_lse is not None:
        _close(got_lse, lse, 1e-5)


def _e4m3_gpu_check(args, out, want):
    """quantize_e4m3 on the GPU: the codes and the descale bit for bit the NumPy path's."""
    for g, w in zip(out, want):
        np.testing.assert_array_equal(g, w)


def _fp8_attention_gpu_check(args, out, want):
    """flash_attention_fp8 on the GPU against the float64 reference on the decoded inputs: within twice the
    error of the float32 emulation that rounds P as the kernel does (attention_fp8._emulated) plus one E4M3 step
    of the largest V value (with a handful of keys one P rounded the other way moves a row by that much); lse
    within 2e-3. Scores past 1e3 (codes used as values): shapes and finiteness only."""
    from vbw_cupy import attention_fp8 as F
    ds = np.ones(3) if args["descale"] is None else np.asarray(args["descale"], np.float64)
    q, k, v = (np.asarray(vc.reference.e4m3_decode(args[n]), np.float64) *
               vc.reference.fp8_head_descale(ds[i], args[n].shape) for i, n in enumerate("qkv"))
    got_o, got_lse = out if isinstance(out, tuple) else (out, None)
    want_o = want[0] if isinstance(want, tuple) else want
    assert got_o.shape == want_o.shape and got_o.dtype == want_o.dtype
    scale = abs(_scale(args, q.shape[-1]))
    if not _finite(q, k, v) or np.abs(q).max() * np.abs(k).max() * q.shape[-1] * scale > 1e3:
        assert np.isfinite(np.asarray(got_o, np.float32)[np.isfinite(np.asarray(want_o, np.float32))]).all()
        return
    opts = dict(softmax_scale=args["softmax_scale"], window=args["window"], softcap=args["softcap"])
    o64 = vc.reference.flash_attention_fp8(args["q"], args["k"], args["v"], args["descale"], causal=args["causal"],
                                           return_lse=True, out_dtype=np.float32, **opts)
    g = q.shape[2] // k.shape[2]
    emul = F._emulated(args["q"], np.repeat(args["k"], g, axis=2), np.repeat(args["v"], g, axis=2),
                       args["descale"], args["causal"], **opts)
    base = np.abs(emul.astype(got_o.dtype).astype(np.float64) - o64[0]).max(initial=0.0)
    err = np.abs(np.asarray(got_o, np.float64) - o64[0]).max(initial=0.0)
    assert err <= 2 * base + 2.0**-4 * np.abs(v).max(initial=0.0) + 1e-6, (err, base)
    if got_lse is not None:
        np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(o64[1]))
        fin = np.isfinite(o64[1])
        np.testing.assert_allclose(got_lse[fin], o64[1][fin], rtol=1e-3, atol=2e-3)


def _dequantize_e4m3_oracle(args, out):
    """dequantize_e4m3: E4M3(codes) * descale in float32, then the dtype (NaN codes NaN, overflow Inf)."""
    ds = np.float32(1) if args["descale"] is None else np.asarray(args["descale"], np.float32)[0]
    with np.errstate(over="ignore", invalid="ignore"):
        want = (vc.reference.e4m3_decode(args["codes"]) * ds).astype(args["dtype"])
    assert out.dtype == np.dtype(args["dtype"]) and out.shape == want.shape
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def _equal_gpu_check(args, out, want):
    """The GPU result equals the NumPy path's (values; NaN where NaN)."""
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def _act(z, name):
    return {None: z, "relu": np.maximum(z, 0), "silu": z / (1 + np.exp(-z))}.get(name, z)


def _matmul_oracle(args, out):
    a, w, bias = args["a"], args["w"], args["bias"]
    a64 = vc.dequantize(a, np.float64) if isinstance(a, (vc.FP4Tensor, vc.FP8Tensor)) else np.asarray(a, np.float64)
    z = a64 @ vc.dequantize(w, np.float64).T + (0 if bias is None else np.asarray(bias, np.float64))
    if args["activation"] in (None, "relu", "silu"):
        with np.errstate(over="ignore"):
            want = _act(z, args["activation"])
        _close(out, want, _tol(out.dtype) if out.dtype != np.float64 else 1e-12, scale=max(1.0, np.abs(want).max()))


# --------------------------------------------------------------------------------------------------- tests
@FUZZ
@given(attention_case())
def test_fuzz_flash_attention(case):
    args, broken, arrays = case
    _run(vc.flash_attention, args, broken, arrays, _attention_oracle, _peaked)


@FUZZ
@given(varlen_case())
def test_fuzz_flash_attention_varlen(case):
    args, broken, arrays = case
    _run(vc.flash_attention_varlen, args, broken, arrays, _varlen_oracle, _peaked)


@FUZZ
@given(paged_case())
def test_fuzz_paged_attention(case):
    args, broken, arrays = case
    _run(vc.paged_attention, args, broken, arrays, _paged_oracle, _peaked)


@FUZZ
@given(sparse_case())
def test_fuzz_block_sparse_attention(case):
    args, broken, arrays = case
    _run(vc.block_sparse_attention, args, broken, arrays, _sparse_oracle, _peaked)


@FUZZ
@given(quantize_case())
def test_fuzz_quantize(case):
    args, broken, arrays = case
    _run(vc.quantize, args, broken, arrays, _quantize_oracle)


@FUZZ
@given(quantize_case(), st.sampled_from(OPTIONS["dtype"] + ["t"]))
def test_fuzz_dequantize(case, dtype):
    args, _, _ = case
    try:
        t = vc.quantize(**args)
    except (ValueError, TypeError):
        return
    call = dict(t=t if dtype != "t" else args["x"], dtype=np.float32 if dtype == "t" else dtype)
    broken = "t" if dtype == "t" else "dtype"

    def oracle(call, d):
        assert d.shape == t.shape and d.dtype == np.dtype(call["dtype"])
        if _finite(args["x"]):
            x = np.asarray(args["x"], np.float64)
            assert np.abs(np.asarray(d, np.float64) - x).max() <= _quantize_bound(x, t) * 1.01 + 1e-30
    _run(vc.dequantize, call, broken, ("t",), oracle)


@FUZZ
@given(fp8_case())
def test_fuzz_quantize_fp8(case):
    args, broken, arrays = case
    _run(vc.quantize_fp8, args, broken, arrays, _fp8_oracle)


@st.composite
def e4m3_case(draw):
    """quantize_e4m3's x, and heads: None, a divisor of x's axis -2 (one descale a group of heads), or a bad one."""
    args, broken, arrays = draw(fp8_case())
    x = args["x"]
    if broken is None and x.ndim >= 2 and draw(st.booleans()):
        H = x.shape[-2]
        args["heads"] = draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))
        if draw(st.integers(0, 3)) == 0:   # a bad one: not a divisor, not an int
            args["heads"] = draw(st.sampled_from([0, H + 1, -1, 2.0, True, "2"]))
            broken = "heads"
    return args, broken, arrays


@FUZZ
@given(e4m3_case())
def test_fuzz_quantize_e4m3(case):
    args, broken, arrays = case
    _run(vc.quantize_e4m3, args, broken, arrays, _e4m3_oracle, gpu_check=_e4m3_gpu_check)


@FUZZ
@given(e4m3_codes_case())
def test_fuzz_dequantize_e4m3(case):
    args, broken, arrays = case
    _run(vc.dequantize_e4m3, args, broken, arrays, _dequantize_e4m3_oracle, gpu_check=_equal_gpu_check)


@FUZZ
@given(fp8_attention_case())
def test_fuzz_flash_attention_fp8(case):
    args, broken, arrays = case
    _run(vc.flash_attention_fp8, args, broken, arrays, _fp8_attention_oracle, gpu_check=_fp8_attention_gpu_check)


@FUZZ
@given(matmul_case())
def test_fuzz_fp4_matmul(case):
    args, broken, arrays = case
    _run(vc.fp4_matmul, args, broken, arrays, _matmul_oracle)


# ---------------------------------------------------------------------------------------- PagedKVCache
def _cache_args(draw):
    args = dict(num_blocks=draw(st.integers(1, 8)), block_size=draw(st.sampled_from([1, 2, 4, 16])),
                num_kv_heads=draw(st.integers(1, 2)), head_dim=draw(st.sampled_from([1, 8])),
                dtype=draw(st.sampled_from([F16, BF16, F32])), max_batch=draw(st.integers(1, 3)),
                max_blocks_per_seq=draw(st.integers(1, 4)), device="gpu" if ON_GPU else "cpu")
    what = draw(st.sampled_from([None] * 4 + list(args)))
    if what is not None:
        args[what] = draw(st.sampled_from([0, -1, 3, 1.5, "x", None, 2**40, True, 300, np.int64(2)]
                                          + ([np.int32, "float16", "tpu"] if what in ("dtype", "device")
                                             else [])))
    return args, what


@FUZZ
@given(st.data())
def test_fuzz_paged_kv_cache(data):
    draw = data.draw
    args, broken = _cache_args(draw)
    cache, err = _call(vc.PagedKVCache, args, broken, ())
    if err is not None:
        return
    (_, _, Hkv, D), dt = cache.k_cache.shape, np.dtype(cache.k_cache.dtype)
    hist = {s: ([], []) for s in range(cache.max_batch)}
    for _ in range(draw(st.integers(1, 5))):
        op = draw(st.sampled_from(["append", "append", "attention", "free", "reserve"]))
        B = draw(st.integers(1, cache.max_batch))
        seqs = draw(st.sampled_from([None, list(range(cache.max_batch))[-B:]]))
        slots = list(range(B)) if seqs is None else seqs
        if op == "append":
            T = draw(st.sampled_from([None, 1, 3]))
            shape = (B, Hkv, D) if T is None else (B, T, Hkv, D)
            call = dict(k_new=_rand(draw, shape, dt), v_new=_rand(draw, shape, dt), seqs=seqs)
            broken = _maybe_break(draw, call, ("k_new", "v_new"), ("seqs",))
            try:
                _, err = _call(lambda **kw: cache.append(**{k: _to_gpu(v) if ON_GPU else v for k, v in kw.items()}),
                               call, broken, ("k_new", "v_new"))
            except MemoryError as e:
                assert "block" in str(e) or "token" in str(e)
                continue
            if err is None:
                for s, kn, vn in zip(slots, call["k_new"], call["v_new"]):
                    hist[s][0].extend(kn.reshape(-1, Hkv, D)), hist[s][1].extend(vn.reshape(-1, Hkv, D))
        elif op == "attention":
            g = draw(st.integers(1, 2))
            call = dict(q=_rand(draw, (B, Hkv * g, D), dt), seqs=seqs)
            broken = _maybe_break(draw, call, ("q",), ("seqs",))
            out, err = _call(lambda **kw: cache.attention(_to_gpu(kw["q"]) if ON_GPU else kw["q"], kw["seqs"]),
                             call, broken, ("q",))
            if err is None and broken is None and _finite(call["q"]):
                o = np.stack([naive_attention(call["q"][None, None, i], np.stack(hist[s][0])[None],
                                              np.stack(hist[s][1])[None], True, 1 / math.sqrt(D), 0.0)[0][0, 0]
                              for i, s in enumerate(slots)])
                _close(_host(out), o, _tol(dt, ON_GPU))
        elif op == "free":
            call = dict(seq=draw(st.sampled_from(OPTIONS["seq"])))
            _, err = _call(cache.free, call, "seq", ())
            if err is None:
                hist[int(call["seq"])] = ([], [])
        else:
            call = dict(tokens=draw(st.sampled_from(OPTIONS["tokens"])), seqs=seqs)
            try:
                _call(cache.reserve, call, "tokens", ())
            except MemoryError:
                pass


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash_attention", "flash_attention_varlen", "paged_attention",
                                  "block_sparse_attention", "quantize", "quantize_fp8", "quantize_e4m3",
                                  "dequantize_e4m3", "flash_attention_fp8", "dequantize", "fp4_matmul", "paged_kv_cache"])
def test_gpu_fuzz(name):
    """The CPU fuzz of one op on CuPy inputs, in a subprocess of its own."""
    env = dict(os.environ, VBW_FUZZ_XP="cupy", VBW_CUPY_AUTOTUNE="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        f"{__file__}::test_fuzz_{name}"], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
