"""Zero1Optimizer: ZeRO-1 for plain PyTorch loops with NVFP4 weights (any torch.optim optimizer over fp32 master
shards; the cast and the 4-bit gather come from `fp4_dist.cast`).

    zero1.py        Zero1Optimizer, Zero1Config
    zero1_state.py  its sharded checkpoints: save_checkpoint / load_checkpoint, (load_)sharded_state_dict
"""

from .zero1 import Zero1Config, Zero1Optimizer
from .zero1_state import load_checkpoint, save_checkpoint

__all__ = ["Zero1Optimizer", "Zero1Config", "save_checkpoint", "load_checkpoint"]
