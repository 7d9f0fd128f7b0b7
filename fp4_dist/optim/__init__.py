"""ZeRO support: the partial cast of fp32 master shards into NVFP4 weights, and Zero1Optimizer.

Modules: `cast_core` (the shard cast every public cast is built on: stages, amax exchange, finite check),
`cast` (cast_master_weights_to_nvfp4, TransformerEngine's semantics), `sharded_cast` (Zero1Optimizer's cast:
cut-tile amax exchange), `post_gather` (after the byte all-gather), `collectives` (every torch.distributed
call), `zero1` + `zero1_state` (the optimizer, its checkpoints).
"""

from .cast import cast_master_weights_to_nvfp4, quantize_master_weights
from .agreement import RankMismatchError
from .collectives import CommStats
from .post_gather import post_all_gather_processing
from .zero1 import Zero1Config, Zero1Optimizer

__all__ = [
    "cast_master_weights_to_nvfp4",
    "quantize_master_weights",
    "post_all_gather_processing",
    "Zero1Optimizer",
    "Zero1Config",
    "CommStats",
    "RankMismatchError",
]
