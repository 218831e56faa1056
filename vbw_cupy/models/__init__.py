"""The Llama model family built from vbw_cupy's ops: loaders (llama2.c `.bin`, Hugging Face folders),
tokenizers, the forward pass over a small array backend (`ops.py`, the NumPy reference path), the GPU model
(`gpu.py`: fused kernels, paged decode in a CUDA graph), sampling and generation.

>>> from vbw_cupy.models import load_model, load_tokenizer, generate                  # doctest: +SKIP
>>> model = load_model("stories15M.bin", weights="nvfp4")                              # doctest: +SKIP
>>> out = generate(model, load_tokenizer("tokenizer.bin"), "Once upon a time")        # doctest: +SKIP
"""
from .generate import Generation, Sequence, generate, generate_ids
from .llama import LayerWeights, Llama, LlamaConfig, LlamaKVCache, LlamaWeights
from .loaders import load_checkpoint, load_config, load_hf, load_llama2c, load_model, save_llama2c
from .gpu import GPUKVCache, LlamaGPU
from .ops import ArrayOps, numpy_ops
from .sampling import Sampler, sampling_probs
from .tokenizer import HFTokenizer, Llama2cTokenizer, load_tokenizer

__all__ = ["LlamaConfig", "LlamaWeights", "LayerWeights", "Llama", "LlamaKVCache", "load_model", "load_checkpoint", "load_config",
           "load_llama2c", "load_hf", "save_llama2c", "Llama2cTokenizer", "HFTokenizer", "load_tokenizer", "ArrayOps", "numpy_ops",
           "LlamaGPU", "GPUKVCache", "Sampler", "sampling_probs", "generate", "generate_ids", "Generation", "Sequence"]
