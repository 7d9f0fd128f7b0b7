"""A Megatron training script run through fp4_dist's launcher with a rank that kills itself (`kill_switch`) inside
``megatron.training``'s train_step or save_checkpoint (its collectives and its ``torch.save`` calls are the events).

    FP4_DIST_TEST_KILL=RANK:PHASE:STEP:K FP4_DIST_TEST_COUNTS=PATH \\
    torchrun --nproc_per_node 2 -m fp4_dist.megatron.run megatron_kill_rank.py SCRIPT.py <Megatron arguments>

STEP is the number of iterations done before the step (``step``) or the iteration saved (``save``). Each rank
writes the events of every phase it saw to PATH.<rank> when it exits normally.
"""

import atexit
import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import megatron.training.training as training  # noqa: E402
import torch  # noqa: E402

from kill_switch import KillSwitch  # noqa: E402

RANK = int(os.environ["RANK"])
switch = KillSwitch(RANK).install()
real_train_step, real_save = training.train_step, training.save_checkpoint


def train_step(*args, iteration=None, **kwargs):
    with switch.phase("step", iteration):
        return real_train_step(*args, iteration=iteration, **kwargs)


def save_checkpoint(iteration, *args, **kwargs):
    with switch.phase("save", iteration):
        return real_save(iteration, *args, **kwargs)


def write_counts():
    path = os.environ.get("FP4_DIST_TEST_COUNTS")
    if path:
        with open(f"{path}.{RANK}", "w") as f:
            json.dump(switch.counts, f)


def torch_save(*args, **kwargs):  # Megatron's checkpoint files: each write is an event too
    switch.event("torch.save")
    return real_torch_save(*args, **kwargs)


real_torch_save = torch.save
training.train_step, training.save_checkpoint, torch.save = train_step, save_checkpoint, torch_save
atexit.register(write_counts)
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
