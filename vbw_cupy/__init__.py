"""vbw_cupy: FP4 (MXFP4 / NVFP4) codecs and GEMM, and flash attention, as CUDA kernels compiled at run time
through CuPy. NumPy inputs run the float64 reference (`vbw_cupy.reference`); CuPy inputs run on the GPU."""
from . import reference
from .fp4 import FP4Tensor, dequantize, quantize

__version__ = "0.1.0"
__all__ = ["FP4Tensor", "quantize", "dequantize", "reference", "__version__"]
