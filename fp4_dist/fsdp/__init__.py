"""PyTorch FSDP2 with NVFP4 linear weights all-gathered in 4 bits (see `shard.fully_shard_nvfp4`, docs/fsdp2.md).

Modules: `shard` (the entry point, the report, the ordered reduce-scatter), `master` (NVFP4Master: the fp32
master parameter and FSDP2's all-gather extension), `precompute` (the batched cast before the all-gathers).
"""

from .master import NVFP4Master
from .shard import FSDPReport, OrderedReduceScatter, fully_shard_nvfp4, nvfp4_weights, precompute_nvfp4

__all__ = ["fully_shard_nvfp4", "FSDPReport", "precompute_nvfp4", "nvfp4_weights", "NVFP4Master",
           "OrderedReduceScatter"]
