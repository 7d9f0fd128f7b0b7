"""Megatron's own module moves keep an NVFP4 parameter's attributes: Float16Module (a .bfloat16() inside),
.cuda() where there is a device, and .to(device); the tensor-parallel attributes Megatron sets and the
high-precision init value its distributed optimizer reads survive, so the masters start from the bf16 init."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core")

import fp4_dist  # noqa: E402
from fp4_dist.megatron import adapter  # noqa: E402

adapter.python_311_shim()

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402


def test_float16module_and_device_moves_keep_megatron_attributes_and_the_init_value():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(32, 48, bias=False))
    init = inner[0].weight.detach().to(torch.bfloat16).clone()
    fp4_dist.convert_linear_weights(inner, dtype=torch.bfloat16)
    w = inner[0].weight
    tensor_parallel.set_tensor_model_parallel_attributes(w, True, 0, 1)
    w.get_high_precision_init_val = lambda: init
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=1, bf16=True,
                               params_dtype=torch.bfloat16)
    model = Float16Module(config, inner)
    moves = [lambda m: m.to("cpu")] + ([lambda m: m.cuda()] if torch.cuda.is_available() else [])
    for move in moves:
        move(model)
        p = model.module[0].weight
        assert p is w and fp4_dist.is_nvfp4_tensor(p)
        assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 0, 1)
        assert p.get_high_precision_init_val() is init
