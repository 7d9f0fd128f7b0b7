"""bench/traffic.py's counting of torch.distributed calls: what it wraps it puts back, and its rows' names."""

from __future__ import annotations

import sys
import types

import torch.distributed as dist

from bench import traffic


def test_counting_puts_back_every_wrapper_it_handed_out_even_to_modules_imported_meanwhile():
    alias = types.ModuleType("fp4_dist_test_alias")
    alias.all_reduce = dist.all_reduce  # bound at import, as Megatron binds its gather function
    sys.modules[alias.__name__] = alias
    originals = {n: getattr(dist, n) for n in traffic.NAMES if hasattr(dist, n)}
    try:
        with traffic.counted():
            assert alias.all_reduce is not originals["all_reduce"] and alias.all_reduce.__name__ == "all_reduce"
            lazy = types.ModuleType("fp4_dist_test_lazy")
            lazy.all_gather = dist.all_gather  # a module imported while counting binds the wrapper
            sys.modules[lazy.__name__] = lazy
        assert alias.all_reduce is originals["all_reduce"] and lazy.all_gather is originals["all_gather"]
        assert all(getattr(dist, n) is fn for n, fn in originals.items())
    finally:
        sys.modules.pop("fp4_dist_test_alias", None)
        sys.modules.pop("fp4_dist_test_lazy", None)


def test_a_premul_sum_made_per_call_shares_one_row():
    premul = dist._make_nccl_premul_sum(0.5)
    assert traffic._op_name(premul) == traffic._op_name(dist._make_nccl_premul_sum(2.0)) == "PREMUL_SUM"
    assert (traffic._op_name(dist.ReduceOp.MAX), traffic._op_name(dist.ReduceOp.SUM)) == ("MAX", "SUM")
