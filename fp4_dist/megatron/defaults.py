"""The Megatron flags a machine needs that a command line may not give: what the launcher (``fp4_dist.megatron.run``)
and the example trainer add, each addition printed, a value on the command line always winning.

Megatron-Core 0.19's defaults assume TransformerEngine, apex and Megatron's own fused CUDA kernels; without them the
run stops one error at a time (``persist_layer_norm not supported by torch LayerNorm``, ``fused_weight_gradient_mlp_cuda
module is not found``, ``No module named 'scaled_masked_softmax_cuda'``), and with no ``--eval-interval`` its dataset
sizing divides by None. Each `Default` says when it applies and why.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Machine:
    """What the flags depend on: a CUDA device, and which optional kernel packages import."""

    cuda: bool
    te: bool = False
    apex: bool = False
    fused_softmax: bool = False
    fused_wgrad: bool = False


def probe() -> Machine:
    import torch

    def have(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return Machine(cuda=torch.cuda.is_available(), te=have("transformer_engine"), apex=have("apex"),
                   fused_softmax=have("scaled_masked_softmax_cuda"),
                   fused_wgrad=have("fused_weight_gradient_mlp_cuda"))  # fmt: skip


@dataclass(frozen=True)
class Default:
    flag: str
    values: tuple[str, ...]
    needed: Callable[[Machine], bool]
    why: str
    only_with: tuple[str, ...] = ()
    """Flags of which the command line must give one for this default to apply (none: it always may)."""


PLATFORM_DEFAULTS = (
    Default("--distributed-backend", ("gloo",), lambda m: not m.cuda, "no CUDA: CPU ranks"),
    Default("--transformer-impl", ("local",), lambda m: not m.te, "no TransformerEngine"),
    Default("--no-persist-layer-norm", (), lambda m: not m.apex, "its persistent LayerNorm is apex's"),
    Default("--no-gradient-accumulation-fusion", (), lambda m: not m.fused_wgrad,
            "its fused weight-gradient kernel (fused_weight_gradient_mlp_cuda) is not installed"),
    Default("--no-masked-softmax-fusion", (), lambda m: not m.fused_softmax,
            "Megatron's fused softmax kernels (scaled_masked_softmax_cuda) are not built"),
    Default("--no-rope-fusion", (), lambda m: not m.te,
            "its fused rotary embedding is TransformerEngine's (a RoPE model stops without it)"),
)
"""What any Megatron run on this machine needs (the launcher's and the example trainer's)."""

LAUNCHER_DEFAULTS = PLATFORM_DEFAULTS + (
    Default("--eval-interval", ("1000000000",), lambda m: True,
            "Megatron 0.19 sizes its validation set by train_iters // eval_interval; this value means no "
            "evaluation during training (the final one still runs)"),
    # Megatron's default format, torch_dist, saves here but cannot be loaded back without TransformerEngine or apex
    # (distrib_optimizer.py asserts on the torch.optim fallback's state): a run would save checkpoints it cannot
    # resume from. An explicit --ckpt-format torch_dist still saves; its --load is refused at start-up.
    Default("--ckpt-format", ("torch",), lambda m: not (m.te or m.apex),
            "no TransformerEngine or apex: megatron-core cannot load its default torch_dist checkpoints back "
            "without them", only_with=("--save", "--load")),
)
"""What ``fp4_dist.megatron.run`` adds to Megatron-LM's own scripts."""


def given(argv: Sequence[str]) -> set[str]:
    """The flags `argv` gives (``--flag`` or ``--flag=value``)."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def missing(argv: Sequence[str], machine: Machine, defaults: Sequence[Default] = LAUNCHER_DEFAULTS) -> list[Default]:
    """The defaults this machine needs whose flag `argv` does not give."""
    flags = given(argv)
    return [d for d in defaults if d.needed(machine) and d.flag not in flags
            and (not d.only_with or flags & set(d.only_with))]


def as_arguments(defaults: Sequence[Default]) -> list[str]:
    return [x for d in defaults for x in (d.flag, *d.values)]
