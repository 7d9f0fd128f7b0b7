"""``python -m fp4_dist.megatron.pretrain_gpt``: the documented command of the example Megatron trainer, which
lives with the other examples (`fp4_dist/examples/megatron_pretrain_gpt.py`)."""

import sys

from ..examples.megatron_pretrain_gpt import _cli

if __name__ == "__main__":
    sys.exit(_cli())
