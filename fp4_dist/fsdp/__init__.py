"""PyTorch FSDP2 with NVFP4 linear weights all-gathered in 4 bits (see `shard.fully_shard_nvfp4`, docs/fsdp2.md).

    shard.py          the entry point (`fully_shard_nvfp4`), its report, the ordered reduce-scatter
    master.py         NVFP4Master: the fp32 master parameter and FSDP2's all-gather extension
    precompute.py     the batched cast before the all-gathers (one amax all-reduce for the model)
    wire.py           what a rank puts into the all-gather and how the gathered bytes are read
    dequant_batch.py  one dequantize launch per FSDP2 parameter group and all-gather, instead of one per weight
"""

from .master import NVFP4Master
from .shard import FSDPReport, OrderedReduceScatter, fully_shard_nvfp4, nvfp4_weights, precompute_nvfp4

__all__ = ["fully_shard_nvfp4", "FSDPReport", "precompute_nvfp4", "nvfp4_weights", "NVFP4Master",
           "OrderedReduceScatter"]
