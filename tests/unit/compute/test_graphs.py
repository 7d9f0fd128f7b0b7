"""A training step captured in a CUDA graph reads, at each replay, the copies of that replay's weights, in every compute
mode: the lean pool's buffers (written inside the graph, whatever the host last knew of them), kept bf16 copies and
FP8 copies (remade in place by the post-all-gather processing, outside the graph).

The weights change between replays as a training step changes them: new bytes written in place, then
`post_all_gather_processing`. Each replay's output and weight gradients must equal, bit for bit, those of the same
step run eagerly on the same weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4_dist

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")]

MODES = {"lean": dict(), "kept": dict(compute_copy=True), "fp8": dict(compute="fp8")}


def _model(**convert) -> nn.Module:
    torch.manual_seed(0)
    # Three layers of one shape share one lean pool buffer: a replayed use that skipped its write would read
    # another layer's weight.
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(3)], nn.Linear(256, 384, bias=False))
    model = model.cuda().bfloat16()
    fp4_dist.convert_linear_weights(model, **convert)
    return model


def _step(model, x):
    y = model(x)
    loss = y.float().square().sum()
    return y, loss


@pytest.mark.parametrize("mode", list(MODES))
def test_each_replay_reads_the_copies_of_its_own_weights(mode):
    model = _model(**MODES[mode])
    weights = [m.weight for m in model]
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up steps, as Megatron runs before it captures
        for _ in range(2):
            y, loss = _step(model, x)
            loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    for w in weights:
        w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static, loss = _step(model, x)
        loss.backward()
    grads_static = [w.grad for w in weights]

    for step in range(3):
        with torch.no_grad():  # the step's new bytes, then the processing that follows their all-gather
            for w in weights:
                w.copy_(torch.randn(w.shape, device="cuda") * (1 + step))
        fp4_dist.post_all_gather_processing(weights)
        graph.replay()
        y_eager, loss_eager = _step(model, x)
        grads_eager = torch.autograd.grad(loss_eager, weights)
        assert torch.equal(y_static, y_eager), (mode, step)
        for i, (got, want) in enumerate(zip(grads_static, grads_eager)):
            assert torch.equal(got, want), (mode, step, i)
