"""NVFP4 stages over lists of weights, for every device (`stages.py` documents the pipeline).

Modules, and the one way a call travels through them::

    stages.py       the public API: each stage as a call form (`partial_cast`) and a bound form
                    (`bind_partial_cast`); CPU tensors run `reference.py`, CUDA tensors a plan and a launch
    checks.py       every argument check (both devices), run before anything is built or written
    cuda_plans.py   CUDA only: the work table a launch reads (`Plan`), laid out from checked arguments
    _launch.py      CUDA only: compiles cuda/*.cu once per device (NVRTC) and launches on torch's stream
    reference.py    the numeric contract in plain PyTorch: the CPU path and the oracle of every kernel
"""

from . import reference
from .stages import *  # noqa: F401,F403  (the public stage API)
from .stages import __all__ as _stages_all

__all__ = ["reference", *_stages_all]
