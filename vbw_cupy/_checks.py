"""Argument checks of every public operation, for the NumPy (reference) path and the GPU path alike.

Only `.shape`, `.dtype` and `.ndim` are read (plus a host copy where values must be checked), so NumPy and
CuPy arrays go through the same checks. Errors name the argument. `vbw_cupy.reference` assumes its
input already passed these.
"""
from __future__ import annotations

import math as _math
from typing import NamedTuple as _NamedTuple

import ml_dtypes as _ml_dtypes
import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32")  # what quantize and fp4_matmul take


def check_float_dtype(name: str, dtype, allowed=FLOAT_DTYPES) -> np.dtype:
    """`dtype` as a NumPy dtype if its name is in `allowed`, else a TypeError naming the argument."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):  # an unhashable or nonsense object
        dt = None
    if dt is None or dt.name not in allowed:
        got = repr(dtype) if dt is None else dt
        raise TypeError(f"{name}: expected {', '.join(allowed[:-1])} or {allowed[-1]}, got {got}")
    return dt


#: NVFP4: the largest block scale max|block| / (6 * global_scale) a given global_scale may ask for. E4M3 stops at
#: 448; up to 512 the saturated elements stay within E2M1's rounding error at 6 (6 * 512 / 448 < 7).
NVFP4_MAX_BLOCK_SCALE = 512.0


def check_nvfp4_global_scale(amax, global_scale) -> None:
    """ValueError naming global_scale when it is below amax / 3072, amax = max|x| (finite): x's largest block
    would then saturate. Same float32 steps as the quantize rule (docs/formats.md), so the GPU kernel's flag
    (_errors.py code 8) agrees with it."""
    with np.errstate(over="ignore"):
        s = np.float32(np.float32(amax) / np.float32(6.0)) / np.float32(global_scale)
    if s > NVFP4_MAX_BLOCK_SCALE:
        raise ValueError(f"global_scale: expected at least max|x| / 3072 = {float(amax) / 3072:.6g} (max|x| = "
                         f"{float(amax):.6g}; None gives the default max|x| / 2688), got {float(global_scale):.6g}: "
                         f"x's largest block would need an E4M3 scale of {float(s):.6g} > 448 and saturate")


#: dtypes the reference accepts for q, k, v (the GPU kernels take float16 and bfloat16 only).
ATTENTION_DTYPES = (np.dtype(np.float16), np.dtype(_ml_dtypes.bfloat16), np.dtype(np.float32))
GPU_ATTENTION_DTYPES = ATTENTION_DTYPES[:2]  # the kernels take float16 and bfloat16
#: largest head dimension (docs/attention.md: any D from 1 to 256).
MAX_HEAD_DIM = 256
#: largest paged-KV block size (any power of two from 1 to 256).
MAX_BLOCK_SIZE = 256


class AttentionShape(_NamedTuple):
    """Sizes of a dense `flash_attention` call (returned by `check_attention_args`)."""
    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int


class VarlenShape(_NamedTuple):
    """Sizes of a `flash_attention_varlen` call (returned by `check_varlen_args`).

    `cu_seqlens_q` / `cu_seqlens_k` are host (NumPy int64) copies of the offsets, or None when the
    checker was told not to look at values and had no reason to copy them."""
    B: int
    total_q: int
    total_k: int
    Hq: int
    Hkv: int
    D: int
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    cu_seqlens_q: np.ndarray | None
    cu_seqlens_k: np.ndarray | None


class PagedShape(_NamedTuple):
    """Sizes of a `paged_attention` call (returned by `check_paged_args`).

    `block_table` / `seq_lens` are host (NumPy int64) copies, or None when values were not checked."""
    B: int
    Hq: int
    Hkv: int
    D: int
    num_blocks: int
    block_size: int
    max_blocks: int
    block_table: np.ndarray | None
    seq_lens: np.ndarray | None


# ---- argument checks (NumPy and CuPy alike) ---------------------------------------------------

def check_array_like(name, x) -> None:
    """TypeError naming the argument unless `x` is an array: NumPy, CuPy, or what CuPy takes (an object with
    __dlpack__ or __cuda_array_interface__: torch, JAX, Numba). Lists, numbers and NumPy scalars are not."""
    if isinstance(x, np.ndarray):
        return
    if isinstance(x, np.generic):
        raise TypeError(f"{name}: expected a NumPy or GPU array, got a NumPy scalar ({type(x).__name__}); "
                        f"pass numpy.asarray(...) of the values")
    if not (hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")
            or all(hasattr(x, a) for a in ("shape", "dtype", "ndim"))):
        raise TypeError(f"{name}: expected a NumPy or GPU array, got {type(x).__name__}")


def split_host_device(**arrays) -> bool:
    """True when every argument is a NumPy array (the reference path), False when none is (the GPU path).
    TypeError naming the first argument that is no array (`check_array_like`), else, when NumPy and GPU
    arrays are mixed, the first NumPy one."""
    for name, x in arrays.items():
        check_array_like(name, x)
    host = {n: isinstance(a, np.ndarray) for n, a in arrays.items()}
    if all(host.values()):
        return True
    if any(host.values()):
        first_dev = next(n for n, h in host.items() if not h)
        bad = next(n for n, h in host.items() if h)
        raise TypeError(f"{bad}: expected a GPU array like {first_dev} (NumPy and GPU inputs cannot be mixed), "
                        f"got numpy.ndarray")
    return False


def _check_array(name, x, ndim, layout):
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
        raise TypeError(f"{name}: expected an array of shape {layout}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array {layout}, got {x.ndim}-d shape {tuple(x.shape)}")


def _check_float_dtype(name, x, dtypes):
    if np.dtype(x.dtype) not in dtypes:
        want = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {x.dtype}")


def _check_same_dtype(name, x, ref_name, ref):
    if np.dtype(x.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{name}: expected the same dtype as {ref_name} ({ref.dtype}), got {x.dtype}")


def _check_int32(name, x, ndim, layout):
    _check_array(name, x, ndim, layout)
    if np.dtype(x.dtype) != np.dtype(np.int32):
        raise TypeError(f"{name}: expected an int32 array {layout}, got dtype {x.dtype}")


def check_shape(shape, name: str = "shape") -> tuple:
    """A logical shape as a tuple of ints; TypeError unless it is a tuple / list of ints (FP4Tensor, FP8Tensor)."""
    if not isinstance(shape, (tuple, list)) or not all(_is_int(s) for s in shape):
        raise TypeError(f"{name}: expected a tuple of ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def check_rows(x, name: str = "x") -> None:
    """ValueError unless x is an [..., K] array with at least one row and K >= 1 (quantize, quantize_fp8)."""
    if x.ndim < 1 or x.size == 0:
        raise ValueError(f"{name}: expected a non-empty array [..., K] (at least one row, K >= 1), got shape "
                         f"{tuple(x.shape)}")


def _check_nonempty(name, shape, layout):
    if any(int(n) == 0 for n in shape):
        raise ValueError(f"{name}: expected a non-empty array {layout}, got shape {tuple(shape)}")


def _check_heads(Hq, Hkv, q_name, k_name):
    if Hq % Hkv != 0:
        raise ValueError(f"{k_name}: expected a number of KV heads that divides {q_name}'s {Hq} heads "
                         f"(grouped-query attention), got {Hkv}")


def _check_head_dim(D, name):
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: expected a head dimension D from 1 to {MAX_HEAD_DIM}, got {D}")


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _float_or_inf(x) -> float:
    """float(x), or +-inf for an int past float's range (float() raises OverflowError): the range checks that
    follow then name the argument."""
    try:
        return float(x)
    except OverflowError:
        return _math.inf if x > 0 else -_math.inf


def _is_real(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def check_window(window):
    """Validate `window=(left, right)`: two ints, each -1 (unbounded) or >= 0. Returns (left, right)."""
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(_is_int(w) for w in window):
        raise TypeError(f"window: expected a pair of ints (left, right), -1 meaning unbounded, got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window: expected values >= -1 (-1 is unbounded), got {(left, right)}")
    return left, right


#: Largest |softmax_scale|: with float16 inputs |q.k| <= 256 * 65504^2 < 2^41, so scaled scores (times log2(e),
#: as the kernels use them) stay far inside float32 and a finite input never gives NaN.
MAX_SOFTMAX_SCALE = 2.0 ** 64
#: softcap, when on, lies in this range: the kernels compute softmax_scale / softcap and softcap * log2(e) in
#: float32, which then stay finite and normal (a denormal softcap is flushed to zero on the GPU).
SOFTCAP_RANGE = (2.0 ** -32, 2.0 ** 64)


def _unwrap0d(x):
    """A 0-d NumPy array of a real dtype as its scalar (the scalar options take those, as global_scale does)."""
    return x[()] if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iuf" else x


def check_softcap(softcap):
    """Validate `softcap`: 0 (off) or a float in SOFTCAP_RANGE (2^-32 to 2^64). Returns it as a float."""
    softcap = _unwrap0d(softcap)
    if not _is_real(softcap):
        raise TypeError(f"softcap: expected a float >= 0, got {type(softcap).__name__} {softcap!r}")
    softcap = _float_or_inf(softcap)
    if not (_math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap: expected a finite float >= 0 (0 is off), got {softcap}")
    if softcap != 0.0 and not SOFTCAP_RANGE[0] <= softcap <= SOFTCAP_RANGE[1]:
        raise ValueError(f"softcap: expected 0 (off) or a float from 2^-32 to 2^64 (float32 must hold "
                         f"softmax_scale / softcap), got {softcap}")
    return softcap


def check_flag(name, value):
    """Validate a boolean flag such as `causal` or `return_lse`. Returns it as a bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def effective_scale(softmax_scale, D):
    """`softmax_scale`, or 1/sqrt(D) when it is None; must be a real with |softmax_scale| <= 2^64
    (MAX_SOFTMAX_SCALE; zero and negative scales are allowed). Returns a float."""
    if softmax_scale is None:
        return 1.0 / _math.sqrt(D)
    softmax_scale = _unwrap0d(softmax_scale)
    if not _is_real(softmax_scale):
        raise TypeError(f"softmax_scale: expected None or a float, got {type(softmax_scale).__name__} "
                        f"{softmax_scale!r}")
    scale = _float_or_inf(softmax_scale)
    if not abs(scale) <= MAX_SOFTMAX_SCALE:  # NaN fails too
        raise ValueError(f"softmax_scale: expected a finite float with |softmax_scale| <= 2^64 (larger scales "
                         f"overflow float32 scores), got {scale}")
    return scale


def effective_window(window, causal):
    """(left, right) after the rule (docs/attention.md) that `causal=True` means right = 0 (any left window is kept)."""
    left, right = check_window(window)
    return (left, 0) if causal else (left, right)


def _check_options(window, softcap, causal, softmax_scale, D):
    check_window(window)
    check_softcap(softcap)
    check_flag("causal", causal)
    effective_scale(softmax_scale, D)


def _check_qkv(q, k, v, q_layout, kv_layout, dtypes, *, k_name="k", v_name="v"):
    """What every attention op checks first, in this order: the ranks of q, k, v, q's dtype (one of `dtypes`),
    k's and v's dtype (q's), q's head dim, and no empty dimension in q or k."""
    _check_array("q", q, q_layout.count(",") + 1, q_layout)
    _check_array(k_name, k, kv_layout.count(",") + 1, kv_layout)
    _check_array(v_name, v, kv_layout.count(",") + 1, kv_layout)
    _check_float_dtype("q", q, dtypes)
    _check_same_dtype(k_name, k, "q", q)
    _check_same_dtype(v_name, v, "q", q)
    _check_head_dim(int(q.shape[-1]), "q")
    _check_nonempty("q", q.shape, q_layout)
    _check_nonempty(k_name, k.shape, kv_layout)


def _check_dense_qkv(q, k, v, dtypes):
    """q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] of one dtype from `dtypes`, Hq % Hkv == 0: (B, Sq, Sk, Hq, Hkv, D)."""
    _check_qkv(q, k, v, "[B, Sq, Hq, D]", "[B, Sk, Hkv, D]", dtypes)
    B, Sq, Hq, D = (int(n) for n in q.shape)
    Bk, Sk, Hkv, Dk = (int(n) for n in k.shape)
    if Bk != B or Dk != D:
        raise ValueError(f"k: expected shape [B, Sk, Hkv, D] with B == q's {B} and D == q's {D}, "
                         f"got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _check_heads(Hq, Hkv, "q", "k")
    return B, Sq, Sk, Hq, Hkv, D


def check_attention_args(q, k, v, window=(-1, -1), softcap=0.0, *, causal=False, softmax_scale=None,
                         dtypes=ATTENTION_DTYPES):
    """Check the arguments of `flash_attention` and return their sizes.

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D], all of one dtype from `dtypes`, no empty dimension,
    Hq % Hkv == 0, 1 <= D <= 256; `window`, `softcap`, `causal`, `softmax_scale` as in docs/attention.md.
    Only `.shape`, `.dtype` and `.ndim` are read, so NumPy and CuPy arrays work alike and nothing is
    copied. Raises TypeError / ValueError naming the argument. Returns
    `AttentionShape(B, Sq, Sk, Hq, Hkv, D)` (a tuple).
    """
    B, Sq, Sk, Hq, Hkv, D = _check_dense_qkv(q, k, v, dtypes)
    _check_options(window, softcap, causal, softmax_scale, D)
    return AttentionShape(B, Sq, Sk, Hq, Hkv, D)


def _to_host(x):
    # NumPy arrays pass through; CuPy arrays are copied to the host with .get() (this synchronizes).
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):
        return np.asarray(x.get())
    return np.asarray(x)


def _check_offsets(name, offs, position="index", where=""):
    """Host int64 offsets `offs` start at 0 and never decrease; the message names `position` (what an index of
    offs is) and ends with `where` (which of several rows)."""
    if offs[0] != 0:
        raise ValueError(f"{name}: expected offsets starting at 0, got {int(offs[0])} first{where}")
    steps = np.diff(offs)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0))
        raise ValueError(f"{name}: expected non-decreasing offsets, got {int(offs[at])} then {int(offs[at + 1])} "
                         f"at {position} {at}{where}")


def _check_cu_seqlens(name, cu, total, tokens_name):
    cu = _to_host(cu).astype(np.int64)
    _check_offsets(name, cu)
    if cu[-1] != total:
        raise ValueError(f"{name}: expected the last offset to equal {tokens_name}'s packed length {total}, "
                         f"got {int(cu[-1])}")
    return cu


def _check_max_seqlen(name, value, actual):
    if value is None:
        return actual
    if not _is_int(value):
        raise TypeError(f"{name}: expected None or an int, got {type(value).__name__} {value!r}")
    if int(value) < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {int(value)}")
    if actual is not None and int(value) < actual:
        raise ValueError(f"{name}: expected at least the longest sequence ({actual}), got {int(value)}")
    return int(value)


def check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, window=(-1, -1), softcap=0.0, *,
                      max_seqlen_q=None, max_seqlen_k=None, causal=False, softmax_scale=None,
                      dtypes=ATTENTION_DTYPES, check_values=True):
    """Check the arguments of `flash_attention_varlen` and return their sizes.

    Packed q [total_q, Hq, D], k and v [total_k, Hkv, D] (one dtype from `dtypes`, no empty dimension,
    Hq % Hkv == 0, 1 <= D <= 256); `cu_seqlens_q` and `cu_seqlens_k` int32 [B + 1]. Shapes and dtypes are
    read from `.shape` / `.dtype` only. With `check_values=True` (default) the offsets must start at 0,
    never decrease and end at total_q / total_k, and `max_seqlen_q` / `max_seqlen_k`, when given, must
    be at least the longest sequence (a smaller value would make a kernel skip rows). Checking values
    reads the offsets on the host: for CuPy arrays that is a device-to-host copy with `.get()`, which
    synchronizes the stream. With `check_values=False` nothing is copied unless a max_seqlen is None
    (it is then computed from the offsets). Returns `VarlenShape(B, total_q, total_k, Hq, Hkv, D,
    max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k)` with host copies of the offsets when read.
    """
    _check_qkv(q, k, v, "[total_q, Hq, D]", "[total_k, Hkv, D]", dtypes)
    total_q, Hq, D = (int(n) for n in q.shape)
    total_k, Hkv, Dk = (int(n) for n in k.shape)
    if Dk != D:
        raise ValueError(f"k: expected shape [total_k, Hkv, D] with D == q's {D}, got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _check_heads(Hq, Hkv, "q", "k")
    _check_int32("cu_seqlens_q", cu_seqlens_q, 1, "[B + 1]")
    _check_int32("cu_seqlens_k", cu_seqlens_k, 1, "[B + 1]")
    nq, nk = int(cu_seqlens_q.shape[0]), int(cu_seqlens_k.shape[0])
    if nq < 2:
        raise ValueError(f"cu_seqlens_q: expected B + 1 >= 2 offsets, got {nq}")
    if nk != nq:
        raise ValueError(f"cu_seqlens_k: expected {nq} offsets (B + 1, as cu_seqlens_q), got {nk}")
    _check_options(window, softcap, causal, softmax_scale, D)
    cu_q = cu_k = None
    max_q = max_k = None
    if check_values or max_seqlen_q is None or max_seqlen_k is None:
        cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "q")
        cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "k")
        max_q, max_k = int(np.diff(cu_q).max()), int(np.diff(cu_k).max())
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, max_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, max_k)
    return VarlenShape(nq - 1, total_q, total_k, Hq, Hkv, D, max_q, max_k, cu_q, cu_k)


def check_paged_args(q, k_cache, v_cache, block_table, seq_lens, window=(-1, -1), softcap=0.0, *,
                     softmax_scale=None, dtypes=ATTENTION_DTYPES, check_values=True):
    """Check the arguments of `paged_attention` and return their sizes.

    q [B, Hq, D]; k_cache and v_cache [num_blocks, block_size, Hkv, D] of q's dtype (one of `dtypes`),
    block_size a power of two from 1 to 256, Hq % Hkv == 0, 1 <= D <= 256; block_table int32
    [B, max_blocks]; seq_lens int32 [B]. Shapes and dtypes are read from `.shape` / `.dtype` only.
    With `check_values=True` (default) every seq_lens[b] must be in [1, max_blocks * block_size] and the
    first ceil(seq_lens[b] / block_size) entries of block_table[b] (the ones used) in [0, num_blocks);
    entries past those are never read and may hold anything. Checking values reads block_table and
    seq_lens on the host: for CuPy arrays that is a device-to-host copy with `.get()`, which synchronizes
    the stream. Returns `PagedShape(B, Hq, Hkv, D, num_blocks, block_size, max_blocks, block_table,
    seq_lens)` with host copies of the two int arrays when values were checked (else None).
    """
    _check_qkv(q, k_cache, v_cache, "[B, Hq, D]", "[num_blocks, block_size, Hkv, D]", dtypes,
               k_name="k_cache", v_name="v_cache")
    B, Hq, D = (int(n) for n in q.shape)
    num_blocks, block_size, Hkv, Dk = (int(n) for n in k_cache.shape)
    if Dk != D:
        raise ValueError(f"k_cache: expected shape [num_blocks, block_size, Hkv, D] with D == q's {D}, "
                         f"got {tuple(k_cache.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    if block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"k_cache: expected a block_size (dimension 1) that is a power of two from 1 to "
                         f"{MAX_BLOCK_SIZE}, got {block_size}")
    _check_heads(Hq, Hkv, "q", "k_cache")
    _check_int32("block_table", block_table, 2, "[B, max_blocks]")
    _check_int32("seq_lens", seq_lens, 1, "[B]")
    if int(block_table.shape[0]) != B or int(block_table.shape[1]) < 1:
        raise ValueError(f"block_table: expected shape [B, max_blocks] with B == q's {B} and max_blocks >= 1, "
                         f"got {tuple(block_table.shape)}")
    if int(seq_lens.shape[0]) != B:
        raise ValueError(f"seq_lens: expected shape [B] with B == q's {B}, got {tuple(seq_lens.shape)}")
    check_window(window)
    check_softcap(softcap)
    effective_scale(softmax_scale, D)
    max_blocks = int(block_table.shape[1])
    table = lens = None
    if check_values:
        table, lens = check_paged_values(block_table, seq_lens, num_blocks, block_size)
    return PagedShape(B, Hq, Hkv, D, num_blocks, block_size, max_blocks, table, lens)


def check_paged_values(block_table, seq_lens, num_blocks, block_size):
    """The value half of `check_paged_args` (its shapes and dtypes already checked): every seq_lens[b] in
    [1, max_blocks * block_size], the entries of block_table[b] in use in [0, num_blocks). Returns host int64
    copies (block_table, seq_lens); for CuPy arrays the copy synchronizes the stream."""
    lens = _to_host(seq_lens).astype(np.int64)
    table = _to_host(block_table).astype(np.int64)
    capacity = int(table.shape[1]) * block_size
    for b, n in enumerate(lens):
        if not 1 <= n <= capacity:
            raise ValueError(f"seq_lens: expected values from 1 to max_blocks * block_size = {capacity}, "
                             f"got {int(n)} at index {b}")
        used = table[b, :-(-int(n) // block_size)]
        bad = (used < 0) | (used >= num_blocks)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"block_table: expected block ids in [0, {num_blocks}) (k_cache has {num_blocks} "
                             f"blocks), got {int(used[j])} at [{b}, {j}]")
    return table, lens


def _require_numpy(**arrays):
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: the reference takes numpy.ndarray, got {type(x).__module__}."
                            f"{type(x).__name__} (vbw_cupy.attention runs GPU arrays)")


def check_mode(check) -> str:
    """The `check` option of the ops that read index arrays: "device" (default: checked by the kernel, no sync; see _errors.py)
    or "host" (read and checked on the host first; synchronizes). True and False mean "host" and "device"."""
    if check is True or isinstance(check, str) and check == "host":
        return "host"
    if check is False or isinstance(check, str) and check == "device":
        return "device"
    err = ValueError if isinstance(check, str) else TypeError
    raise err(f"check: expected \"device\", \"host\", True or False, got {check!r}")


# ---- block-sparse attention -------------------------------------------------------------------

#: block sizes block_sparse_attention takes (query blocks, key blocks)
SPARSE_BLOCK_Q = (16, 64, 128)
SPARSE_BLOCK_K = (16, 64, 128)
_INT31 = 2**31 - 1


class SparseShape(_NamedTuple):
    """Sizes of a `block_sparse_attention` call (returned by `check_sparse_args`).

    `patterns` is 1 (one pattern shared by every (batch, head)) or B * Hkv (one per (batch, KV head));
    `nnz` the length of each pattern's indices; `indptr` / `indices` host int64 copies [patterns, ...] when
    values were checked, else None."""
    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int
    block_q: int
    block_k: int
    n_q_blocks: int
    n_k_blocks: int
    patterns: int
    nnz: int
    indptr: np.ndarray | None
    indices: np.ndarray | None


def _check_block(name, value, allowed):
    if not _is_int(value):
        raise TypeError(f"{name}: expected an int from {allowed}, got {type(value).__name__} {value!r}")
    if int(value) not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {int(value)}")
    return int(value)


def check_sparse_args(q, k, v, indptr, indices, *, block_q, block_k, causal=False, softmax_scale=None,
                      softcap=0.0, dtypes=ATTENTION_DTYPES, check_values=True):
    """Check the arguments of `block_sparse_attention` and return their sizes.

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] as `check_attention_args`; block_q and block_k from
    SPARSE_BLOCK_Q / SPARSE_BLOCK_K. The pattern (int32) is either shared, indptr [n_q_blocks + 1] and indices
    [nnz], or one per (batch, KV head), indptr [B, Hkv, n_q_blocks + 1] and indices [B, Hkv, nnz] (each
    pattern's indptr indexes its own row of indices; entries past its last indptr are padding), with
    n_q_blocks = ceil(Sq / block_q). With `check_values=True` every pattern's indptr must start at 0, never
    decrease and end at most at nnz, and the block ids a row lists must lie in [0, ceil(Sk / block_k)) with no
    duplicate in a row; reading them is a device-to-host copy (a sync) for GPU arrays. Returns `SparseShape`.
    """
    B, Sq, Sk, Hq, Hkv, D = _check_dense_qkv(q, k, v, dtypes)
    block_q = _check_block("block_q", block_q, SPARSE_BLOCK_Q)
    block_k = _check_block("block_k", block_k, SPARSE_BLOCK_K)
    nqb, nkb = -(-Sq // block_q), -(-Sk // block_k)
    if not (hasattr(indptr, "ndim") and indptr.ndim in (1, 3)):
        _check_array("indptr", indptr, 1, "[n_q_blocks + 1] or [B, Hkv, n_q_blocks + 1]")
    if indptr.ndim == 1:
        _check_int32("indptr", indptr, 1, "[n_q_blocks + 1]")
        _check_int32("indices", indices, 1, "[nnz] (indptr is 1-d: one shared pattern)")
        if int(indptr.shape[0]) != nqb + 1:
            raise ValueError(f"indptr: expected shape [n_q_blocks + 1] = [{nqb + 1}] (Sq = {Sq}, block_q = "
                             f"{block_q}), got {tuple(indptr.shape)}")
        patterns = 1
    else:
        _check_int32("indptr", indptr, 3, "[B, Hkv, n_q_blocks + 1]")
        _check_int32("indices", indices, 3, "[B, Hkv, nnz] (indptr is 3-d: one pattern per (batch, KV head))")
        if tuple(int(n) for n in indptr.shape) != (B, Hkv, nqb + 1):
            raise ValueError(f"indptr: expected shape [B, Hkv, n_q_blocks + 1] = {(B, Hkv, nqb + 1)}, "
                             f"got {tuple(indptr.shape)}")
        if tuple(int(n) for n in indices.shape[:2]) != (B, Hkv):
            raise ValueError(f"indices: expected shape [B, Hkv, nnz] with (B, Hkv) == {(B, Hkv)}, "
                             f"got {tuple(indices.shape)}")
        patterns = B * Hkv
    nnz = int(indices.shape[-1])
    if nnz * block_k > _INT31 or Sq > (1 << 30) - 1 or Sk > (1 << 30) - 1:
        raise ValueError(f"indices: expected nnz * block_k < 2^31 and sequences under 2^30 tokens, got nnz = {nnz}, "
                         f"Sq = {Sq}, Sk = {Sk}")
    if nqb * B * Hq > _INT31:
        raise ValueError(f"q: {B} x {Hq} heads x {nqb} query blocks need more than {_INT31} thread blocks")
    check_flag("causal", causal)
    check_softcap(softcap)
    effective_scale(softmax_scale, D)
    ptr = idx = None
    if check_values:
        ptr, idx = check_sparse_values(indptr, indices, nkb)
    return SparseShape(B, Sq, Sk, Hq, Hkv, D, block_q, block_k, nqb, nkb, patterns, nnz, ptr, idx)


def check_sparse_values(indptr, indices, n_k_blocks):
    """The value half of `check_sparse_args`; returns host int64 copies (indptr [P, n_q_blocks + 1], indices
    [P, nnz]). For GPU arrays the copy synchronizes the stream."""
    ptr = _to_host(indptr).astype(np.int64)
    idx = _to_host(indices).astype(np.int64)
    ptr = ptr.reshape(-1, ptr.shape[-1])
    idx = idx.reshape(ptr.shape[0], -1)
    nnz = idx.shape[1]
    where = (lambda p: "" if ptr.shape[0] == 1 else f" of pattern {np.unravel_index(p, indptr.shape[:-1])}")
    for p in range(ptr.shape[0]):
        row = ptr[p]
        _check_offsets("indptr", row, "query block", where(p))
        if row[-1] > nnz:
            raise ValueError(f"indptr: expected offsets up to the length of indices ({nnz}), got {int(row[-1])}"
                             f"{where(p)}")
        used = idx[p, :row[-1]]
        bad = (used < 0) | (used >= n_k_blocks)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"indices: expected key block ids in [0, {n_k_blocks}) (n_k_blocks = ceil(Sk / "
                             f"block_k)), got {int(used[j])} at position {j}{where(p)}")
        rows = np.repeat(np.arange(len(row) - 1), np.diff(row))
        key = np.sort(rows * n_k_blocks + used)
        dup = key[1:] == key[:-1]
        if dup.any():
            qb, blk = divmod(int(key[1:][dup][0]), n_k_blocks)
            raise ValueError(f"indices: expected distinct key blocks in a row, query block {qb} lists block {blk} "
                             f"more than once{where(p)}")
    return ptr, idx
