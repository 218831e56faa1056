"""vbw_cupy: FP4 (MXFP4 / NVFP4) and FP8 codecs and GEMM, and flash attention, as CUDA kernels compiled at run time
through CuPy. NumPy inputs run the float64 reference (`vbw_cupy.reference`); CuPy inputs run on the GPU."""
from . import reference
from ._errors import check_errors
from .attention import flash_attention, flash_attention_varlen
from .attention_fp8 import dequantize_e4m3, flash_attention_fp8, quantize_e4m3
from .fp4 import FP4Tensor, dequantize, quantize
from .fp8 import FP8Tensor, quantize_fp8
from .gemm import fp4_matmul
from .paged import PagedKVCache, paged_attention
from .sparse import block_sparse_attention, bsr_from_mask

__version__ = "0.1.0"
__all__ = ["FP4Tensor", "quantize", "dequantize", "FP8Tensor", "quantize_fp8", "fp4_matmul", "flash_attention",
           "flash_attention_varlen", "flash_attention_fp8", "quantize_e4m3", "dequantize_e4m3", "paged_attention",
           "PagedKVCache", "block_sparse_attention", "bsr_from_mask",
           "check_errors", "reference", "__version__"]
