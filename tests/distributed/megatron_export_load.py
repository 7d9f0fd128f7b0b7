"""Load a Megatron export (``python -m fp4_dist.export megatron``) back into a Megatron GPTModel built as the test
runs build it (test_megatron_run.MODEL's shape, local spec, NVFP4 linear weights), one rank: every NVFP4 weight
takes the export's bytes and every dense tensor its values.

    torchrun --nproc-per-node 1 tests/distributed/megatron_export_load.py EXPORT_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import fp4_dist.megatron

fp4_dist.megatron.enable()  # the CPU layer on a machine without CUDA; before megatron.core's model code runs

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from fp4_dist.export import ct_format, load_compressed_tensors  # noqa: E402
from fp4_dist.megatron.model import convert_to_nvfp4  # noqa: E402
from fp4_dist.tensor import is_nvfp4_tensor  # noqa: E402


def main(export: str) -> int:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True,
                               params_dtype=torch.bfloat16, use_cpu_initialization=True)  # fmt: skip
    # tied embedding and output weights: Megatron's default (--untie-embeddings-and-output-weights off)
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=64,
                   share_embeddings_and_output_weights=True).to(torch.bfloat16)
    convert_to_nvfp4(gpt, config)
    report = load_compressed_tensors(gpt, export)
    tensors, amaxes, _ = ct_format.read_checkpoint(export)
    bad = []
    for name, p in gpt.named_parameters():
        if is_nvfp4_tensor(p):
            module = name[: -len(".weight")]
            if not (torch.equal(p.rowwise_data, tensors[f"{module}.weight_packed"]) and float(p.amax) == amaxes[name]):
                bad.append(name)
        elif not torch.equal(p.detach(), tensors[name].to(p.dtype)):
            bad.append(name)
    print(f"LOADED {len(report.nvfp4)} NVFP4 weights and {len(report.dense)} dense tensors; differing: {bad}",
          flush=True)  # fmt: skip
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
