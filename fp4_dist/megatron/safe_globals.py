"""What a Megatron ``--ckpt-format torch`` checkpoint (``iter_*/mp_rank_*/model_optim_rng.pt``) may hold beyond
tensors: megatron-core's own allow-list (``megatron.core.safe_globals.SAFE_GLOBALS``: the run's argparse
Namespace, Megatron's enums, NumPy's RNG state, ...), the one megatron-core's loader reads it with, and NVFP4
weights."""

from __future__ import annotations

from ..checkpoint.safe_load import NVFP4_GLOBALS

__all__ = ["megatron_checkpoint_globals"]


def megatron_checkpoint_globals(path) -> list:
    """The classes and functions `fp4_dist.checkpoint.safe_load.load_checkpoint_file` may unpickle from the Megatron
    checkpoint file `path` (named in the error when megatron-core is missing)."""
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError as e:
        raise ImportError(f"{path} is a Megatron checkpoint, which holds megatron-core classes (its arguments' enums): "
                          f"reading it needs megatron-core installed, with its allow-list "
                          f"megatron.core.safe_globals (0.19.2 is tested): {e}") from e
    return [*SAFE_GLOBALS, *NVFP4_GLOBALS]
