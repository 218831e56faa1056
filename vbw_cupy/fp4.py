"""FP4 block-scaled formats (docs/formats.md): FP4Tensor, quantize, dequantize.

NumPy inputs run `vbw_cupy.reference`; CuPy inputs (or DLPack / CUDA-array-interface objects) run the
kernels of ``cuda_src/fp4_codec.cu``, bit-identical to the reference.
"""
from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from . import _checks
from . import _device
from . import _errors
from . import _plans
from . import _runtime as rt
from . import _timing
from . import reference as ref
from .fp8 import FP8Tensor, dequantize_fp8

FORMATS = ref.FORMATS
_IN_DTYPES = _checks.FLOAT_DTYPES
# dtype objects for the hot-path test (dtype.name costs ~1.6 us); the names still decide for other byte orders
_IN_DTYPE_SET = frozenset(np.dtype(ml_dtypes.bfloat16 if n == "bfloat16" else n) for n in _IN_DTYPES)
_SOURCE = "fp4_codec.cu"
_THREADS = 256
_NAN_MSG = "x: NaN or Inf in the input; nvfp4 has no NaN scale (use mxfp4, or clean the input)"


@dataclasses.dataclass(frozen=True, eq=False)
class FP4Tensor:
    """A tensor of E2M1 elements with per-block scales along the last axis.

    data:         uint8 [..., ceil(K/block)*block/2], element 2i in the low nibble of byte i
    scales:       uint8 [..., ceil(K/block)], raw E8M0 (mxfp4) or E4M3 (nvfp4) codes
    global_scale: float32 tensor scale (1.0 for mxfp4)
    format:       "mxfp4" (block 32) or "nvfp4" (block 16)
    shape:        logical shape [..., K], K unpadded
    data and scales are both NumPy or both CuPy arrays on one device.
    """
    data: object
    scales: object
    global_scale: np.float32
    format: str
    shape: tuple
    # Derived layouts (a GEMM's pre-shuffled weights, say), built once on first use; each tensor its own (a copy
    # or dataclasses.replace() starts empty: it would otherwise replay the original's layout and scale).
    _cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.format, str) or self.format not in FORMATS:
            raise ValueError(f"format: expected one of {sorted(FORMATS)}, got {self.format!r}")
        shape = _checks.check_shape(self.shape)
        object.__setattr__(self, "shape", shape)
        gs = _global_scale_value(self.global_scale)
        if self.format == "mxfp4" and gs != 1:
            raise ValueError(f"global_scale: mxfp4 has no tensor scale (expected 1.0), got {self.global_scale!r}")
        object.__setattr__(self, "global_scale", gs)
        block = FORMATS[self.format]
        if len(shape) < 1 or shape[-1] < 1:
            raise ValueError(f"shape: expected [..., K] with K >= 1, got {shape}")
        nb = -(-shape[-1] // block)
        for name, arr, last in (("data", self.data, nb * block // 2), ("scales", self.scales, nb)):
            if str(getattr(arr, "dtype", None)) != "uint8":
                raise TypeError(f"{name}: expected uint8, got {getattr(arr, 'dtype', type(arr).__name__)}")
            if tuple(arr.shape) != shape[:-1] + (last,):
                raise ValueError(f"{name}: expected shape {shape[:-1] + (last,)} for logical shape {shape} "
                                 f"in {self.format}, got {tuple(arr.shape)}")
        if rt.is_gpu_array(self.data) != rt.is_gpu_array(self.scales):
            raise ValueError("data and scales must both be NumPy or both CuPy arrays")
        rt.check_same_device(data=self.data, scales=self.scales)
        # kernels read rows of codes with 8- and 16-byte loads: hold dense, aligned copies of any views
        for name in ("data", "scales"):
            arr = getattr(self, name)
            if rt.is_gpu_array(arr) and (not arr.flags.c_contiguous or arr.data.ptr % 16):
                object.__setattr__(self, name, arr.copy())
            elif isinstance(arr, np.ndarray) and not arr.flags.c_contiguous:
                object.__setattr__(self, name, np.ascontiguousarray(arr))

    @classmethod
    def _trusted(cls, data, scales, global_scale, format, shape) -> "FP4Tensor":
        """An FP4Tensor from parts the library has just built and knows valid, without __post_init__'s checks
        (a third of a short quantize's host time): data and scales dense uint8 arrays of the right shapes on
        one device, 16-byte aligned when on the GPU; global_scale a positive finite np.float32; format a key
        of FORMATS; shape a tuple of ints. User-built FP4Tensors keep going through the checks."""
        t = object.__new__(cls)
        # a frozen dataclass only guards __setattr__: filling __dict__ is what object.__setattr__ would do
        t.__dict__.update(data=data, scales=scales, global_scale=global_scale, format=format, shape=shape,
                          _cache={})
        return t

    def __copy__(self) -> "FP4Tensor":
        return FP4Tensor._trusted(self.data, self.scales, self.global_scale, self.format, self.shape)

    def __deepcopy__(self, memo) -> "FP4Tensor":
        import copy
        return FP4Tensor._trusted(copy.deepcopy(self.data, memo), copy.deepcopy(self.scales, memo),
                                  self.global_scale, self.format, self.shape)

    def invalidate(self) -> None:
        """Forget what was derived from data and scales: call it after changing them in place
        (``w.data[...] = new``). fp4_matmul keeps a weight's re-laid-out copy and its launch plans in the tensor
        (built on first use); without this call it would go on multiplying by the old values. A CUDA graph
        captured before the change keeps the old copy: capture it again."""
        self._cache.clear()

    @property
    def block_size(self) -> int:
        """Elements a block scale covers: 32 (mxfp4) or 16 (nvfp4)."""
        return FORMATS[self.format]

    @property
    def nbytes(self) -> int:
        """True storage: packed elements + block scales + the 4-byte tensor scale (MXFP4's too: always 1.0)."""
        return int(self.data.nbytes + self.scales.nbytes + 4)

    @property
    def is_gpu(self) -> bool:
        """Whether data and scales are CuPy arrays (else NumPy)."""
        return rt.is_gpu_array(self.data)

    def to_gpu(self) -> "FP4Tensor":
        """The same tensor with data and scales on the GPU: copied to the current device from NumPy (a GPU tensor's
        arrays are taken as they are)."""
        cp = rt.require_cupy()
        if self.is_gpu:  # already there: the same (checked) arrays, on the current device as before
            return FP4Tensor(cp.asarray(self.data), cp.asarray(self.scales), self.global_scale, self.format,
                             self.shape)
        # fresh device copies of dense host arrays: dense and aligned
        return FP4Tensor._trusted(cp.asarray(self.data), cp.asarray(self.scales), self.global_scale, self.format,
                                  self.shape)

    def to_cpu(self) -> "FP4Tensor":
        """The same tensor with data and scales as NumPy arrays (the reference path takes it)."""
        if not self.is_gpu:
            return FP4Tensor(self.data, self.scales, self.global_scale, self.format, self.shape)
        return FP4Tensor._trusted(self.data.get(), self.scales.get(), self.global_scale, self.format, self.shape)


def _as_input(x, name: str):
    """NumPy arrays stay NumPy (reference path); everything else must become a CuPy array."""
    return x if isinstance(x, np.ndarray) else rt.as_gpu_array(x, name)


def _global_scale_value(gs) -> np.float32:
    """A tensor scale as FP4Tensor and quantize take it: a real scalar (a number, or a 0-d array of a real dtype,
    NumPy or CuPy; TypeError otherwise: strings, booleans, complex numbers, arrays of values) that is a positive
    finite float32 (ValueError otherwise)."""
    dtype = getattr(gs, "dtype", None)
    if isinstance(gs, (bool, np.bool_, str, bytes)) or np.ndim(gs) != 0 or \
            (dtype is not None and getattr(dtype, "kind", None) not in ("i", "u", "f")):
        raise TypeError(f"global_scale: expected a real number, got {type(gs).__name__} {_short(gs)}")
    try:
        g = _checks._float_or_inf(gs)  # (an int past float's range: inf, refused below)
    except (TypeError, ValueError):  # complex, or an object float() does not take
        raise TypeError(f"global_scale: expected a real number, got {type(gs).__name__} {_short(gs)}") from None
    with np.errstate(over="ignore"):
        g32 = np.float32(g)
    if not (math.isfinite(g) and g > 0 and np.isfinite(g32) and g32 > 0):
        raise ValueError(f"global_scale: expected a positive finite float32, got {_short(gs)}")
    return g32


def _short(x, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[:n - 3] + "..."


def _check_global_scale(global_scale, fmt):
    """quantize's global_scale: None, or (nvfp4 only) what _global_scale_value accepts."""
    if global_scale is None:
        return None
    if fmt == "mxfp4":
        raise ValueError(f"global_scale: mxfp4 has no tensor scale, got {_short(global_scale)} (pass None)")
    return _global_scale_value(global_scale)


def quantize(x, format: str = "nvfp4", global_scale=None) -> FP4Tensor:
    """Quantize `x` [..., K] (float16 / bfloat16 / float32) to MXFP4 or NVFP4 along the last axis.

    MXFP4: blocks of 32, E8M0 scale 2^(floor(log2(amax)) - 2); a block holding NaN/Inf gets scale code
    255 (decodes to NaN). NVFP4: blocks of 16, E4M3 scale, float32 `global_scale` (default
    amax / (448 * 6), or 1.0 where that is 0: all zeros, or amax under ~1.9e-42); NaN or Inf anywhere is a
    ValueError. Any K: the last block is zero-padded.
    A given `global_scale` must be at least max|x| / 3072 (= max|x| / (6 * 512)): smaller, a block would need
    an E4M3 scale above 512 (E4M3 stops at 448) and its elements would saturate past E2M1's rounding error at 6;
    that is a ValueError naming global_scale. A large one is allowed: blocks whose scale max|block| /
    (6 * global_scale) falls below E4M3's smallest, 2^-9, use 2^-9 and lose precision gracefully (absolute
    error at most 2^-9 * global_scale per element, as the default scale gives tiny blocks of a large tensor).
    On the GPU, NVFP4 without a `global_scale` reads the tensor twice (amax first) and synchronizes once to read
    the amax (a NaN / Inf raises there). With a `global_scale` it makes one pass and no sync (it can then be
    captured in a CUDA graph): NaN / Inf and a too small global_scale are flagged on the device and
    `vbw_cupy.check_errors()` raises them (the output is then unusable).
    A CuPy call with the shape, dtype, format, global_scale and device of an
    earlier checked call reuses its launch plan (contiguity, alignment and device are checked every time).

    >>> import numpy as np, vbw_cupy
    >>> t = vbw_cupy.quantize(np.array([[0.3, -1.2, 5.0, 6.5]], np.float32), "mxfp4")
    >>> vbw_cupy.dequantize(t)
    array([[ 0.5, -1. ,  4. ,  6. ]], dtype=float32)
    """
    # Fast path: a CuPy array of the shape, dtype, format, global_scale (type and value) and current device of an
    # earlier call that was checked in full below replays that call's launch plan; only what can differ
    # between such calls is re-checked (contiguity, 16-byte alignment, the array's device).
    cp = rt.cupy
    key = None
    if cp is not None and type(x) is cp.ndarray:
        try:
            key = (x.shape, x.dtype, format, type(global_scale), global_scale, cp.cuda.runtime.getDevice())
            plan = _q_plans.get(key)
        except TypeError:  # an unhashable format or global_scale: the full path says what is wrong
            key = plan = None
        if plan is not None and x.flags.c_contiguous and x.data.ptr % 16 == 0 and x.data.device_id == plan[7]:
            return _quantize_planned(plan, x)
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(f"format: expected one of {sorted(FORMATS)}, got {format!r}")
    gs = _check_global_scale(global_scale, format)
    x_in = x
    x = _as_input(x, "x")
    if x.dtype not in _IN_DTYPE_SET and x.dtype.name not in _IN_DTYPES:
        raise TypeError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    _checks.check_rows(x)
    if isinstance(x, np.ndarray):
        return _quantize_reference(x, format, gs)
    # a plan is kept only for a CuPy input used as is (no copy) on the current device
    keep = key if key is not None and x is x_in and x.device.id == key[-1] else None
    with x.device:
        return _quantize_gpu(x, format, gs, keep)


def _quantize_reference(x, fmt, gs):
    if fmt == "mxfp4":
        data, scales = ref.quantize_mxfp4(x)
        return FP4Tensor(data, scales, np.float32(1.0), fmt, x.shape)
    if not np.all(np.isfinite(x.astype(np.float32))):
        raise ValueError(_NAN_MSG)
    if gs is None:
        gs = ref.nvfp4_global_scale(x)
    else:
        _checks.check_nvfp4_global_scale(np.max(np.abs(x.astype(np.float32))), gs)
    data, scales = ref.quantize_nvfp4(x, gs)
    return FP4Tensor(data, scales, gs, fmt, x.shape)


def _quantize_gpu(x, fmt, gs, keep=None):
    """`keep`: the fast-path key to store this call's launch plan under (None: store nothing)."""
    cp = rt.require_cupy()
    x_in = x
    x = rt.ensure_aligned16(x)
    block = FORMATS[fmt]
    Kp = rt.cdiv(x.shape[-1], block) * block
    data = cp.empty(x.shape[:-1] + (Kp // 2,), dtype=cp.uint8)
    scales = cp.empty(x.shape[:-1] + (Kp // block,), dtype=cp.uint8)
    if fmt == "mxfp4":
        plan = _launch_quantize(x, data, scales, fmt)
        gs = np.float32(1.0)
    else:
        if gs is None:
            gs = _global_scale_gpu(x)
            keep = None  # the tensor scale is read from x on every call: nothing to replay
        # NaN / Inf met by the kernel: the device error word (no sync; check_errors() raises it). Without a
        # global_scale the amax read above has already raised for them.
        plan = _launch_quantize(x, data, scales, fmt, gs, _nan_flag(x.device.id))
    if keep is not None and plan is not None and x is x_in:
        kern, grid, tail = plan
        fast = None
        if _plans.kernel_ptr(kern) is not None:  # replay through the driver with only the three pointers rewritten
            flag = () if fmt == "mxfp4" else (_nan_flag(x.device.id),)
            fast = _plans.Launch(kern, grid, _BLOCK, (x, data, scales) + tail + flag, (0, 1, 2))
        _q_plans.put(keep, plan + (data.shape, scales.shape, gs, fmt, x.device.id, fast))
    return FP4Tensor._trusted(data, scales, gs, fmt, x.shape)


# Launch plans of checked quantize calls, by fast-path key: (kernel, grid, scalar args, data shape, scales shape,
# global scale, format, device id, its _plans.Launch or None).
_q_plans = _plans.PlanCache()


def _nan_flag(device_id):
    """The error-word slots the nvfp4 kernel sets on NaN / Inf input and on a too small global_scale (see
    vbw_cupy/_errors.py)."""
    return _errors.slot(device_id, _errors.NVFP4_NONFINITE)


def _quantize_planned(plan, x):
    cp = rt.cupy
    kern, grid, tail, data_shape, scales_shape, gs, fmt, dev, fast = plan
    data = cp.empty(data_shape, dtype=cp.uint8)
    scales = cp.empty(scales_shape, dtype=cp.uint8)
    if fast is not None:
        fast((x.data.ptr, data.data.ptr, scales.data.ptr), cp.cuda.get_current_stream().ptr)
    elif fmt == "mxfp4":
        kern(grid, _BLOCK, (x, data, scales) + tail)  # on the current stream, as rt.launch
    else:
        kern(grid, _BLOCK, (x, data, scales) + tail + (_nan_flag(dev),))
    return FP4Tensor._trusted(data, scales, gs, fmt, x.shape)


# mxfp4_quantize and 16-bit nvfp4_quantize: one resident wave (__launch_bounds__(256, 3)), grid-stride with prefetch
_Q_CTAS_PER_SM = 3
_Q_MAX_UNITS = 1 << 30  # the kernels number 16-element units in 32 bits: larger tensors go in row chunks


def _quantize_grid(fmt: str, units: int, itemsize: int) -> int:
    """CTAs for `units` 16-element units. A thread step reads 64 bytes (2 units of a 16-bit type, 1 of float32).
    MXFP4 and 16-bit NVFP4: one resident wave, every thread the same number of steps. float32 NVFP4: one step
    per thread."""
    steps = rt.cdiv(units, 64 // itemsize // 16)
    if fmt == "nvfp4" and itemsize == 4:
        return max(1, rt.cdiv(steps, _THREADS))
    iters = rt.cdiv(steps, _device.num_sms() * _Q_CTAS_PER_SM * _THREADS)
    return max(1, rt.cdiv(steps, iters * _THREADS))


_BLOCK = (_THREADS,)


def _launch_quantize(x, data, scales, fmt, gs=None, flag=None):
    """The quantize kernel alone, into preallocated outputs (the benchmark times this too). Returns
    (kernel, grid, the scalar arguments after x, data, scales and before nvfp4's flag) when it was one
    launch, else None."""
    block = FORMATS[fmt]
    K = x.shape[-1]
    R = x.size // K
    Kp = rt.cdiv(K, block) * block
    upr = Kp // 16  # 16-element units per row
    kern = rt.get_kernel(_SOURCE, f"{fmt}_quantize<{rt.ctype(x.dtype)}, {'true' if K % block == 0 else 'false'}>")
    extra = (np.float32(gs), flag) if fmt == "nvfp4" else ()
    if R * upr <= _Q_MAX_UNITS:
        grid = (_quantize_grid(fmt, R * upr, x.dtype.itemsize),)
        tail = (np.int64(R), np.int64(K), np.int64(Kp)) + extra[:1]
        rt.launch(kern, grid, _BLOCK, (x, data, scales) + tail + extra[1:])
        return kern, grid, tail
    if upr > _Q_MAX_UNITS:
        raise ValueError(f"x: rows of {K} elements are too long for the quantize kernels")
    rows = max(2, _Q_MAX_UNITS // upr // 2 * 2)  # even, so chunks keep the 16-byte store alignment
    x, data, scales = x.reshape(R, K), data.reshape(R, Kp // 2), scales.reshape(R, Kp // block)
    for r0 in range(0, R, rows):
        n = min(rows, R - r0)
        grid = (_quantize_grid(fmt, n * upr, x.dtype.itemsize),)
        rt.launch(kern, grid, _BLOCK, (x[r0:r0 + n], data[r0:r0 + n], scales[r0:r0 + n], np.int64(n),
                                       np.int64(K), np.int64(Kp)) + extra)
    return None


def launch_abs_max(x, out) -> None:
    """max |x| over a contiguous, 16-byte aligned GPU array into out (uint32 [1], zeroed by the caller) as float32
    bits, NaN winning (the bits of NaN exceed Inf's): the amax pass of NVFP4's default global scale and of
    attention_fp8.quantize_e4m3. No sync."""
    n = x.size
    grid = (max(1, min(rt.cdiv(n * x.itemsize // 16 + 1, _THREADS), _device.num_sms() * 8)),)
    rt.launch(rt.get_kernel(_SOURCE, f"abs_max<{rt.ctype(x.dtype)}>"), grid, (_THREADS,), (x, np.int64(n), out))


def _global_scale_gpu(x) -> np.float32:
    cp = rt.require_cupy()
    out = cp.zeros(1, dtype=cp.uint32)
    launch_abs_max(x, out)
    amax = out.get().view(np.float32)[0]
    if not np.isfinite(amax):
        raise ValueError(_NAN_MSG)
    return ref.nvfp4_global_scale_of_amax(amax)


def dequantize(t: FP4Tensor, dtype=np.float32):
    """Decode `t` to an array of `t.shape`: (e2m1 * scale) * global_scale in float32, then cast to `dtype`
    (float32, float16 or bfloat16, rounding to nearest even; float64 holds the float32 values exactly).
    MXFP4 decodes exactly; scale code 255 (mxfp4), 0x7F or 0xFF (nvfp4, E4M3FN) -> NaN for its block.
    An FP8Tensor goes to `vbw_cupy.fp8.dequantize_fp8`."""
    if isinstance(t, FP8Tensor):
        return dequantize_fp8(t, dtype)
    if not isinstance(t, FP4Tensor):
        raise TypeError(f"t: expected an FP4Tensor or FP8Tensor, got {type(t).__name__}")
    dtype = _checks.check_float_dtype("dtype", dtype, _checks.FLOAT_DTYPES + ("float64",))
    if not t.is_gpu:
        return ref.dequantize(t, dtype)
    cp = rt.require_cupy()
    with t.data.device:
        out = cp.empty(t.shape, dtype=dtype)   # float64 in the kernel too: CuPy's casts flush denormals
        _launch_dequantize(t, out)
        return out


def _launch_dequantize(t, out):
    """The dequantize kernel alone, into a preallocated output (the benchmark times this too)."""
    K = t.shape[-1]
    R = math.prod(t.shape[:-1])
    Kp = t.data.shape[-1] * 2
    flat = K % t.block_size == 0
    name = f"fp4_dequantize<{rt.ctype(out.dtype)}, {t.block_size}, {'true' if flat else 'false'}>"
    grid = (rt.cdiv(R * rt.cdiv(K, 16 if flat else 8), _THREADS),)
    rt.launch(rt.get_kernel(_SOURCE, name), grid, (_THREADS,),
              (t.data, t.scales, out, np.int64(R), np.int64(K), np.int64(Kp), np.float32(t.global_scale)))


def kernel_instances() -> list[tuple[str, str]]:
    out = []
    for T in ("__half", "__nv_bfloat16", "float"):
        out.append((_SOURCE, f"abs_max<{T}>"))
        for flat in ("true", "false"):
            out += [(_SOURCE, f"mxfp4_quantize<{T}, {flat}>"), (_SOURCE, f"nvfp4_quantize<{T}, {flat}>")]
            out += [(_SOURCE, f"fp4_dequantize<{T}, {b}, {flat}>") for b in (16, 32)]
    return out + [(_SOURCE, f"fp4_dequantize<double, {b}, {flat}>") for b in (16, 32) for flat in ("true", "false")]


def _bitexact_case(fmt, dtype, shape):
    """Quantize + dequantize on the GPU against the reference (bit for bit) at `shape`; the public calls
    are then timed at 8192 x 8192 against a copy that moves the same bytes."""
    def case():
        cp = rt.require_cupy()
        rng = np.random.default_rng(0)
        x = (rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, shape[:-1] + (1,)))).astype(dtype)
        t, tr = quantize(cp.asarray(x), fmt), quantize(x, fmt)
        d, dr = dequantize(t, dtype).get(), dequantize(tr, dtype)
        # mismatching bytes of codes, scales and decoded values, as a fraction of all compared
        bad = int((t.data.get() != tr.data).sum() + (t.scales.get() != tr.scales).sum()
                  + (d.view(np.uint8) != dr.view(np.uint8)).sum() + (t.global_scale != tr.global_scale))
        frac = bad / (t.data.size + t.scales.size + d.nbytes + 1)
        big = cp.asarray(rng.standard_normal((8192, 8192), dtype=np.float32)).astype(dtype)
        tb = quantize(big, fmt)
        peer = _timing.copy_time_ms(big.nbytes + tb.nbytes)
        what = f"{np.dtype(dtype).name}, exact at {shape}, timed at 8192x8192"
        return [{"op": f"{op} {fmt}", "shape": what, "error": frac, "bound": 0.0, "ok": bad == 0, "time_ms": ms,
                 "peer": "copy of the same bytes", "peer_ms": peer}
                for op, ms in (("quantize", _timing.time_ms(lambda: quantize(big, fmt))),
                               ("dequantize", _timing.time_ms(lambda: dequantize(tb, dtype))))]
    case.__qualname__ = f"fp4 {fmt} {np.dtype(dtype).name}"
    return case


def selftest_cases():
    return [_bitexact_case(f, np.float16, (4096, 4111)) for f in ("mxfp4", "nvfp4")] + \
           [_bitexact_case("nvfp4", ml_dtypes.bfloat16, (1024, 4096))]
