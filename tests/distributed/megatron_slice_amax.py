"""A script around ``megatron.training.pretrain()`` whose NVFP4 conversion quantizes each tensor-parallel slice with
its own amax (the whole-weight MAX over the TP group left out), as a conversion that forgot the rule would:

    torchrun --nproc_per_node 4 -m fp4_dist.megatron.run megatron_slice_amax.py SCRIPT.py <args> --fp4-param-gather

The claim tested is the launcher's: the after-setup check always runs with --fp4-param-gather, so such weights stop
the run on every rank, naming the weight, before the first step trains on them.
"""

import runpy
import sys

from fp4_dist.megatron import model

model.reduce_whole_amaxes = lambda params, amaxes: amaxes  # each slice keeps its own amax
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
