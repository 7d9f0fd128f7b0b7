"""A user's own Megatron training script that turns fp4_dist on with ``fp4_dist.megatron.enable()``.

    torchrun --nproc_per_node 2 megatron_user_script.py --out report.json <Megatron arguments>

Written the way a Megatron user writes one: Megatron's own argument parser and validate_args (with
``--fp4-param-gather`` and no ``--fp4-format``, no TransformerEngine), Megatron's GPTModel (local spec), DDP with
the distributed optimizer, ``get_megatron_optimizer``, ``get_forward_backward_func``. fp4_dist adds one call before
anything Megatron runs (``enable()``) and one after the model is built (``convert_to_nvfp4``). Checked on every
rank: the steps train (finite losses), the gathered NVFP4 weights equal quantize(full master) after each step, the
tied embedding/output weight stays tied, and DDP refuses NVFP4 weights when fp4_param_gather is off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fp4_dist.megatron  # noqa: E402

fp4_dist.megatron.enable()  # before Megatron parses anything (Python 3.11 shim, --fp4-param-gather without TE)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.training import arguments, global_vars, training  # noqa: E402
from megatron.training.argument_utils import core_transformer_config_from_args  # noqa: E402

from fp4_dist.launch import shutdown  # noqa: E402
from fp4_dist.megatron.model import convert_to_nvfp4  # noqa: E402
from fp4_dist.megatron.parity import check_nvfp4_weights  # noqa: E402


def main() -> int:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--out", required=True)
    opts, megatron_argv = ours.parse_known_args()
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(megatron_argv)
    args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    arguments.validate_args(args)
    global_vars.set_args(args)
    dist.init_process_group(args.distributed_backend)
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, 1)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    failures = []

    config = core_transformer_config_from_args(args)
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                   max_sequence_length=args.max_position_embeddings)  # fmt: skip
    model = Float16Module(config, gpt)
    convert_to_nvfp4(model, config)
    ddp_config = training.get_megatron_ddp_config(args)
    try:  # fp4_param_gather off with NVFP4 weights: refused, not silently left untrained
        DistributedDataParallel(config, type(ddp_config)(use_distributed_optimizer=True), model)
        failures.append("DDP accepted NVFP4 weights with fp4_param_gather off")
    except ValueError as e:
        if "fp4_param_gather" not in str(e):
            failures.append(f"unclear refusal: {e}")
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt_config, _ = training.get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        out = model(tokens[:, :-1], torch.arange(args.seq_length).expand(tokens.shape[0], -1), None,
                    labels=tokens[:, 1:])

        def loss_func(per_token):
            return per_token.float().mean(), {"lm loss": per_token.float().mean().detach()}

        return out, loss_func

    losses = []
    g = torch.Generator().manual_seed(args.seed + parallel_state.get_data_parallel_rank())
    for _ in range(args.train_iters):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        batches = iter([torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
                        for _ in range(args.global_batch_size // (args.micro_batch_size * dist.get_world_size()))])
        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches, model=[ddp],
            num_microbatches=args.global_batch_size // (args.micro_batch_size * dist.get_world_size()),
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
        ok, _, _ = optimizer.step()
        losses.append(float(torch.stack([r["lm loss"] for r in reports]).mean()))
        report = check_nvfp4_weights(ddp.module, optimizer)
        if not report.ok or not report.weights:
            failures.append(f"step {len(losses)}: {report.weights} weights, {report.mismatches[:2]}")
    if gpt.share_embeddings_and_output_weights and \
            gpt.shared_embedding_or_output_weight() is not gpt.embedding.word_embeddings.weight:
        failures.append("the tied output weight is no longer the embedding weight")
    if not all(l == l for l in losses):
        failures.append(f"non-finite losses {losses}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failures)
    if dist.get_rank() == 0:
        with open(opts.out, "w") as f:
            json.dump({"losses": losses, "failures": [x for fs in everyone for x in fs]}, f)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
