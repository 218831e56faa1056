"""What `vbw-cupy warmup` compiles: the kernel instances that given ops, or a model of a given checkpoint, can
launch on one architecture (tuning candidates included), so their first calls load from the disk cache."""
from __future__ import annotations

import importlib
import inspect

#: public op -> the modules whose kernels it launches
OPS = {
    "quantize": ("fp4",),
    "dequantize": ("fp4",),
    "fp4_matmul": ("gemm", "fp4"),               # an FP4Tensor `a` is dequantized first
    "flash_attention": ("attention",),
    "flash_attention_varlen": ("attention",),
    "flash_attention_fp8": ("attention_fp8", "attention"),   # the fallback off sm_90 decodes, then flash_attention
    "quantize_e4m3": ("attention_fp8",),
    "paged_attention": ("paged",),
    "PagedKVCache": ("paged",),
    "block_sparse_attention": ("sparse",),
}
#: what a Llama on the GPU runs: its own kernels, the GEMM (FP4 weights), prefill and decode attention
MODEL_MODULES = ("models.gpu", "fp4", "gemm", "attention", "paged")


def _module_instances(name: str, arch: int, head_dims=None) -> list[tuple[str, str]]:
    mod = importlib.import_module(f"vbw_cupy.{name}")
    params = inspect.signature(mod.kernel_instances).parameters
    kw = {k: v for k, v in (("arch", arch), ("head_dims", head_dims)) if k in params}
    return mod.kernel_instances(**kw)


def op_instances(ops, arch: int) -> list[tuple[str, str]]:
    """(file, instance) pairs that `ops` (names from OPS; None or empty: every op) can launch on sm_<arch>."""
    ops = list(ops or OPS)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise ValueError(f"ops: unknown {', '.join(unknown)}; expected some of {', '.join(OPS)}")
    mods = sorted({m for o in ops for m in OPS[o]})
    return sorted({inst for m in mods for inst in _module_instances(m, arch)})


def model_instances(checkpoint, arch: int) -> list[tuple[str, str]]:
    """(file, instance) pairs a Llama of `checkpoint` (a llama2.c file or a Hugging Face folder) can launch on
    sm_<arch>: attention only at its head dim."""
    from .models.loaders import load_config
    head_dim = load_config(checkpoint).head_dim
    return sorted({inst for m in MODEL_MODULES for inst in _module_instances(m, arch, [head_dim])})
