"""Past one GPU: communicators (`SimComm` on NumPy, `NcclComm` over `cupy.cuda.nccl`), the tensor-parallel
Llama (`tp`) and ring attention over a sequence split across ranks (`ring`). notes/multi-gpu.md has the design.

>>> from vbw_cupy.dist import SimGroup, TPGroup                                      # doctest: +SKIP
>>> group = TPGroup.simulated(config, weights, size=2)          # 2 ranks on NumPy      # doctest: +SKIP
"""
from .comm import Comm, NcclComm, Pending, RankThreads, SimComm, SimGroup, run_ranks
from .ring import ring_attention, zigzag_bounds, zigzag_merge, zigzag_positions, zigzag_split
from .tp import TPGroup, TPLlama, TPLlamaGPU, check_tp, load_tp_model, require_gpus, shard_weights

__all__ = ["Comm", "Pending", "SimComm", "SimGroup", "NcclComm", "run_ranks", "RankThreads", "ring_attention",
           "zigzag_bounds", "zigzag_positions", "zigzag_split", "zigzag_merge", "TPLlama", "TPLlamaGPU", "TPGroup",
           "shard_weights", "check_tp", "load_tp_model", "require_gpus"]
