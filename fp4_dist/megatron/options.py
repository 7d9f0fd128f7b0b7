"""What a Megatron run with fp4_dist chooses, defined once: `AdapterOptions`, its command-line flags, and the choice
in force.

Every way in reads the same fields: the launcher (``python -m fp4_dist.megatron.run --check-every 10 SCRIPT ...``),
the example trainer (``--fp4-check-every 10``: the same flags behind a prefix, beside Megatron's own) and the Python
API (``fp4_dist.megatron.enable(check_every=10)`` or ``enable(options=AdapterOptions(...))``). A new option is one
field here, with its help text; `AdapterOptions.add_arguments` and `AdapterOptions.from_args` give it to the parsers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ..compute.modes import DEFAULT, MODES, mode_named, options_from_pairs
from ..compute.pool import set_pool_depth
from ..format import DEFAULT_NUMERICS, NUMERICS


def _option(default: Any, help: str, *, flag: Optional[str] = None, off_flag: Optional[str] = None,
            **argparse_kwargs):
    """A field of `AdapterOptions` and how it is spelled on a command line: ``--<flag>`` (default: the field's
    name with dashes); `off_flag`: a boolean's second flag, which sets it to False (its default, spelled out)."""
    return field(default=default, metadata={"help": help, "flag": flag, "off_flag": off_flag,
                                            "argparse": argparse_kwargs})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class AdapterOptions:
    """Choices `fp4_dist.megatron.enable` makes for the whole Megatron run. Each field's help text (below, and
    ``--help`` of the launcher and of the example trainer) is its documentation."""

    numerics: str = _option(DEFAULT_NUMERICS, "NVFP4 block-scale formula of the converted weights (TransformerEngine "
                            "main, or its v2.14 variant)", choices=NUMERICS)  # fmt: skip
    compute_copy: bool = _option(False, "keep a bf16 copy of every NVFP4 weight between updates (2.5 bytes per weight "
                                 "against bf16's 2): no dequantize per use, faster where microbatches are small "
                                 "(default: lean, 0.5 bytes per weight and one layer's copies, made around each use; "
                                 "the same values)",
                                 off_flag="no-compute-copy")
    lean_depth: int = _option(1, "lean compute: hold the bf16 copies of N layers at once (N buffers per weight shape, "
                              "in turn): with several micro-batches per step each weight's copy is made 2 (layers - N) "
                              "times per micro-batch instead of 2 (layers - 1), for N layers' copies of memory; the "
                              "same values at every N (process-wide: fp4_dist.compute.set_pool_depth)",
                              metavar="N", type=int)
    compute: str = _option(DEFAULT, "what the NVFP4 linears' GEMMs read: bf16 values of the weights, or (fp8) each "
                           "weight's FP8 block copy, 1 byte per weight made once per update, with FP8 activations "
                           "and gradients: cuBLAS's block-scaled GEMMs on Hopper (sm_90), emulated on CPU ranks, "
                           "refused elsewhere (docs/fp8.md)", choices=MODES)  # fmt: skip
    compute_options: tuple = _option((), "a field of the compute mode's options, NAME=VALUE (repeat the flag for "
                                     "several): e.g. keep_transpose=false in the fp8 mode (1.5 bytes per weight "
                                     "instead of 2.5: each dgrad transposes the weight's copy), stochastic_rounding="
                                     "false or rht=false in the nvfp4 mode (docs/fp8.md, docs/nvfp4_recipe.md)",
                                     flag="compute-option", action="append", metavar="NAME=VALUE")
    columnwise: bool = _option(False, "also build the columnwise NVFP4 copies after every param all-gather, as "
                               "TransformerEngine does (nothing in fp4_dist's compute path reads them)")
    check_every: int = _option(0, "every N iterations, check on every rank that the gathered NVFP4 weights equal "
                               "quantize(full fp32 master); stop with an error if not (0: off)", metavar="N", type=int)
    log_json: Optional[str] = _option(None, "rank 0 writes the run's record here: per-iteration loss and grad norm, "
                                      "checks, and the digest of every fp32 master after setup and at the last "
                                      "iteration", metavar="PATH")
    allow_untested_version: bool = _option(False, "run with a megatron-core version outside the tested range",
                                           flag="allow-untested-megatron")

    def __post_init__(self):
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {list(NUMERICS)}, got {self.numerics!r}")
        mode = mode_named(self.compute, "AdapterOptions")
        object.__setattr__(self, "compute_options", tuple(self.compute_options or ()))
        options_from_pairs(mode, self.compute_options, "--compute-option (--fp4-compute-option in the example "
                           "trainer)")
        if self.compute_copy and not mode.kept_copies:
            raise ValueError(f"the {mode.name} compute mode's GEMMs read {mode.gemms_read}, never a bf16 compute "
                             f"copy: drop --compute-copy (--fp4-compute-copy in the example trainer) or "
                             f"{mode.flags()}")  # fmt: skip
        if isinstance(self.lean_depth, bool) or not isinstance(self.lean_depth, int) or self.lean_depth < 1:
            raise ValueError(f"lean_depth must be an int >= 1 (layers whose copies are held at once), got "
                             f"{self.lean_depth!r}")
        if self.lean_depth != 1 and (self.compute_copy or not mode.lean_depth):
            other = "--compute-copy every copy is kept" if self.compute_copy else f"{mode.flags()} no lean copy is made"
            raise ValueError("--lean-depth (--fp4-lean-depth in the example trainer) sets how many layers' copies the "
                             f"lean compute mode holds; with {other}: drop one of them")
        if isinstance(self.check_every, bool) or not isinstance(self.check_every, int) or self.check_every < 0:
            raise ValueError(f"check_every must be an int >= 0 (iterations; 0: off), got {self.check_every!r}")

    def mode_options(self):
        """The compute mode's options instance that ``compute_options`` spell (None: the mode's defaults)."""
        return options_from_pairs(MODES[self.compute], self.compute_options, "--compute-option")

    def gemms(self) -> str:
        """How a run's messages name what its GEMMs compute in: the mode and the options given (``GEMMs in nvfp4,
        rht=false``)."""
        return ", ".join([f"GEMMs in {self.compute}", *self.compute_options])

    @classmethod
    def flags(cls, prefix: str = "") -> dict[str, str]:
        """{field name: its command-line flag} with `prefix` (``"fp4-"`` in the example trainer)."""
        return {f.name: f"--{prefix}{f.metadata['flag'] or f.name.replace('_', '-')}" for f in fields(cls)}

    @classmethod
    def all_flags(cls, prefix: str = "") -> set[str]:
        """Every command-line spelling of the options: each field's flag and the second flags of booleans."""
        offs = {f"--{prefix}{f.metadata['off_flag']}" for f in fields(cls) if f.metadata["off_flag"]}
        return set(cls.flags(prefix).values()) | offs

    @classmethod
    def add_arguments(cls, parser, prefix: str = ""):
        """Add a flag per field to `parser` (an ArgumentParser or an argument group); returns it."""
        for f in fields(cls):
            flag = cls.flags(prefix)[f.name]
            off = f"--{prefix}{f.metadata['off_flag']}" if f.metadata["off_flag"] else None
            text = f.metadata["help"] + (f"; {off} spells the default out" if off else "")
            kwargs = dict(help=text, dest=_dest(flag))
            if f.type in (bool, "bool"):
                kwargs["action"] = "store_true"  # every boolean option is off by default
            else:
                # argparse's "append" extends its default in place: a list per parse, made a tuple by the class
                append = f.metadata["argparse"].get("action") == "append"
                kwargs.update(default=None if append else f.default, **f.metadata["argparse"])
            parser.add_argument(flag, **kwargs)
            if off:
                parser.add_argument(off, action="store_false", dest=kwargs["dest"], default=argparse.SUPPRESS,
                                    help="the default, spelled out")  # fmt: skip
        return parser

    @classmethod
    def from_args(cls, namespace: argparse.Namespace, prefix: str = "") -> "AdapterOptions":
        """The options a namespace parsed with `add_arguments` (same `prefix`) holds."""
        return cls(**{f.name: getattr(namespace, _dest(cls.flags(prefix)[f.name])) for f in fields(cls)})


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


_options = AdapterOptions()


def current_options() -> AdapterOptions:
    """The options of the installed adapter (defaults when it is not installed)."""
    return _options


def set_options(options: AdapterOptions) -> None:
    """Put `options` in force; the lean pool takes their depth (process-wide)."""
    global _options
    _options = options
    set_pool_depth(options.lean_depth)
