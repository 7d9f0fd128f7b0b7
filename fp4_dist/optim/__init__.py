"""ZeRO support: the partial cast of fp32 master shards into NVFP4 weights, collectives, and Zero1Optimizer."""

from .cast import (
    BoundCast,
    CastPlan,
    cast_master_weights_to_nvfp4,
    make_cast_plan,
    post_all_gather_processing,
    quantize_master_weights,
    run_cast,
)
from .collectives import CommStats
from .zero1 import Zero1Config, Zero1Optimizer

__all__ = [
    "cast_master_weights_to_nvfp4",
    "quantize_master_weights",
    "post_all_gather_processing",
    "CastPlan",
    "BoundCast",
    "make_cast_plan",
    "run_cast",
    "CommStats",
    "Zero1Optimizer",
    "Zero1Config",
]
