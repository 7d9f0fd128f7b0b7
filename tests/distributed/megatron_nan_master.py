"""python -m examples.megatron_pretrain_gpt with a NaN written into one fp32 master shard of one rank, after the
optimizer's update of a given step and before that step's cast (as an optimizer's own bug would leave it).

    torchrun --nproc_per_node 2 megatron_nan_master.py BAD_RANK BAD_STEP <pretrain_gpt arguments>
    torchrun --nproc_per_node 2 -m fp4_dist.megatron.run megatron_nan_master.py BAD_RANK BAD_STEP SCRIPT.py <args>

The first runs the project's entry point; the second a script around ``megatron.training.pretrain()`` (as
Megatron-LM's pretrain_gpt.py) under fp4_dist's launcher.

The claim tested is the adapter's: the cast does not wait for its non-finite check in the middle of Megatron's
step, and still every rank stops with the error naming the weight before any layer reads the weights cast from
that master (at the step's post-all-gather processing, or at the next forward's with --overlap-param-gather).
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import megatron.core.optimizer.distrib_optimizer as distrib_optimizer  # noqa: E402

from examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402

BAD_RANK, BAD_STEP = int(sys.argv.pop(1)), int(sys.argv.pop(1))
real_copy = distrib_optimizer.DistributedOptimizer._copy_main_params_to_model_params
steps = 0


def copy_main_params_to_model_params(self, *args, **kwargs):
    global steps
    steps += 1
    if steps == BAD_STEP and int(os.environ["RANK"]) == BAD_RANK:
        _, masters, _ = self._get_nvfp4_params_and_shard_fp32_from_nvfp4()
        victim = [m for m in masters if m is not None and m.numel()][-1]
        victim.view(-1)[victim.numel() // 2] = float("nan")
        print(f"[rank {BAD_RANK}] injected a NaN into an fp32 master at step {BAD_STEP}", flush=True)
    return real_copy(self, *args, **kwargs)


distrib_optimizer.DistributedOptimizer._copy_main_params_to_model_params = copy_main_params_to_model_params
if len(sys.argv) > 1 and sys.argv[1].endswith(".py"):
    script = sys.argv.pop(1)
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
else:
    sys.exit(pretrain_gpt._cli())
