"""Megatron's parallel linears in the FP8 compute mode (``python -m fp4_dist.megatron.run --compute fp8``), on gloo
CPU ranks where the FP8 GEMMs are emulated: ``megatron.training.pretrain()`` (`examples/pretrain_gpt.py`) trains in
data-parallel and tensor-parallel layouts (the all-reduce of the input gradient around the FP8 GEMMs), its gathered
NVFP4 bytes checked against quantize(full fp32 master) after every iteration, its losses within `LOSS_RTOL` of the
bf16 run's. The sequence-parallel communication (all-gather of the input, reduce-scatter of its gradient) is checked
on `Fp8Linear` itself on 2 ranks against the same GEMMs on the whole sequence."""

from __future__ import annotations

import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

from .test_megatron_parallel import MOE, TP, _bf16_ranks  # noqa: E402
from . import forked_ranks  # noqa: E402
from .test_launch import _env  # noqa: E402
from .test_megatron_run import assert_fp4_run, data, launch, train  # noqa: E402,F401 (data: fixture)

pytestmark = [pytest.mark.distributed, pytest.mark.megatron, pytest.mark.slow]

COMMON = ("--train-iters", "3", "--eval-interval", "1000", "--hidden-dropout", "0", "--attention-dropout", "0")
FP8 = ("--compute", "fp8")

# Sequence parallelism needs TransformerEngine's or Apex's norms in Megatron (torch's LayerNorm refuses it), which
# CPU ranks lack: its path is checked below on the linear function itself.
# MoE experts (expert parallel, all-to-all dispatch): their MLP adds its bias to the linear's output in place, and
# an expert may get no tokens. {layout: (its flags, the NVFP4 weights rank 0 holds)}
LAYOUTS = {"dp2": ((), 8), "tp2": (TP, 8), "moe-ep2": ((*MOE, "--moe-token-dispatcher-type", "alltoall"), 12)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_fp8_mode_trains_like_bf16_with_bytes_checked_every_step(tmp_path, data, layout):
    flags, weights = LAYOUTS[layout]
    args = ("--data-path", data, *COMMON, *flags)
    fp8 = train(tmp_path, "fp8", 2, *args, runner=FP8)
    bf16 = train(tmp_path, "bf16", _bf16_ranks(args), *args, fp4=False)
    assert_fp4_run(fp8, bf16, weights)
    assert "GEMMs in fp8" in fp8["stdout"]
    if layout == "dp2":  # and it is not the bf16 compute mode: the same bytes, other GEMMs
        default = train(tmp_path, "fp4", 2, *args)
        assert "GEMMs in bf16" in default["stdout"]
        assert [it["loss"] for it in fp8["iterations"]] != [it["loss"] for it in default["iterations"]]


def test_the_fp8_mode_refuses_a_kept_bf16_copy_on_every_rank(tmp_path, data):
    proc = launch(2, ["--data-path", data, *COMMON, "--fp4-param-gather"], runner=(*FP8, "--compute-copy"),
                  check=False, refused=True)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "never a bf16 compute copy" in log, log[-3000:]


SEQUENCE_PARALLEL = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch import nn
    import fp4_dist
    from fp4_dist.compute.fp8_gemm import Fp8Operand, emulated_mm
    from fp4_dist.compute.fp8_autograd import Fp8Linear

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    torch.manual_seed(0)  # the whole sequence and gradient, the same on both ranks; each rank its column slice
    x = torch.randn(6, 3, 272, dtype=torch.bfloat16)
    dy = torch.randn(6, 3, 2, 96, dtype=torch.bfloat16)
    lins = [nn.Linear(272, 96, bias=False).to(torch.bfloat16) for _ in range(2)]
    for lin in lins:
        fp4_dist.convert_linear_weights(lin)
    w = lins[rank].weight
    op = Fp8Operand.weight(w)
    mine = x[3 * rank:3 * rank + 3].clone().requires_grad_()
    y = Fp8Linear.apply(mine, w, None, op, False, True, group)
    y.backward(dy[:, :, rank])
    x2, dy2 = x.reshape(-1, 272), dy[:, :, rank].reshape(-1, 96)
    assert torch.equal(y.reshape(-1, 96), emulated_mm(Fp8Operand.rows(x2), op).to(torch.bfloat16))
    parts = [emulated_mm(Fp8Operand.rows(dy[:, :, r].reshape(-1, 96)), Fp8Operand.weight(lins[r].weight).t())
             .to(torch.bfloat16) for r in range(2)]
    dx = (parts[0] + parts[1]).view(6, 3, 272)[3 * rank:3 * rank + 3]
    assert torch.equal(mine.grad, dx)
    dw = emulated_mm(Fp8Operand.rows(dy2.t()), Fp8Operand.rows(x2.t())).to(torch.bfloat16)
    assert torch.equal(w.grad, dw)
    print("rank", rank, "sequence parallel ok")
    dist.destroy_process_group()
""")


def test_the_sequence_parallel_fp8_linear_equals_the_gemms_on_the_whole_sequence(tmp_path):
    script = tmp_path / "sequence_parallel.py"
    script.write_text(SEQUENCE_PARALLEL)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = forked_ranks.run(cmd, env=_env(), timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("sequence parallel ok") == 2


def test_the_fp8_mode_without_nvfp4_weights_is_refused_on_every_rank(tmp_path, data):
    proc = launch(2, ["--data-path", data, *COMMON], runner=FP8, check=False, refused=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert log.count("without --fp4-param-gather: the fp8 compute mode computes with NVFP4 weights") == 2, log[-3000:]
