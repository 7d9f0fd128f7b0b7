"""The command-line options of a trainer that saves and loads checkpoints through this package: one definition for
the main job (examples/train_lm.py) and the example Megatron trainer (examples/megatron_pretrain_gpt.py)."""

from __future__ import annotations


def add_arguments(parser, save: str = "--save") -> None:
    """Add ``--no-verify`` and ``--take-over-lock`` to `parser` (a parser or an argument group); `save`: the option
    that names the checkpoint folder, as the help texts name it."""
    parser.add_argument("--no-verify", action="store_true",
                        help="load checkpoint files without checking them against the manifest written with them "
                             "(default: a file whose bytes differ from its digest is refused, naming it)")
    parser.add_argument("--take-over-lock", action="store_true",
                        help=f"take the {save} folder's lock even when it names a job of another host (default: "
                             "refused, since whether that job still saves there cannot be seen from here)")


__all__ = ["add_arguments"]
