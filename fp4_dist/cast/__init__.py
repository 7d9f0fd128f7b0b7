"""The partial cast: fp32 master shards into NVFP4 weights whose scales agree across ranks, bit-identical to
quantizing each whole weight, and what follows the byte all-gather. Every trainer reaches it here: the ZeRO
optimizer (`fp4_dist.optim`), FSDP2 (`fp4_dist.fsdp`), the Megatron adapter and the export.

    core.py                  CastCore: the shard cast every public cast is built on (stages, amax exchange,
                             finite check)
    master_weights.py        cast_master_weights_to_nvfp4 (= quantize_master_weights): TransformerEngine's
                             signature and semantics
    master_weights_check.py  its check that the ranks passed the same weights and shards covering each once
    sharded.py               ShardedCast: the cast of one ZeRO shard buffer (cut-tile amax exchange)
    post_gather.py           post_all_gather_processing: compute copies and columnwise copies after the gather
    collectives.py           the collectives of the cast and the trainers (group passed in; CommStats counts)
    agreement.py             check_same_on_every_rank: structures compared before a collective sized by them
"""

from .agreement import RankMismatchError
from .collectives import CommStats
from .master_weights import cast_master_weights_to_nvfp4, quantize_master_weights
from .post_gather import post_all_gather_processing

__all__ = [
    "cast_master_weights_to_nvfp4",
    "quantize_master_weights",
    "post_all_gather_processing",
    "CommStats",
    "RankMismatchError",
]
