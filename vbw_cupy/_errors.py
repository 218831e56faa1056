"""The device error word: bad index values found by a kernel, reported without a host sync.

Kernels that read through index arrays (paged_attention's block_table and seq_lens, flash_attention_varlen's
cu_seqlens, block_sparse_attention's indptr and indices) check every index on the device. A sequence (a query
block) with a bad one gets NaN output rows and a flag in this device's error word (cuda_src/errors.cuh); nothing is read or written out of bounds and the call does not
synchronize. `check_errors()` copies the word to the host (a sync), clears it and raises ValueError naming the
operation, the argument and the first bad sequence. A call made with ``check="host"`` checks the word too.

The word is one int32[16] per device, allocated on the first GPU call that needs it and never freed, so a CUDA
graph that captured its address can be replayed for the life of the process.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _checks
from . import _runtime as rt

# code -> (operation, argument, what was wrong); cuda_src/errors.cuh has the same codes
CODES = {
    1: ("paged_attention", "seq_lens", "a length outside [1, max_blocks * block_size]"),
    2: ("paged_attention", "block_table", "a block id in use outside [0, num_blocks)"),
    3: ("flash_attention_varlen", "cu_seqlens_q",
        "offsets out of order or past the tokens, or a sequence longer than max_seqlen_q"),
    4: ("flash_attention_varlen", "cu_seqlens_k",
        "offsets out of order or past the tokens, or a sequence longer than max_seqlen_k"),
    5: ("quantize", "x", "NaN or Inf in the input of an nvfp4 quantize with a given global_scale"),
    6: ("models.LlamaGPU", "tokens", "a token id outside [0, vocab_size)"),
    7: ("models.LlamaGPU", "positions", "a position past the model's seq_len or the cache's capacity, or a bad slot"),
    8: ("quantize", "global_scale", "too small for x: a block needs an E4M3 scale max|block| / (6 * global_scale) "
        "above 512 and its elements saturate; use global_scale >= max|x| / 3072, or None for the default"),
    9: ("block_sparse_attention", "indptr / indices",
        "indptr not starting at 0, decreasing or past the indices, or a block id outside [0, n_k_blocks)"),
}
OPS = frozenset(o for o, _, _ in CODES.values())  # the operation names check_errors(op=...) takes
NVFP4_NONFINITE = 5
_INDEXED = {1, 2, 3, 4, 6, 7, 9}  # codes that record the smallest bad sequence
_WORDS = 16

_lock = threading.Lock()
_buffers: dict = {}  # device id -> cupy int32[16], kept for the life of the process


def buffer(device_id: int | None = None):
    """This device's error word (a CuPy int32[16]); created zeroed on first use."""
    cp = rt.require_cupy()
    dev = cp.cuda.runtime.getDevice() if device_id is None else int(device_id)
    buf = _buffers.get(dev)
    if buf is None:
        with _lock, cp.cuda.Device(dev):
            buf = _buffers.get(dev)
            if buf is None:
                if cp.cuda.get_current_stream().is_capturing():
                    raise RuntimeError("vbw_cupy: the first GPU call on a device cannot be made while a CUDA "
                                       "graph is being captured; call the operation once before capturing")
                buf = cp.zeros(_WORDS, dtype=cp.int32)
                cp.cuda.Device(dev).synchronize()
                _buffers[dev] = buf
    return buf


_slots: dict = {}  # (device id, code) -> a view of the word from that code on (what a kernel's flag pointer takes)


def slot(device_id: int, code: int):
    """The error word from `code` on, for kernels that set one flag (`*flag = 1`) rather than call vbw_err::flag."""
    v = _slots.get((device_id, code))
    if v is None:
        v = _slots[(device_id, code)] = buffer(device_id)[code:]
    return v


def pending(device_id: int | None = None, op: str | None = None) -> list[str]:
    """Messages of the errors flagged on a device (all devices used so far when None), clearing them; with
    `op`, only that operation's (the others stay flagged). Synchronizes those devices."""
    cp = rt.cupy
    if cp is None:
        return []
    msgs = []
    for dev, buf in sorted(_buffers.items()):
        if device_id is not None and dev != device_id:
            continue
        with cp.cuda.Device(dev):
            words = buf.get()
            if op is not None:
                words[[c for c in range(_WORDS) if c not in CODES or CODES[c][0] != op]] = 0
            if not words.any():
                continue
            if op is None:
                buf.fill(0)
            else:
                buf[np.flatnonzero(words)] = 0
        for code in np.flatnonzero(words):
            name, arg, what = CODES.get(int(code), ("a vbw_cupy kernel", "?", f"unknown error code {int(code)}"))
            noun = "sequence" if code <= 4 else "query block" if code == 9 else "row"
            where = (f" (first in {noun} {0x7fffffff - int(words[code])}); the rows of those {noun}s are NaN"
                     if code in _INDEXED else "")
            msgs.append(f"{name}: {arg}: {what}{where} (device {dev})")
    return msgs


def check_errors(device=None, op=None) -> None:
    """Raise ValueError if a kernel flagged bad index values since the last check (see the module docs).

    Synchronizes each device that has run such a kernel; clears the flags it reports. `device`: a device id to
    check only that one (default: every device used); `op`: an operation's name (one of `OPS`:
    "paged_attention", "flash_attention_varlen", "quantize", "block_sparse_attention", "models.LlamaGPU") to
    check only its flags (a ``check="host"`` call does this)."""
    if op is not None and (not isinstance(op, str) or op not in OPS):
        raise ValueError(f"op: expected one of {', '.join(map(repr, sorted(OPS)))} or None, got {op!r}")
    if device is not None and (not _checks._is_int(device) or device < 0):
        raise ValueError(f"device: expected None or a device id (an int >= 0), got {device!r}")
    msgs = pending(None if device is None else int(device), op)
    if msgs:
        raise ValueError("; ".join(msgs))
