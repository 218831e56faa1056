"""Flash attention forward (docs/attention.md): `flash_attention`, `flash_attention_varlen`.

NumPy inputs run `vbw_cupy.reference` (float64). CuPy inputs (or DLPack / CUDA-array-interface objects such as
torch tensors) run a tensor-core kernel of ``cuda_src/attention_fwd.cu`` (FlashAttention-2 style: one CTA per
BLOCK_M query rows of one head, K/V streamed through shared memory, fp32 accumulation, online softmax in fp32;
``attn_fwd`` with mma.sync m16n8k16 and cp.async, ``attn_fwd_wg`` with Hopper wgmma and TMA loads (the
driver encodes the tensor maps, see `_map_args`; cp.async where it cannot)) and return CuPy arrays.

Head dims: any D from 1 to 256 runs the instance compiled for the next of HEAD_DIMS (32, 64, ..., 256); the
kernel zero-fills the missing columns and never reads or writes past D. Configs (KIND "mma" / "wg" / "wgp" / "ws" / "wsp",
BLOCK_M, BLOCK_N, WARPS, Q_REGS, STAGES) are chosen per compiled head dim: a per-architecture default, or the
autotuner's pick (``vbw_cupy.autotune``, one Tunable per head dim, named ``attention_fwd_d<HEAD_DIM>``, timed on
back-to-back launches (``warm_l2``); shape bucket = (pow2 of the longest query sequence, pow2 of the longest key
sequence, each clamped to [64, 16384], 1 if a causal/window mask applies, and `bh_bucket`: batch x query heads
in eighths of the SM count, pow2, clamped to [1, 16], so a call whose grid is a fraction of a wave does not share
its tile with one that fills the GPU many times over). On sm_90, aligned inputs of every head dim above 32 run the
wgmma kernel (``attn_fwd_wg``) by default, compiled for the next wgmma width of 64 / 128 / 192 / 256 (96 on 128,
160 on 192, 224 on 256: the padded columns cost less than mma.sync's lower rate), everything else the mma.sync
one; a wgmma config is never launched off sm_90 or on unaligned inputs (``_runnable``). From a key length that
depends on the head dim (``_WS_FROM``) the sm_90 default is the warp-specialized "ws" tile (a TMA producer
warpgroup and two consumer warpgroups taking turns at the tensor cores, FlashAttention-3's schedule; three
consumer warpgroups at D = 64), with a key tile that may also depend on the length; at D = 96 / 128 / 224 / 256
below 8k keys its persistent form "wsp" (one CTA an SM walking work tiles, the next tile's loads under this one's
epilogue).

Host cost: a `flash_attention` call whose shapes, dtypes, options, device, stream and tuning state match an
earlier checked call replays its launch, re-checking only array types, contiguity, devices and alignment.

Extra device memory beyond q, k, v, o (and lse when asked): none, except contiguous copies of
non-contiguous inputs.
"""
from __future__ import annotations

import functools
import math
import threading

import numpy as np

from . import _checks
from . import _device
from . import _errors
from . import _peers
from . import _plans
from . import _runtime as rt
from . import _timing
from . import reference as ref

try:
    from . import autotune as _autotune
except Exception:  # pragma: no cover - the tuner is optional
    _autotune = None

__all__ = ["flash_attention", "flash_attention_varlen", "HEAD_DIMS", "kernel_instances", "selftest_cases"]

SOURCE = "attention_fwd.cu"
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_SEQLEN = (1 << 30) - 1      # the kernel's tile arithmetic is int32
MAX_CTAS = (1 << 31) - 1        # 1-D grid
_LOG2E = 1.4426950408889634
_PARAMS = ("KIND", "BLOCK_M", "BLOCK_N", "WARPS", "Q_REGS", "STAGES")


def _cfg(m, n, w, qr=0, st=2):
    """An attn_fwd (mma.sync, sm_80+) config."""
    return {"KIND": "mma", "BLOCK_M": m, "BLOCK_N": n, "WARPS": w, "Q_REGS": qr, "STAGES": st}


def _wg(n, wgs=2, overlap=False, stages=2):
    """An attn_fwd_wg (wgmma, sm_90a only, 16-byte aligned inputs) config: WGS warpgroups of 64 query rows,
    STAGES K/V tiles in shared memory (STAGES - 1 loads in flight); KIND "wgp" overlaps each warpgroup's
    softmax with its own Q K^T of the next tile (two stages only)."""
    return {"KIND": "wgp" if overlap else "wg", "BLOCK_M": 64 * wgs, "BLOCK_N": n, "WARPS": 4 * wgs, "Q_REGS": 0,
            "STAGES": stages}


def _ws(n, stages=2, wgs=2):
    """A warp-specialized attn_fwd_wg config (KIND "ws", TMA loads only): `wgs` (2 or 3) consumer warpgroups of
    64 query rows taking turns at the tensor cores, and a producer warpgroup streaming K and V (FlashAttention-3's
    schedule). 128 (wgs + 1) threads; where the driver cannot encode tensor maps the head dim's lock-step default
    runs."""
    return {"KIND": "ws", "BLOCK_M": 64 * wgs, "BLOCK_N": n, "WARPS": 4 * wgs + 4, "Q_REGS": 0, "STAGES": stages}


def _wsp(n, stages=2):
    """The persistent form of a two-consumer-warpgroup "ws" tile (KIND "wsp"): at most one CTA an SM, each walking
    work tiles (128 query rows of one (b, h)) with its producer loading the next tile's Q and first K / V during
    this one's last P V and epilogue. Up to a compiled head dim of 128, Q is double-buffered (the next tile's Q
    lands a whole tile early) and O is staged in its own shared area, from which two producer warps store it
    while the consumers go on. Dense inputs (varlen and block-sparse launches run its "ws" form)."""
    return {"KIND": "wsp", "BLOCK_M": 128, "BLOCK_N": n, "WARPS": 12, "Q_REGS": 0, "STAGES": stages}


# attn_fwd_wg's WS template argument by KIND: 0 lock-step, 1 warp-specialized, 2 persistent warp-specialized
_WS_ARG = {"ws": 1, "wsp": 2}


# Per compiled head dim: {arch: default config} and the candidates the tuner may time. Warp w owns
# BLOCK_M / (16 WARPS) m16 row tiles; two tiles per warp halve the shared-memory reads of K and V per mma,
# which is what the large head dims cannot afford in registers (O alone is HEAD_DIM/2 floats per m16 tile).
# STAGES = 2 double-buffers K and V (one barrier per KV tile); STAGES = 1 is FlashAttention-2's single K and V
# buffer (half the shared memory). Shared memory per block after opt-in: 227 KB on sm_90, 163 KB on sm_80,
# 99 KB on sm_86 / sm_89 (where two CTAs per SM also want <= 50 KB each), hence the per-arch entries.
_C = _cfg
# sm_90 defaults measured on H200 (bench/bench_attention.py --sweep / --ab), restricted to instances that do not
# spill registers (kernel.attributes["local_size_bytes"] == 0; the single-buffered 128x128 (D=64) and 128x64
# (D=128) candidates spill 16-24 bytes but measured ~4% faster: the tuner may pick them). sm_80 takes the same
# tiles where they fit its 163 KB and do not spill there; sm_86 / sm_89 (not measured) use single-buffered tiles
# that fit 99 KB.
_DEFAULTS = {
    32: {90: _C(128, 128, 4, 1, 2), 80: _C(128, 128, 4, 1, 2), 86: _C(128, 64, 4, 1, 1)},
    64: {90: _C(128, 128, 4, 0, 2), 80: _C(128, 64, 4, 1, 2), 86: _C(128, 64, 4, 1, 1)},
    96: {90: _C(128, 64, 4, 0, 2), 80: _C(128, 64, 4, 0, 2), 86: _C(128, 64, 4, 0, 1)},
    128: {90: _C(128, 64, 4, 0, 2), 80: _C(128, 64, 4, 0, 2), 86: _C(128, 32, 4, 0, 1)},
    160: {90: _C(128, 64, 8, 0, 2), 80: _C(128, 64, 8, 0, 2), 86: _C(128, 64, 8, 0, 1)},
    192: {90: _C(128, 64, 8, 0, 2), 80: _C(128, 64, 8, 0, 2), 86: _C(64, 64, 4, 0, 1)},
    224: {90: _C(128, 64, 8, 0, 2), 80: _C(128, 64, 8, 0, 1), 86: _C(64, 64, 4, 0, 1)},
    256: {90: _C(128, 64, 8, 0, 2), 80: _C(128, 64, 8, 0, 1), 86: _C(64, 32, 4, 0, 1)},
}
for _d in _DEFAULTS.values():
    _d[89] = _d[86]
# sm_90a, 16-byte aligned inputs, head dims above 32: the wgmma kernel, Q, K and V by TMA (dense and varlen).
# Measured on its own widths 64 / 128 / 256 first: H100, fp16, TFLOP/s at S = 1024 / 4096 / 16384 (full; causal),
# bench_attention.py --sweep: D=64 128x64 296 / 373 / 359 (200 / 314 / 395), 64x192 272 / 388 / 389 (188 / 343 /
# 375), 64x64 296 / 367 / 346 (212 / 328 / 340); D=128 128x128 3-stage 378 / 495 / 496 (239 / 439 / 544), 2-stage
# 383 / 477 / 498 (241 / 427 / 482); D=256 128x64 519 (440) at S = 4096. Never best and dropped: 128x128 and the
# overlapped (wgp) 128x128 at D=64, 3- and 4-stage tiles of 64 rows at D=64. The defaults are the tiles with the
# best geometric mean over S = 1024 / 4096, full and causal, in an interleaved A/B against FLASH on a later lease
# (D=64 64x64 1.15x, 128x64 1.07x, 64x128 1.08x; D=128 2-stage 1.19x, 3-stage 1.17x): S = 1024 causal is where
# they differ (64x64 1.09x, 128x64 0.99x; D=128 2-stage 1.03x, 3-stage 0.99x).
# The other head dims run the wgmma kernel compiled for the next wgmma width (_WG_HEAD_DIM; the columns past D are
# zero-filled by the TMA bounds and never stored): 96 on 128, 160 and 192 on 192, 224 on 256. H100, fp16, H = 16,
# B * S = 16k, same run, time of the mma.sync default / this (S = 1024 / 4096, full; causal): D=96 1.09 / 1.39x
# (0.97 / 1.26x), D=160 1.46 / 1.76x (1.38 / 1.67x), D=192 1.71 / 1.89x (1.58 / 1.89x), D=224 1.47 / 1.87x
# (1.53 / 1.85x); against torch SDPA FLASH 0.95-1.25x at D=96, 1.40-2.06x at the others.
_WG_HEAD_DIM = {64: 64, 96: 128, 128: 128, 160: 192, 192: 192, 224: 256, 256: 256}
_WG_DEFAULTS = {64: _wg(64, 1), 96: _wg(128), 128: _wg(128), 160: _wg(64), 192: _wg(64), 224: _wg(64),
                256: _wg(64)}
_WG_CANDIDATES = {64: (_wg(64), _wg(128, 1), _wg(192, 1), _wg(64, 1), _wg(128, 1, stages=3), _ws(192),
                       _ws(128, wgs=3), _ws(112, wgs=3), _ws(208)),
                  128: (_wg(128), _wg(128, stages=3), _wg(64, 2, True), _wg(64, stages=4), _ws(128), _ws(144),
                        _wsp(128)),
                  192: (_wg(64), _wg(64, stages=3), _wg(64, 1, stages=3), _ws(64), _ws(112)),
                  256: (_wg(64), _wg(64, 1, stages=3), _ws(64), _ws(80), _wsp(64))}
for _d, _w in _WG_HEAD_DIM.items():
    _WG_CANDIDATES.setdefault(_d, _WG_CANDIDATES[_w])
_CANDIDATES = {
    32: (_C(128, 128, 4, 1, 2), _C(128, 64, 4, 1, 2), _C(128, 128, 4, 1, 1)),
    64: (_C(128, 128, 4, 0, 2), _C(128, 64, 4, 1, 2), _C(128, 128, 4, 0, 1), _C(128, 64, 4, 1, 1)),
    96: (_C(128, 64, 4, 0, 2), _C(128, 64, 4, 0, 1), _C(64, 64, 4, 1, 2)),
    128: (_C(128, 64, 4, 0, 2), _C(128, 64, 4, 0, 1), _C(128, 48, 4, 0, 2), _C(128, 32, 4, 0, 2),
          _C(64, 64, 4, 0, 2)),
    160: (_C(128, 64, 8, 0, 2), _C(128, 64, 8, 0, 1), _C(64, 64, 4, 0, 2)),
    192: (_C(128, 64, 8, 0, 2), _C(128, 64, 8, 0, 1), _C(64, 64, 4, 0, 2)),
    224: (_C(128, 64, 8, 0, 2), _C(128, 64, 8, 0, 1), _C(64, 64, 4, 0, 1)),
    256: (_C(128, 64, 8, 0, 2), _C(128, 64, 8, 0, 1), _C(64, 64, 4, 0, 1), _C(64, 32, 4, 0, 1)),
}


def score_transform(scale: float, softcap: float) -> tuple:
    """(score_mode, scale_log2, cap_prescale) of the attention kernels' score transform (attention_fwd.cu,
    attention_sparse.cu): mode 1 softcap, mode 2 a scale <= 0 applied as a prescale, mode 0 plain; scale_log2 > 0
    always, as the kernels need."""
    if softcap > 0:
        return 1, softcap * _LOG2E, scale / softcap
    if scale < 0:
        return 2, -scale * _LOG2E, -1.0
    if scale == 0:
        return 2, 1.0, 0.0
    return 0, scale * _LOG2E, 0.0


def head_dim_bucket(D: int) -> int:
    """The compiled HEAD_DIM that runs a real head dim D (1..256)."""
    for hd in HEAD_DIMS:
        if D <= hd:
            return hd
    raise ValueError(f"q: expected a head dimension D from 1 to 256, got {D}")


# Static shared memory of the wgmma kernel (its copy of the CTA's work, cta_sh: 48 bytes, 128 as ptxas lays it
# out), which counts against the same per-block limit as the dynamic size below.
WG_STATIC_SMEM = 128


def static_smem_bytes(cfg: dict) -> int:
    """Static shared memory of cfg's kernel (the mma.sync kernel has none): what a fit check adds to smem_bytes."""
    return WG_STATIC_SMEM if cfg["KIND"] != "mma" else 0


def smem_bytes(head_dim: int, cfg: dict, itemsize: int = 2) -> int:
    """Dynamic shared memory of one CTA. mma: Q [BLOCK_M] + K, V [STAGES][BLOCK_N] rows of HEAD_DIM + 8
    elements; wg: the same rows of the wgmma width _WG_HEAD_DIM[head_dim], unpadded (swizzled), 1 KB to align
    the base to 1024 bytes and 256 bytes of TMA mbarriers and per-warp slots; Q's rows are 16-bit (they stage
    the output) even for FP8 inputs (itemsize 1, attention_fp8.py), and "wsp" up to D = 128 has three such
    areas: two for Q (double-buffered across work tiles) and one for O."""
    if cfg["KIND"] != "mma":
        q_areas = 3 if cfg["KIND"] == "wsp" and _WG_HEAD_DIM[head_dim] <= 128 else 1
        tiles = 2 * cfg["BLOCK_M"] * q_areas + 2 * cfg["STAGES"] * cfg["BLOCK_N"] * itemsize
        return tiles * _WG_HEAD_DIM[head_dim] + 1024 + 256
    return (cfg["BLOCK_M"] + 2 * cfg["STAGES"] * cfg["BLOCK_N"]) * (head_dim + 8) * itemsize


def instance_name(dtype, head_dim: int, cfg: dict, vec: bool = True, tma: bool = False, sparse: bool = False,
                  out_dtype=None) -> str:
    """The kernel template instance of cfg. tma (wgmma configs): Q, K and V arrive by TMA (with tensor maps)
    instead of cp.async; sparse (wgmma configs): the block-sparse variant (vbw_cupy.sparse). dtype uint8: FP8
    (E4M3) inputs with output out_dtype (attention_fp8.py)."""
    b = lambda x: "true" if x else "false"
    cfg = _loadable(head_dim, cfg, tma)
    if cfg["KIND"] != "mma":
        if not vec:
            raise ValueError(f"attention config {cfg}: the wgmma kernel needs 16-byte aligned rows (d % 8 == 0)")
        if np.dtype(dtype) == np.uint8 and out_dtype is None:
            raise ValueError("instance_name: FP8 (uint8) inputs need out_dtype")
        t = rt.ctype(dtype) if np.dtype(dtype) != np.uint8 else f"vbw_attn::E4M3<{rt.ctype(out_dtype)}>"
        return (f"attn_fwd_wg<{t}, {_WG_HEAD_DIM[head_dim]}, {cfg['BLOCK_N']}, {cfg['BLOCK_M'] // 64}, "
                f"{b(cfg['KIND'] == 'wgp')}, {b(tma)}, {cfg['STAGES']}, {_WS_ARG.get(cfg['KIND'], 0)}, {b(sparse)}>")
    return (f"attn_fwd<{rt.ctype(dtype)}, {head_dim}, {cfg['BLOCK_M']}, {cfg['BLOCK_N']}, {cfg['WARPS']}, "
            f"{b(cfg['Q_REGS'])}, {cfg['STAGES']}, {b(vec)}>")


def _unique(cfgs) -> list[dict]:
    out = []
    for c in cfgs:
        if c not in out:
            out.append(c)
    return out


def _all_configs(head_dim: int, vec: bool = True) -> list[dict]:
    """Configs that can be launched: the candidates and defaults on the 16-byte path (VEC), the per-arch
    defaults only on the element-wise path (D % 8 != 0 or unaligned inputs are never tuned)."""
    defaults = list(_DEFAULTS[head_dim].values())
    if not vec:
        return _unique(defaults)
    wg = [_WG_DEFAULTS[head_dim], *_WG_CANDIDATES[head_dim]] if head_dim in _WG_DEFAULTS else []
    return _unique(wg + list(_CANDIDATES[head_dim]) + defaults)


def kernel_instances(arch: int | None = None, head_dims=None) -> list[tuple[str, str]]:
    """Every (file, template instance) this module can launch, fp16 and bf16; with `arch`, those it can launch on
    that architecture (the wgmma kernels on sm_90 only); with `head_dims` (real D values), those of their buckets."""
    hds = HEAD_DIMS if head_dims is None else sorted({head_dim_bucket(int(d)) for d in head_dims})
    return _unique([(SOURCE, instance_name(dt, hd, c, vec, tma)) for dt in ("float16", "bfloat16") for hd in hds
                    for vec in (True, False) for c in _all_configs(hd, vec) if arch in (None, 90) or c["KIND"] == "mma"
                    for tma in _tma_variants(c)])


def _tma_variants(cfg) -> tuple:
    """The load paths an instance of cfg is compiled for: mma.sync cp.async only, wgmma both, "ws" / "wsp" TMA
    only."""
    return (False,) if cfg["KIND"] == "mma" else (True,) if cfg["KIND"] in _WS_ARG else (False, True)


def _loadable(head_dim: int, cfg: dict, tma: bool) -> dict:
    """cfg, or where it cannot load without tensor maps (a "ws" producer issues TMA copies only) and tma is off,
    the head dim's lock-step default."""
    return _WG_DEFAULTS[head_dim] if cfg["KIND"] in _WS_ARG and not tma else cfg


def _row_warps(cfg) -> int:
    """The warps that own query rows (a "ws" / "wsp" CTA's producer warpgroup owns none)."""
    return cfg["WARPS"] - (4 if cfg["KIND"] in _WS_ARG else 0)


# sm_90: the warp-specialized tiles from this many keys on, per wgmma width. H100, fp16, B * S = 32k tokens,
# H * D = 2048, each config timed by CUDA-graph replay in one run, speed of "ws" over the lock-step "wg" default,
# S = 512 / 1k / 2k / 4k / 8k / 16k, full; causal: D=128 1.09 1.01 1.04 1.08 1.04 1.20; 1.04 1.01 1.05 1.11 1.16
# 1.11 (geomean 1.07, and long-S gains of 4-11% in two earlier runs); D=192 1.05 1.04 0.94 0.96 1.04 1.06; 1.02
# 1.00 1.02 1.04 1.09 1.15; D=256 1.04 1.04 1.03 1.00 0.96 0.98; 1.02 1.04 0.96 1.01 1.16 1.09; D=64 (ws 128 x 192)
# 0.74 0.80 1.00 1.04 0.94 1.11; 0.63 0.74 0.89 0.98 1.04 1.08. Where it loses, short CTAs' prologue and epilogue
# cost more in the warp-specialized kernel than its overlap saves. A second run (same method) repeated D=128
# (geomean 1.07) and D=192 from 8k (1.04-1.15x); D=64 at 16k read 1.05 / 0.95x there, so D=64 keeps "wg".
# Persistent warp-specialized CTAs (one an SM, a static tile stride) were correct but no faster (D=128 geomean
# 1.05x wg against 1.07x for ws; D=192 causal 0.73-0.84x): notes/attempts/attention-ws-persistent.patch. The
# tenth session's "wsp" (attention_fwd.cu v12: rounds of alternating direction, no warpgroup branch before the
# loop) is 1.01-1.21x ws at D = 128 below 8k keys (the tiers below). At D = 64 it stays behind the lock-step
# 64 x 64 tile below 4k keys (H100, graph replay: wsp 128 0.83-0.98x, wsp 192 0.72-0.98x); at D = 192 its
# consumers spill at 232 registers. At D = 256 (O staged in Q's buffer: Q, O and two K / V stages do not fit
# 227 KB) it is a tuning candidate only: wsp 64 / ws 64, 8 interleaved pairs, S = 512 / 1k / 2k / 4k / 16k full
# 1.03 1.03 1.03 1.01 1.00, causal 0.92 0.97 1.05 1.05 0.66 (at 16k a section of the CTA order, one head, is
# shorter than a round of 132 work tiles, and the alternating rounds no longer even out the causal lengths).
# 2026-11-26 (sixth session), after the softmax was pinned ahead of the P V wait (attention_fwd.cu v9: until then
# ptxas had hoisted the wait and nothing overlapped), one run, same method, TFLOP/s of ws / wg at S = 512 / 1k /
# 2k / 4k / 8k / 16k, full; causal: D=192 382/365 474/461 526/494 561/534 577/556 615/535; 232/226 365/342
# 459/419 554/472 591/481 616/511; D=256 410/397 528/491 573/546 650/539 690/600 708/567; 279/265 396/377
# 505/447 568/494 626/518 681/566: ws everywhere. D=64 (ws 128 x 192 / wg 64 x 64): 229/312 299/366 370/376
# 391/381 424/396 441/396; 132/210 199/287 290/347 357/340 400/369 421/401: ws from 4k keys.
# D=64 also has a three-consumer-warpgroup tile (ws 192 x 128, FlashAttention-3's hdim-64 shape) among its
# candidates: on an H200, graph replay, S = 2k / 4k / 8k / 16k full; causal, TFLOP/s of it / ws 128 x 192 / wg
# 64 x 64: 386/368/389 404/364/356 432/395/377 441/408/387; 293/274/361 346/335/348 394/377/370 411/405/395.
# It is not the default: its consumers at 160 registers spill 28 bytes (the tile range, read a few times a
# tile), and the default instances are kept spill-free (tests/test_attention.py).
# 2026-11-27: BLOCK_N 112 at D = 192 (S 56 + P 28 + O 96 accumulator registers a thread: no spills, where 128
# spills 56 bytes). H100, graph replay, three interleaved reps, ws 112 / ws 64 over two leases: S = 1k 0.91
# (full) / 0.93 (causal); 2k 1.05 / 1.02 (bf16); 4k 0.99-1.18 / 1.07-1.18; 8k 1.07 / 1.20 (bf16); 16k
# 1.00-1.21 / 1.09-1.14. So from the 2k bucket. Also measured, kept as tuning candidates only: BLOCK_N 144 at D = 128
# (1.03x at 16k full, 0.89-0.96x elsewhere; 160 and 176 spill; 96 / 112 0.93-1.02x), 80 at D = 256 (0.98-1.05x
# from 2k, 0.90-0.94x at 1k), 208 at D = 64 (two runs, 2k-16k: 1.00-1.07x full, 0.97-1.01x causal; 224 and up
# spill).
# D = 64 from the 4k bucket: three consumer warpgroups of 64 query rows (BLOCK_M 192) and 112-key tiles (S 56 + P 28
# + O 32 accumulators a thread at setmaxnreg 160: no spills, where 128 keys spill 28 bytes). H100, graph replay,
# three interleaved reps, TFLOP/s, S = 4k / 8k / 16k full; causal: ws 112 x3 409 / 435 / 451; 343 / 409 / 431,
# ws 192 (the default before) 358 / 409 / 427; 334 / 401 / 422, ws 128 x3 432 / 441 / 446; 351 / 426 / 432, wg
# 64 x 64 389 / 414 / 436; 375 / 387 / 397, cuDNN 472 / 482 / 456; 435 / 461 / 471. Below 4k the lock-step wg
# 64 x 64 stays (ws 112 x3 0.67-0.98x of it at 1k / 2k).
# Per wgmma width, (threshold, tile) tiers in ascending order: the last one whose threshold the key bucket (Sk
# rounded up to a power of two, as tuning rounds it) reaches, so a tier of 2048 applies from 1025 keys. The
# thresholds are powers of two in [64, 16384] (tests/test_attention.py). Not measured between the powers of
# two; at D = 64 the tier takes no account of masks (4k causal: wg 64 x 64 375 / 365 against 343 / 357, fp16 /
# bf16; the tile it replaced 334 / 345).
# D = 128 below 8k keys: the persistent form ("wsp", attention_fwd.cu v12). H100, graph replay, 8 interleaved
# pairs, median speed of wsp / ws, S = 512 / 1k / 2k / 4k full; causal: 1.11 1.09 1.04 1.01; 1.21 1.10 1.02 1.02;
# 8k causal 0.99, 16k 0.99 / 1.00 full / causal (there a CTA's head and tail are noise).
# 2026-11-27 (eleventh session): under a mask the persistent tile follows _persistent_schedule instead of the
# alternating rounds. H100, graph replay, 8 interleaved triples, median speed over ws, rounds / schedule: D = 128
# causal S = 512 / 1k / 2k / 4k / 8k / 16k 1.21 / 1.30, 1.11 / 1.20, 1.01 / 1.08, 1.03 / 1.02, 1.00 / 0.99,
# 0.99 / 0.99; D = 256 causal 0.92 / 1.04, 1.00 / 1.05, 1.07 / 1.03, 1.04 / 1.03, 1.03 / 1.02, 0.65 / 0.98 and
# full (no mask, no schedule) 1.02, 1.04, 1.01-1.02, 1.02, 0.98-1.00, 1.00: so D = 256 (and 224) takes it below
# 8k keys too.
_WS_FROM = {64: ((4096, _ws(112, wgs=3)),), 128: ((1, _wsp(128)), (8192, _ws(128))),
            192: ((1, _ws(64)), (2048, _ws(112))), 256: ((1, _wsp(64)), (8192, _ws(64)))}


def default_config(head_dim: int, arch: int, vec: bool = True, shape: dict | None = None) -> dict:
    """The per-arch default: the wgmma kernel on sm_90 for 16-byte aligned inputs where it exists (with
    `shape`, the warp-specialized tiles for long key sequences, _WS_FROM), else the mma.sync kernel's entry for
    the nearest arch at or below `arch`."""
    if arch == 90 and vec and head_dim in _WG_DEFAULTS:
        return _shape_default(head_dim, shape or {}, arch, _WG_DEFAULTS[head_dim])
    d = _DEFAULTS[head_dim]
    return dict(d[max([a for a in d if a <= arch] or [min(d)])])


def _shape_default(head_dim: int, shape: dict, arch: int, cfg: dict) -> dict:
    """The default of a shape ({"Sk": longest key sequence, ...}) on an arch, given the arch's default cfg (the
    Tunable's default_for, with head_dim bound)."""
    sk = int(shape.get("Sk", 0))
    if arch == 90 and cfg["KIND"] != "mma" and sk > 0:
        bucket = _autotune.pow2_bucket(sk, lo=64, hi=16384)  # as _bucket rounds Sk: one default a tuning bucket
        for frm, tile in reversed(_WS_FROM.get(_WG_HEAD_DIM.get(head_dim), ())):
            if bucket >= frm:
                return dict(tile)
    return dict(cfg)


def _runnable(head_dim: int, cfg: dict, vec: bool) -> dict:
    """cfg, or the mma default where the wgmma kernel cannot run (not sm_90a, unaligned inputs, head dims of 32
    and below): a wgmma instruction on another target is an illegal instruction that poisons the CUDA context."""
    if cfg["KIND"] != "mma" and not (vec and _device.device_arch() == 90 and head_dim in _WG_DEFAULTS):
        return default_config(head_dim, _device.device_arch(), vec=False)
    return cfg


def _sm_count(shape: dict) -> int:
    """The SM count the bucket is relative to: shape["SMS"] (what `_Launch.pick` passes), else the current
    device's (tune()'s standard shapes), else an H100 SXM's 132 (no device: CPU tests, `vbw-cupy info`)."""
    if shape.get("SMS"):
        return int(shape["SMS"])
    try:
        return int(_autotune._device_info()["limits"]["num_sms"]) or 132
    except Exception:  # noqa: BLE001 - no CuPy / no device
        return 132


def bh_bucket(bh: int, sms: int) -> int:
    """B x Hq in eighths of the SM count, pow2, clamped to [1, 16]: 8 = up to one (b, h) pair per SM, 16 = more.
    At S >= 1024 a pair has >= 8 Q tiles of 128 rows, so below 8 the grid is a fraction of a wave or a few
    waves with a heavy tail and the best tile is a small one (more CTAs); above 16 any tile fills the GPU."""
    return _autotune.pow2_bucket(-(-8 * max(1, int(bh)) // max(1, int(sms))), lo=1, hi=16)


def _bucket(shape: dict) -> tuple:
    # B x Hq counts, relative to the SM count: a small batch's best tile (more, smaller CTAs) ran 0.67-0.73x of
    # the default on a large one (H200), and the first call of a bucket is the one that tunes it.
    p2 = (lambda n: _autotune.pow2_bucket(n, lo=64, hi=16384))
    bh = shape.get("BH", shape.get("B", 4) * shape.get("H", 16))
    return (p2(shape["Sq"]), p2(shape["Sk"]), int(bool(shape["masked"])), bh_bucket(bh, _sm_count(shape)))


def _tunable_name(head_dim: int) -> str:
    return f"attention_fwd_d{head_dim}"


_FAMILY = "attention_fwd"  # every head dim's Tunable: a store for one replans flash_attention's calls only


def _make_bench(head_dim: int):
    def bench(shape: dict, dtype):
        cp = rt.require_cupy()
        B, S, H = shape.get("B", 4), shape["Sq"], shape.get("H", 16)
        rng = cp.random.default_rng(0)
        q, k, v = (rng.standard_normal((B, S, H, head_dim), dtype=cp.float32).astype(dtype) for _ in range(3))
        o = cp.empty_like(q)
        args = _Launch.dense(q, k, v, scale=1.0 / math.sqrt(head_dim), window=(-1, 0 if shape["masked"] else -1),
                             softcap=0.0, out=o, lse=None)
        return lambda cfg: args.run(cfg)
    return bench


def _fits(head_dim: int):
    def fits(cfg, lim):
        if (cfg["KIND"] != "mma") != (lim.get("arch") == 90 and head_dim in _WG_DEFAULTS):
            # the wgmma kernel runs on sm_90a only; where it runs (aligned inputs: the only ones tuned), the
            # mma.sync configs are not timed: they ran 15-50% behind it on every measured shape (kernel
            # history, attn_fwd_wg v4-v5), and each costs a compile on a first call (the cold start)
            return False
        return (cfg["WARPS"] * 32 <= lim["max_threads"]
                and smem_bytes(head_dim, cfg) + static_smem_bytes(cfg) <= lim["smem_optin"]
                and cfg["BLOCK_M"] % (16 * _row_warps(cfg)) == 0)
    return fits


if _autotune is not None:
    for _hd in HEAD_DIMS:
        _autotune.register(_autotune.Tunable(
            name=_tunable_name(_hd), params=_PARAMS, candidates=tuple(_all_configs(_hd, True)),
            # 100: archs above sm_90 take the nearest lower entry, which must not be sm_90a's wgmma config
            defaults={a: default_config(_hd, a) for a in (*_DEFAULTS[_hd], 100)}, bucket=_bucket, fits=_fits(_hd),
            default_for=functools.partial(_shape_default, _hd),
            warm_l2=True, settled=(90,),  # tuned 0.78-1.01x the defaults on an H100 (notes/autotune.md)
            source=SOURCE,
            standard_shapes=tuple(({"Sq": s, "Sk": s, "masked": m, "B": 16384 // s, "H": 16}, dt)
                                  for s in (1024, 4096) for m in (0, 1) for dt in ("float16",)) if _hd in (64, 128)
            else (),
            bench=_make_bench(_hd), family=_FAMILY))


# ---------------------------------------------------------------------------------------------- checks


def _is_host(x) -> bool:
    return isinstance(x, np.ndarray)


def _check_gpu_common(q, k, v, **offsets):
    rt.check_same_device(q=q, k=k, v=v, **offsets)


def _clamp_window(left: int, right: int, max_q: int, max_k: int) -> tuple[int, int]:
    # A bound that no sequence can reach is the same as no bound; this keeps the kernel's int math in range.
    if left >= max_k:
        left = -1
    if right >= max_q:
        right = -1
    return left, right


def _check_grid(B, Hq, max_q):
    if -(-max(1, max_q) // 64) * B * Hq > MAX_CTAS:
        raise ValueError(f"q: {B} sequences x {Hq} heads x {max_q} tokens need more than {MAX_CTAS} thread blocks")


def _check_seqlen(name, n):
    if n > MAX_SEQLEN:
        raise ValueError(f"{name}: expected sequence lengths up to {MAX_SEQLEN}, got {n}")


# ---------------------------------------------------------------------------------------------- launch
def _div_magic(d: int) -> np.uint32:
    """ceil(2^32 / d) for 2 <= d < 2^31, 0 for d = 1: the kernels' multiplier for a division by d (fast_div)."""
    d = int(d)  # (a NumPy int32 would overflow in the division)
    return np.uint32(0 if d <= 1 else (0xFFFFFFFF // d) + 1)


class _Launch:
    """Everything one kernel launch needs except the tile config (so the tuner can re-run it)."""

    def __init__(self, q, k, v, o, lse, cu_q, cu_k, B, seqlen_q, seqlen_k, max_q, max_k, Hq, Hkv, D,
                 scale, left, right, softcap, lse_stride_h, sparse=(), descale=None, ds_strides=(1, 0, 0)):
        self.q, self.k, self.v, self.o = q, k, v, o
        # FP8 (attention_fp8.py): q, k E4M3 codes, v the transposed copy vt_permute wrote; descale: float32 [3],
        # [3, Hkv] or [3, B, Hkv], indexed by its element strides (tensor, batch, KV head).
        # Its one compiled width is 128 (smaller head dims are zero-padded by the tensor maps).
        self.fp8 = q.dtype == np.uint8
        self.descale = rt.NULL if descale is None else descale
        self.ds_args = tuple(np.int32(x) for x in ds_strides)
        self.B, self.max_q, self.max_k, self.Hq, self.Hkv, self.D = B, max_q, max_k, Hq, Hkv, D
        self.varlen = cu_q is not None
        self.head_dim = 128 if self.fp8 else head_dim_bucket(D)
        # varlen lengths may be unread on the host (checked on the device): clamp against what no sequence exceeds
        left, right = _clamp_window(left, right, *((max_q, max_k) if cu_q is None else (MAX_SEQLEN, MAX_SEQLEN)))
        self.left, self.right = left, right
        mode, scale_log2, pre = score_transform(scale, softcap)
        ptrs = [q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr]
        self.vec = bool(D % 8 == 0 and all(p % 16 == 0 for p in ptrs))
        self.masked = left >= 0 or right >= 0
        self.head_args = (q, k, v, o, rt.NULL if lse is None else lse, rt.NULL if cu_q is None else cu_q,
                          rt.NULL if cu_k is None else cu_k, np.int32(B), np.int32(seqlen_q), np.int32(seqlen_k),
                          np.int32(Hq), np.int32(Hq // Hkv), np.int32(D))
        self.tail_args = (np.float32(scale_log2), np.int32(mode), np.float32(pre), np.int32(left),
                          np.int32(right), np.int64(Hq * D), np.int64(Hkv * D), np.int64(lse_stride_h),
                          _errors.buffer(q.data.device_id))
        # the wgmma kernel's block-sparse arguments (indptr, indices, their pattern strides, nnz, key blocks):
        # `sparse` from vbw_cupy.sparse, or none for a dense launch
        self.sparse = bool(sparse)
        self.sparse_args = tuple(sparse) or (rt.NULL, rt.NULL, np.int64(0), np.int64(0), np.int32(0), np.int32(0))
        self.sparse_smem = 4 * int(sparse[-1]) if sparse else 0   # the CTA's staged block ids (n_k_blocks ints)
        # CTA order: sections of (b, h) pairs whose K and V (max_k keys each) fit in half of L2.
        kv_bytes = 2 * max_k * D * q.dtype.itemsize
        per_sec = max(1, _l2_bytes() // 2 // max(1, kv_bytes)) * (Hq // Hkv)
        self.sect_heads = int(min(B * Hq, per_sec))

    @classmethod
    def dense(cls, q, k, v, *, scale, window, softcap, out, lse):
        B, Sq, Hq, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        return cls(q, k, v, out, lse, None, None, B, Sq, Sk, Sq, Sk, Hq, Hkv, D, scale, window[0], window[1],
                   softcap, Sq)

    def bound(self, cfg):
        """(kernel, grid, block, smem, scalar args, wg, boxes) of a launch with cfg: what run() launches and the
        fast path replays with new arrays. wg: the wgmma kernel, which takes three tensor-map arguments; boxes:
        (BLOCK_M, BLOCK_N) when they are TMA maps of q, k, v (`_map_args`), None when they are unused."""
        cfg = _runnable(self.head_dim, cfg, self.vec)
        if cfg["BLOCK_M"] % (16 * _row_warps(cfg)) != 0:
            raise ValueError(f"attention config {cfg}: BLOCK_M must be a multiple of 16 * WARPS")
        wg = cfg["KIND"] != "mma"
        boxes = (cfg["BLOCK_M"], cfg["BLOCK_N"]) if wg and (_USE_TMA or self.fp8) else None
        if boxes is not None and self.maps(boxes) is None:
            boxes = None  # the driver cannot encode the maps: cp.async
        if cfg["KIND"] == "wsp" and (self.sparse or self.varlen):
            cfg = dict(cfg, KIND="ws")  # (the persistent walk is dense only)
        if self.fp8 and (boxes is None or cfg["KIND"] not in _WS_ARG):
            raise ValueError(f"FP8 attention runs the warp-specialized kernel with tensor maps, not {cfg}")
        cfg = _loadable(self.head_dim, cfg, boxes is not None)
        opts = _EXTRA_OPTIONS.get(self.head_dim, ()) if isinstance(_EXTRA_OPTIONS, dict) else _EXTRA_OPTIONS
        kern = rt.get_kernel(SOURCE, instance_name(self.q.dtype, self.head_dim, cfg, self.vec, boxes is not None,
                                                   self.sparse, self.o.dtype), tuple(opts))
        num_m = rt.cdiv(self.max_q, cfg["BLOCK_M"])
        # the CTA index -> (section, Q tile, b, h) divisors as multipliers (attention_mask.cuh fast_div)
        divs = (_div_magic(self.sect_heads * num_m), _div_magic(self.sect_heads), _div_magic(self.Hq))
        ctas = num_m * self.B * self.Hq
        sparse_args = self.sparse_args
        if cfg["KIND"] == "wsp":  # persistent: at most one CTA an SM (its shared memory allows no second)
            ctas = min(ctas, _device.num_sms())
            if self.masked:  # (the block list's place carries the work-tile schedule)
                sparse_args = (rt.NULL, self.schedule(num_m, cfg, ctas)) + sparse_args[2:]
        scalars = self.head_args[7:] + (np.int32(num_m), np.int32(self.sect_heads)) + divs + self.tail_args + \
            (sparse_args + (self.descale,) + self.ds_args if wg else ())
        smem = smem_bytes(self.head_dim, cfg, self.q.dtype.itemsize) + (self.sparse_smem if wg else 0)
        return kern, (ctas,), (cfg["WARPS"] * 32,), smem, scalars, wg, boxes

    def schedule(self, num_m, cfg, ctas):
        """The persistent tile's work-tile schedule on the device (_persistent_schedule), one a signature and
        device, kept for the life of the process (a captured graph holds its address, as it does scratch
        buffers'). rt.NULL, the kernel's static rounds, where none is made: where those rounds are as even
        already, while a CUDA graph is being captured (no host copy there), and once the schedules hold
        _SCHEDULE_BYTES. The order changes no result, only the balance."""
        cp = rt.cupy
        key = (self.q.data.device_id, num_m, self.B * self.Hq, self.sect_heads, self.max_q, self.max_k, self.left,
               self.right, cfg["BLOCK_M"], cfg["BLOCK_N"], ctas)
        sched = _schedules.get(key)
        if sched is not None:
            return sched
        size = -(-4 * (rt.cdiv(num_m * self.B * self.Hq, ctas) + 1) * ctas // 512) * 512  # (CuPy's rounding)
        if _schedule_bytes[0] + size > _SCHEDULE_BYTES or _no_schedule.get(key) or \
                cp.cuda.get_current_stream().is_capturing():
            return rt.NULL
        plan = _persistent_schedule(num_m, self.B * self.Hq, self.sect_heads, self.max_q, self.max_k, self.left,
                                    self.right, cfg["BLOCK_M"], cfg["BLOCK_N"], ctas)
        if plan is None:
            _no_schedule.put(key, True)
            return rt.NULL
        with _schedule_lock:
            sched = _schedules.get(key)
            if sched is None:
                if _schedule_bytes[0] + size > _SCHEDULE_BYTES:
                    return rt.NULL
                with cp.cuda.Device(self.q.data.device_id):
                    # (a blocking copy: the array is shared by every stream's launches from here on)
                    sched = cp.asarray(plan, blocking=True)
                _schedules[key] = sched
                _schedule_bytes[0] += size
        return sched

    def maps(self, boxes):
        """The wgmma kernel's tensor-map arguments for boxes (see _map_args; FP8: _map_args_fp8)."""
        return (_map_args_fp8 if self.fp8 else _map_args)(self.q, self.k, self.v, boxes)

    def run(self, cfg):
        """Launch with cfg; returns bound(cfg)."""
        b = kern, grid, block, smem, scalars, wg, boxes = self.bound(cfg)
        maps = self.maps(boxes) if wg else ()
        rt.launch(kern, grid, block, self.head_args[:7] + scalars + maps, shared_mem=smem)
        return b

    def pick(self, config=None):
        if config is not None:
            return dict(config)
        if _autotune is None or not self.vec:
            return default_config(self.head_dim, _device.device_arch(), self.vec, {"Sk": self.max_k})
        shape = {"Sq": self.max_q, "Sk": self.max_k, "masked": int(self.masked), "BH": self.B * self.Hq,
                 "SMS": _device.num_sms()}
        return _autotune.pick(_tunable_name(self.head_dim), shape, self.q.dtype, self.run)


# A persistent work tile's fixed cost in key tiles (its first loads, epilogue and turn hand-over): ~3,400 clocks
# against ~2,750 a key tile at D = 128 when it was set (H100, notes/attempts/attention-cta-timeline.py
# --persistent); ~2,600 since v14's storer warps, ~0.9 of a key tile. The schedule is not sensitive to it
# (0.4 or 2.5 measured within 2% of 1.2 at v13), so it stays.
_TILE_OVERHEAD = 1.2


def _persistent_schedule(num_m, pairs, sect_heads, sq, sk, left, right, block_m, block_n, ctas):
    """The persistent tile's schedule under a mask: int32 [rounds + 1, ctas], CTA c's work tile of round r at
    [r, c] (-1: none; the last row is all -1, the kernel's look-ahead); None where it would not help (one round,
    or tiles that all cost the same: a decode step's single query row, a window inside every tile's keys).
    Round r holds the same work tiles as the kernel's static rounds (tiles r * ctas ..., in cta_info's order: a
    section's heads together for L2, longest first), each given, longest first, to the CTA with the least work so
    far. A tile costs its key tiles plus _TILE_OVERHEAD (the key tiles by tile_range's rule,
    attention_mask.cuh). The static rounds alternate
    direction, which balances a causal mask only where a section spans several rounds: by this cost model they
    end 6-11% past the ideal at S = 512-2k (D = 128, 32k tokens) and 54% past at D = 256 S = 16k (one head a
    section, 128 tiles against 132 CTAs), where this schedule ends 1-3% past."""
    total = num_m * pairs
    w = np.arange(total, dtype=np.int64)
    per_sec = sect_heads * num_m
    sec = w // per_sec
    r = w - sec * per_sec
    rs = r // np.minimum(sect_heads, pairs - sec * sect_heads)
    m0 = (num_m - 1 - rs) * block_m
    rows = np.minimum(block_m, sq - m0)
    diag = sk - sq
    lo = np.maximum(0, m0 + diag - left) if left >= 0 else np.zeros_like(m0)
    hi = np.minimum(sk, m0 + diag + right + rows) if right >= 0 else np.full_like(m0, sk)
    cost = np.where(hi > lo, -(-hi // block_n) - lo // block_n, 0) + _TILE_OVERHEAD
    rounds = -(-total // ctas)
    if rounds <= 1 or cost.min() == cost.max():
        return None  # (one tile a CTA, or all alike: the static rounds are as even)
    sched = np.full((rounds + 1, ctas), -1, np.int32)
    load = np.zeros(ctas)
    for i in range(rounds):
        tiles = w[i * ctas:(i + 1) * ctas]
        longest = np.argsort(-cost[tiles], kind="stable")
        least = np.argsort(load, kind="stable")[:len(tiles)]
        sched[i, least] = tiles[longest]
        load[least] += cost[tiles[longest]]
    return sched


# (device, signature) -> the schedule on that device; never dropped (captured graphs may read them), so bounded
# by bytes: a shape past the bound walks the static rounds (a schedule is ~4 bytes a work tile: 17 KB at S = 512,
# B * H = 1024, D = 128)
_schedules: dict = {}
_schedule_bytes = [0]
_no_schedule = _plans.PlanCache()  # signatures whose tiles need none (their static rounds are as even)
_schedule_lock = threading.Lock()
_SCHEDULE_BYTES = 64 << 20

# NVRTC options (a tuple, or {HEAD_DIM: tuple}) for A/B experiments (bench/bench_attention.py --ab); empty in use
_EXTRA_OPTIONS = ()
# The wgmma kernel loads Q, K and V by TMA where the driver encodes the maps (False: cp.async, for A/B runs)
_USE_TMA = True


def _variant() -> tuple:
    """The A/B switches above as part of every plan key: flipping one builds new plans, never replays old ones."""
    return _USE_TMA, _plans.frozen(_EXTRA_OPTIONS)


def _map_args(q, k, v, boxes):
    """The wgmma kernel's three tensor-map arguments: with boxes = (BLOCK_M, BLOCK_N), TMA maps of q, k, v as
    [D, heads, seqlen, batch] (innermost first; the bounds zero-fill rows past a sequence and columns past D)
    with boxes of 64 columns x BLOCK_M (q) / BLOCK_N (k, v) rows; packed varlen arrays [tokens, heads, D] as
    one batch of all tokens (the kernel zeroes what it reads past a sequence's end); with boxes None, three
    unused zero maps. None when the driver cannot encode a map."""
    if boxes is None:
        return (rt.NO_TENSOR_MAP,) * 3
    if q.ndim == 3:  # packed: the kernel's TMA row coordinates are int32
        B, (Sq, Hq, D), (Sk, Hkv) = 1, q.shape, k.shape[:2]
        if max(Sq, Sk) >= 2**31 - 256:
            return None
    else:
        B, Sq, Hq, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
    maps = (_row_map(q, B, Sq, Hq, D, boxes[0]), _row_map(k, B, Sk, Hkv, D, boxes[1]),
            _row_map(v, B, Sk, Hkv, D, boxes[1]))
    return None if any(m is None for m in maps) else maps


def _row_map(x, B, S, H, D, rows):
    """TMA map of x [B, S, H, D] (16-bit or 8-bit elements) as [D, H, S, B], boxes of one 128-byte panel of
    columns (64 or 128 elements) x `rows` rows."""
    e = x.dtype.itemsize
    return rt.tensor_map(x.data.ptr, (D, H, S, B), (e * D, e * H * D, e * S * H * D), (128 // e, 1, rows, 1),
                         elem_bytes=e)


def _map_args_fp8(q, k, vt, boxes):
    """FP8 tensor maps: q, k [B, S, H, D] bytes as _map_args lays them out (`_row_map`); vt [B, Hkv, D, Skp]
    (attention_fp8.py) as [Skp, D, Hkv, B] in boxes of BLOCK_N keys x HEAD_DIM rows."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    Skp = vt.shape[-1]
    maps = (_row_map(q, B, Sq, Hq, D, boxes[0]), _row_map(k, B, Sk, Hkv, D, boxes[1]),
            rt.tensor_map(vt.data.ptr, (Skp, D, Hkv, B), (Skp, D * Skp, Hkv * D * Skp), (boxes[1], 128, 1, 1),
                          elem_bytes=1))
    return None if any(m is None for m in maps) else maps


_L2 = {}


def _l2_bytes() -> int:
    cp = rt.require_cupy()
    dev = cp.cuda.Device().id
    if dev not in _L2:
        _L2[dev] = int(cp.cuda.Device(dev).attributes.get("L2CacheSize", 0)) or (40 << 20)
    return _L2[dev]


def _prepare_gpu(q, k, v):
    q, k, v = rt.as_gpu_array(q, "q"), rt.as_gpu_array(k, "k"), rt.as_gpu_array(v, "v")
    return q, k, v


def _check_dense(q, k, v, *, causal, softmax_scale, window, softcap, return_lse):
    """Every check of the GPU path that needs only .shape / .dtype (so it also runs on NumPy arrays, with no
    GPU). Returns (shape, (left, right), scale, softcap, return_lse)."""
    shape = _checks.check_attention_args(q, k, v, window, softcap, causal=causal, softmax_scale=softmax_scale,
                                         dtypes=_checks.GPU_ATTENTION_DTYPES)
    return_lse = _checks.check_flag("return_lse", return_lse)
    _check_seqlen("q", shape.Sq)
    _check_seqlen("k", shape.Sk)
    _check_grid(shape.B, shape.Hq, shape.Sq)
    left, right = _checks.effective_window(window, causal)
    return (shape, (left, right), _checks.effective_scale(softmax_scale, shape.D), _checks.check_softcap(softcap),
            return_lse)


def _check_varlen(q, k, v, cu_q, cu_k, *, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap,
                  return_lse, check_values=True):
    """The varlen counterpart of `_check_dense` (check_values: read the offsets on the host)."""
    shape = _checks.check_varlen_args(q, k, v, cu_q, cu_k, window, softcap, max_seqlen_q=max_seqlen_q,
                                      max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                      dtypes=_checks.GPU_ATTENTION_DTYPES, check_values=check_values)
    return_lse = _checks.check_flag("return_lse", return_lse)
    # (a length read from the offsets names them; one the caller gave names its max_seqlen)
    _check_seqlen("cu_seqlens_q" if max_seqlen_q is None else "max_seqlen_q", shape.max_seqlen_q)
    _check_seqlen("cu_seqlens_k" if max_seqlen_k is None else "max_seqlen_k", shape.max_seqlen_k)
    _check_grid(shape.B, shape.Hq, shape.max_seqlen_q)
    left, right = _checks.effective_window(window, causal)
    return (shape, (left, right), _checks.effective_scale(softmax_scale, shape.D), _checks.check_softcap(softcap),
            return_lse)


def _flash_gpu(q, k, v, *, causal, softmax_scale, window, softcap, return_lse, out=None, lse_out=None,
               config=None, fast_key=None):
    cp = rt.require_cupy()
    q, k, v = _prepare_gpu(q, k, v)
    shape, win, scale, softcap, return_lse = _check_dense(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                          window=window, softcap=softcap, return_lse=return_lse)
    _check_gpu_common(q, k, v)
    B, Sq, Sk, Hq, Hkv, D = shape
    with q.device:
        q, k, v = rt.ensure_contiguous(q), rt.ensure_contiguous(k), rt.ensure_contiguous(v)
        o = _check_out(out, q.shape, q.dtype, "out") if out is not None else cp.empty(q.shape, dtype=q.dtype)
        lse = None
        if return_lse:
            lse = (_check_out(lse_out, (B, Hq, Sq), np.float32, "lse_out") if lse_out is not None
                   else cp.empty((B, Hq, Sq), dtype=cp.float32))
        launch = _Launch.dense(q, k, v, scale=scale, window=win, softcap=softcap, out=o, lse=lse)
        bound = launch.run(launch.pick(config))
    # not stored while a graph is being captured: the persistent tile's balanced schedule is not made then
    # (Launch.schedule), and the plan would go on replaying the static rounds after the capture
    if fast_key is not None and q.size and q.data.device_id == cp.cuda.runtime.getDevice() and \
            not cp.cuda.get_current_stream().is_capturing():
        prev = _fast_plans.get(fast_key)  # the same key replans the same launch: keep its packed launches
        launches = _plans.PlanCache(_LAUNCHES_PER_PLAN) if prev is None else prev[-1]
        _fast_plans.put(fast_key, bound + (launch.vec, q.data.device_id, launches))
    return (o, lse) if return_lse else o


# A call whose shapes, dtypes, options, device, stream and tuning state match an earlier one that passed every
# check in _flash_gpu replays that call's launch: only what can differ between such calls (array types,
# contiguity, device, 16-byte alignment) is re-checked. This saves ~40 us a call, which a short attention
# (S = 1024) would otherwise pay in full.
_fast_plans = _plans.PlanCache()
_LAUNCHES_PER_PLAN = 64  # packed launches a plan keeps, one per (q, k, v) addresses (least recently used out)


def _fast_key(q, k, v, causal, softmax_scale, window, softcap, return_lse):
    cp = rt.cupy
    try:
        # window's element types too: (1, 0) == (True, 0) == (1.0, 0), but only the first passes check_window
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, type(causal), causal, type(softmax_scale),
               softmax_scale, type(window), window, type(softcap), softcap, type(return_lse), return_lse,
               cp.cuda.runtime.getDevice(), _plans.stream_key(),
               _autotune is not None and _autotune.mode(), _autotune is not None and _autotune.generation(_FAMILY),
               _variant(),
               tuple(map(type, window)) if type(window) is tuple else None)
        hash(key)
    except TypeError:  # a list window, an odd scalar: the full path
        return None
    return key


def _flash_fast(key, q, k, v, return_lse):
    """The replayed launch, or None when this call must take the full path."""
    plan = _fast_plans.get(key)
    if plan is None:
        return None
    kern, grid, block, smem, scalars, wg, boxes, vec, dev, launches = plan
    if not (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous) or \
            not (q.data.device_id == k.data.device_id == v.data.device_id == dev):
        return None
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr)
    if vec != (q.shape[-1] % 8 == 0 and (ptrs[0] | ptrs[1] | ptrs[2]) % 16 == 0):
        return None
    cp = rt.cupy
    # a packed launch per (plan, q, k, v addresses): the tensor maps hold the addresses, only o / lse change
    launch = launches.get(ptrs)
    if launch is None:
        maps = _map_args(q, k, v, boxes) if wg else ()  # the maps hold the array addresses: new arrays, new maps
        if maps is None:
            return None
    o = cp.empty(q.shape, dtype=q.dtype)
    lse = cp.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=cp.float32) if return_lse else None
    if launch is None:
        args = (q, k, v, o, rt.NULL if lse is None else lse, rt.NULL, rt.NULL) + scalars + maps
        if _plans.kernel_ptr(kern) is None:  # no driver handle: CuPy's kernel call
            kern(grid, block, args, shared_mem=smem)
            return (o, lse) if lse is not None else o
        launch = _plans.Launch(kern, grid, block, args, (3, 4) if lse is not None else (3,), smem)
        launches.put(ptrs, launch)
    launch((o.data.ptr, lse.data.ptr) if lse is not None else (o.data.ptr,), cp.cuda.get_current_stream().ptr)
    return (o, lse) if lse is not None else o


def _check_out(buf, shape, dtype, name):
    cp = rt.require_cupy()
    if not isinstance(buf, cp.ndarray) or tuple(buf.shape) != tuple(shape) or buf.dtype != np.dtype(dtype) \
            or not buf.flags.c_contiguous:
        raise ValueError(f"{name}: expected a contiguous CuPy array of shape {tuple(shape)} and dtype "
                         f"{np.dtype(dtype)}, got {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', None)}")
    return buf


def _varlen_gpu(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                window, softcap, return_lse, check="device", out=None, lse_out=None, config=None):
    cp = rt.require_cupy()
    q, k, v = _prepare_gpu(q, k, v)
    cu_q = cu_seqlens_q if _is_host(cu_seqlens_q) else rt.as_gpu_array(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_seqlens_k if _is_host(cu_seqlens_k) else rt.as_gpu_array(cu_seqlens_k, "cu_seqlens_k")
    host = _checks.check_mode(check) == "host"
    if host:
        _errors.check_errors(op="flash_attention_varlen")
    # offsets on the GPU with both max_seqlen given are checked by the kernel (no copy, no sync)
    read = host or _is_host(cu_q) or _is_host(cu_k) or max_seqlen_q is None or max_seqlen_k is None
    shape, win, scale, softcap, return_lse = _check_varlen(
        q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, window=window, softcap=softcap, return_lse=return_lse, check_values=read)
    _check_gpu_common(q, k, v, **{n: a for n, a in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k))
                                  if not _is_host(a)})
    with q.device:
        q, k, v = rt.ensure_contiguous(q), rt.ensure_contiguous(k), rt.ensure_contiguous(v)
        cu_q_d = cp.ascontiguousarray(cp.asarray(cu_q, dtype=cp.int32))
        cu_k_d = cp.ascontiguousarray(cp.asarray(cu_k, dtype=cp.int32))
        o = _check_out(out, q.shape, q.dtype, "out") if out is not None else cp.empty(q.shape, dtype=q.dtype)
        lse = None
        if return_lse:
            lse = (_check_out(lse_out, (shape.Hq, shape.total_q), np.float32, "lse_out") if lse_out is not None
                   else cp.empty((shape.Hq, shape.total_q), dtype=cp.float32))
        max_q = max(1, shape.max_seqlen_q)
        max_k = max(1, shape.max_seqlen_k)
        launch = _Launch(q, k, v, o, lse, cu_q_d, cu_k_d, shape.B, shape.total_q, shape.total_k, max_q, max_k,
                         shape.Hq, shape.Hkv,
                         shape.D, scale, win[0], win[1], softcap, shape.total_q)
        launch.run(launch.pick(config))
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------- public
def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                    return_lse=False):
    """Scaled dot-product attention, FlashAttention-2 style (docs/attention.md).

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D]; float16 or bfloat16 (NumPy inputs: also float32, via the
    float64 reference); Hq % Hkv == 0 (query head h reads KV head h // (Hq // Hkv)); 1 <= D <= 256.
    Scores are softmax_scale * q.k (default 1/sqrt(D)), then softcap * tanh(s / softcap) when softcap > 0.
    Query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, with (left, right) = window (-1 is
    unbounded); causal=True sets right = 0 (bottom-right aligned). Softmax and accumulation in float32. A
    query that sees no key gets output 0 and lse -inf. |softmax_scale| <= 2^64 (zero and negative allowed) and
    softcap 0 (off) or in [2^-32, 2^64], else ValueError: the kernels' float32 scores then cannot overflow for
    float16 inputs. NaN / Inf inputs: the reference makes non-finite exactly the outputs that depend on them (a
    NaN query row is NaN); the GPU kernels are only tested for finite inputs.

    Returns o [B, Sq, Hq, D] in q's dtype (a CuPy array for GPU inputs) and, with return_lse=True, also
    lse float32 [B, Hq, Sq] (natural log of each row's softmax denominator).

    >>> import cupy as cp
    >>> q = cp.random.standard_normal((2, 1024, 8, 128)).astype(cp.float16)
    >>> k = v = cp.random.standard_normal((2, 1024, 2, 128)).astype(cp.float16)
    >>> o = flash_attention(q, k, v, causal=True)        # [2, 1024, 8, 128] float16
    """
    cp = rt.cupy
    fast_key = None
    if cp is not None and type(q) is cp.ndarray and type(k) is cp.ndarray and type(v) is cp.ndarray:
        fast_key = _fast_key(q, k, v, causal, softmax_scale, window, softcap, return_lse)
        res = None if fast_key is None else _flash_fast(fast_key, q, k, v, return_lse)
        if res is not None:
            return res
    if _checks.split_host_device(q=q, k=k, v=v):
        _checks.check_attention_args(q, k, v, window, softcap, causal=causal, softmax_scale=softmax_scale)
        _checks.check_flag("return_lse", return_lse)
        return ref.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                   softcap=softcap, return_lse=return_lse)
    return _flash_gpu(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                      return_lse=return_lse, fast_key=fast_key)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False,
                           check="device"):
    """`flash_attention` over packed sequences of different lengths.

    q [total_q, Hq, D], k and v [total_k, Hkv, D]; sequence b holds q rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    and k / v rows cu_seqlens_k[b]:cu_seqlens_k[b+1] (int32 [B + 1], starting at 0, non-decreasing, ending at
    total_q / total_k; on the GPU or the host). Masks are per sequence (causal aligned bottom-right within each
    sequence); a sequence may have no queries or no keys (no keys: output 0 and lse -inf), but total_q and
    total_k must be at least 1 (empty arrays are refused, as everywhere). max_seqlen_q / max_seqlen_k bound the
    sequence lengths.

    Checking the offsets, and when the call synchronizes:
    - GPU offsets with both max_seqlen given (the way to call it in a loop or a CUDA graph): nothing is copied to
      the host. The kernel checks each sequence's offsets (in order, inside the tokens, no longer than its
      max_seqlen); a bad sequence gets NaN rows and a flag that `vbw_cupy.check_errors()` raises as ValueError.
    - Otherwise (a max_seqlen missing, host offsets, or ``check="host"``) the offsets are read on the host and
      checked there (a GPU array's read is a device-to-host copy, which synchronizes), and a max_seqlen given
      below the longest sequence raises ValueError. ``check="host"`` also raises errors flagged earlier.

    Returns o [total_q, Hq, D] and, with return_lse=True, lse float32 [Hq, total_q].
    """
    if _checks.split_host_device(q=q, k=k, v=v):
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not _is_host(cu):
                raise TypeError(f"{name}: expected NumPy offsets with NumPy q, k, v (NumPy and GPU inputs "
                                f"cannot be mixed), got {type(cu).__name__}")
        _checks.check_mode(check)
        _checks.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, window, softcap, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale)
        _checks.check_flag("return_lse", return_lse)
        return ref.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                          max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                          window=window, softcap=softcap, return_lse=return_lse)
    return _varlen_gpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                       return_lse=return_lse, check=check)


# ---------------------------------------------------------------------------------------------- selftest
def _selftest_case(B, S, Hq, Hkv, D, dtype, causal):
    def case():
        import ml_dtypes
        cp = rt.require_cupy()
        dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
        rng = np.random.default_rng(1234)
        qh = rng.standard_normal((B, S, Hq, D)).astype(dt)
        kh = rng.standard_normal((B, S, Hkv, D)).astype(dt)
        vh = rng.standard_normal((B, S, Hkv, D)).astype(dt)
        q, k, v = cp.asarray(qh), cp.asarray(kh), cp.asarray(vh)
        o = flash_attention(q, k, v, causal=causal)
        o64 = ref.flash_attention(qh.astype(np.float32), kh.astype(np.float32), vh.astype(np.float32),
                                  causal=causal)
        low = ref.sdpa_lowp(qh, kh, vh, causal=causal)
        err = ref.rel_error(cp.asnumpy(o).astype(np.float32), o64)
        base = ref.rel_error(low.astype(np.float32), o64)
        cap = 2e-3 if dtype == "float16" else 1e-2
        bound = min(2 * base, cap) if base > 0 else cap
        ms = _timing.time_ms(lambda: flash_attention(q, k, v, causal=causal), warmup=3, rep=10)
        peer = _peers.attention_peer(q, k, v, causal, 1.0 / math.sqrt(D))
        peer_ms = None
        if peer is not None:
            try:
                peer_ms = peer.time_ms(warmup=1, rep=3) if peer.naive else peer.time_ms(warmup=3, rep=10)
            except Exception as e:  # noqa: BLE001 - a failing peer leaves its cells empty, not the row
                rt.warn_once(f"peer:{peer.kind}", f"vbw_cupy selftest: the {peer.label} peer failed ({e})")
        flops = 4.0 * B * Hq * S * S * D / (2 if causal else 1)
        return {"op": "flash_attention", "shape": f"B{B} S{S} H{Hq}/{Hkv} D{D} {dtype}{' causal' if causal else ''} "
                f"({flops / ms / 1e9:.0f} TFLOP/s)", "error": err, "bound": bound, "ok": bool(err <= bound),
                "time_ms": ms, "peer": peer.label if peer_ms else None, "peer_ms": peer_ms,
                "peer_naive": bool(peer_ms and peer.naive)}
    case.__qualname__ = f"flash_attention[D{D},{dtype},{'causal' if causal else 'full'}]"
    return case


def selftest_cases() -> list:
    """Selftest rows: real sizes, error against the float64 reference (computed on the host), time against
    the best peer importable here (`vbw_cupy._peers`: cuDNN SDPA through cudnn-frontend, torch SDPA, else a
    naive CuPy matmul-softmax-matmul, labelled as such)."""
    return [_selftest_case(1, 2048, 8, 2, 128, "float16", True),
            _selftest_case(1, 2048, 8, 8, 64, "bfloat16", False),
            _selftest_case(1, 1024, 4, 1, 256, "float16", False)]
