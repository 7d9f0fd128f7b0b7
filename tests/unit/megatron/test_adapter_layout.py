"""Megatron's packed NVFP4 layout: upstream's goes stale, ours is element layout / 2.

Layouts come from megatron-core's own code (DistributedOptimizer._compute_per_buffer_param_layout and
_ParamAndGradBuffer._compute_nvfp4_packed_layout) on real NVFP4 parameters; `stale_packed_bytes` counts the
weight bytes an all-gather would take from a rank that did not cast them.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

pytest.importorskip("megatron.core")

import fp4_dist  # noqa: E402
from fp4_dist.megatron import adapter, buffers  # noqa: E402
from fp4_dist.megatron.parity import stale_packed_bytes  # noqa: E402

pytestmark = pytest.mark.megatron

# Linear weights [M, K] of the tiny test GPT (hidden 48, 4 heads of 12 channels, 1 KV group, ffn 64):
# qkv [72, 48] (ragged M), proj [48, 48], fc1 [64, 48], fc2 [48, 64], in registration order.
GQA_LAYER = [(72, 48), (48, 48), (64, 48), (48, 64)]
CASES = {
    "40x48-dp2": ([(40, 48)], 2),
    "64x64-dp3": ([(64, 64)], 3),
    "gqa-gpt-dp2": (GQA_LAYER, 2),
    "gqa-gpt-dp3": (GQA_LAYER, 3),
    "gqa-gpt-dp4": (GQA_LAYER, 4),
    "64x64-dp6": ([(64, 64)], 6),
}


@pytest.fixture
def megatron_layout():
    """Install the table (with or without our layout rows) and compute one buffer's layout with Megatron."""
    pgb = importlib.import_module(adapter._PGB)
    do = importlib.import_module(adapter._DO)
    from megatron.core.distributed import DistributedDataParallelConfig

    def layout(shapes, dp, *, upstream: bool, bucket_size=None):
        adapter.uninstall()
        adapter.install(cpu=False, exclude=adapter.UPSTREAM_LAYOUT if upstream else ())
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(fp4_dist.quantize(torch.randn(m, k, generator=g))) for m, k in shapes]
        cfg = DistributedDataParallelConfig(use_distributed_optimizer=True)
        lay = do.DistributedOptimizer._compute_per_buffer_param_layout(params, bucket_size, dp, cfg)
        buf = types.SimpleNamespace(param_index_map=lay.param_index_map, bucket_indices=lay.bucket_indices,
                                    ddp_config=cfg, data_parallel_world_size=dp)
        pgb._ParamAndGradBuffer._compute_nvfp4_packed_layout(buf, [(p, f"w{i}") for i, p in enumerate(params)])
        return buf

    yield layout
    adapter.uninstall()


@pytest.mark.parametrize("case", list(CASES))
def test_upstream_packed_layout_gathers_bytes_no_rank_cast(megatron_layout, case):
    shapes, dp = CASES[case]
    assert stale_packed_bytes(megatron_layout(shapes, dp, upstream=True)) > 0


@pytest.mark.parametrize("case", list(CASES))
def test_our_packed_layout_is_element_layout_halved_and_never_stale(megatron_layout, case):
    shapes, dp = CASES[case]
    buf = megatron_layout(shapes, dp, upstream=False)
    assert stale_packed_bytes(buf) == 0
    for p, (s, e, b) in buf.param_index_map.items():
        assert buf.nvfp4_packed_param_index_map[p] == (s // 2, e // 2, b)
    assert buf.nvfp4_packed_bucket_indices == [(s // 2, e // 2) for s, e in buf.bucket_indices]
    for s, e in buf.bucket_indices:  # every rank's element shard is even, so byte shards are exact halves
        assert (e - s) % (2 * dp) == 0


def test_our_layout_stays_exact_with_many_small_buckets(megatron_layout):
    buf = megatron_layout(GQA_LAYER * 3, 3, upstream=False, bucket_size=3000)
    assert len(buf.bucket_indices) > 2 and stale_packed_bytes(buf) == 0


def test_bucket_end_padding_keeps_rank_shards_even_when_dp_is_a_multiple_of_128():
    do = importlib.import_module(adapter._DO)
    upstream = do.pad_bucket_end if not adapter.is_installed() else None
    assert upstream is not None
    ours = buffers.make_pad_bucket_end(upstream)
    for dp in (3, 6, 64, 128, 384):
        for end in (1, 130, 4096 + 7, 10**6 + 3):
            assert ours(end, dp, False) % (2 * dp) == 0
            if dp % 128:  # identical to upstream wherever upstream is already right
                assert ours(end, dp, False) == upstream(end, dp, False)
    assert (upstream(100, 128, False) // 128) % 2 == 1  # upstream: a 1-element (odd) shard at dp=128


def test_a_non_nvfp4_param_in_the_packed_buffer_is_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.bfloat16))
    q = torch.nn.Parameter(fp4_dist.quantize(torch.randn(64, 64)))
    with pytest.raises(TypeError, match="fp8_w"):
        adapter.derive_packed_layout({q: (0, 4096, 0), p: (4096, 8192, 0)}, [(0, 8192)],
                                     {q: "nvfp4_w", p: "fp8_w"}, 2)
