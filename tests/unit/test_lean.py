"""Lean compute (fp4_dist.lean): NVFP4Linear layers whose weights keep no copy (compute_copy=False) compute with
a copy made around each use, and give bitwise the losses, gradients and masters of the default mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp4_dist
from fp4_dist.lean import live_copies
from fp4_dist.optim import Zero1Optimizer


class Block(nn.Module):
    def __init__(self, d=48, h=80):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d, bias=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, layers=3, recompute=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(48, 64)
        self.recompute = recompute

    def forward(self, x):
        for b in self.blocks:
            recompute = self.recompute and torch.is_grad_enabled()
            x = checkpoint(b, x, use_reentrant=self.recompute == "reentrant") if recompute else b(x)
        return self.head(x)


def build(lean: bool, recompute=None, device="cpu"):
    torch.manual_seed(0)
    net = Net(recompute=recompute).to(device, torch.bfloat16)
    fp4_dist.convert_linear_weights(net, compute_copy=not lean)
    return net


def batch(step, micro, device="cpu"):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(2, 12, 48, generator=g).to(device, torch.bfloat16)


def train(lean: bool, steps=3, micro=2, recompute=None, device="cpu"):
    net = build(lean, recompute, device)
    opt = Zero1Optimizer(net.named_parameters(), lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    losses = []
    for step in range(steps):
        for m in range(micro):  # gradient accumulation
            x = batch(step, m, device).requires_grad_(recompute == "reentrant")
            loss = net(x).float().square().mean()
            if lean:
                assert live_copies() == 0, "a lean copy outlived its forward"
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        losses.append(net(batch(99, 0, device)).float().square().mean().item())
    return losses, [t.clone() for t in opt.full_masters()]


@pytest.mark.parametrize("recompute", [None, "non-reentrant", "reentrant"])
def test_lean_losses_and_masters_equal_the_default_mode_bitwise(recompute):
    default_losses, default_masters = train(lean=False, recompute=recompute)
    lean_losses, lean_masters = train(lean=True, recompute=recompute)
    assert lean_losses == default_losses
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(lean_masters, default_masters))
    assert live_copies() == 0


@pytest.mark.gpu
def test_lean_equals_the_default_mode_bitwise_on_cuda():
    default_losses, default_masters = train(lean=False, device="cuda")
    lean_losses, lean_masters = train(lean=True, device="cuda")
    assert lean_losses == default_losses
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(lean_masters, default_masters))


def test_no_copy_is_alive_between_forward_and_backward_and_one_per_backward_use():
    net = build(lean=True)
    assert all(p.copy_state.value is None for p in net.parameters() if fp4_dist.is_nvfp4_tensor(p))
    seen = []

    def count(module, grad_input, grad_output):
        seen.append(live_copies())

    linears = [m for m in net.modules() if isinstance(m, fp4_dist.NVFP4Linear)]
    hooks = [m.register_full_backward_hook(count) for m in linears]
    out = net(batch(0, 0))
    assert live_copies() == 0
    out.float().sum().backward()
    for h in hooks:
        h.remove()
    assert live_copies() == 0 and len(seen) == len(linears) and max(seen) <= 1
    assert all(p.grad is not None and type(p.grad) is torch.Tensor for p in net.parameters() if p.requires_grad)


def test_a_weight_changed_between_forward_and_backward_makes_the_backward_raise():
    net = build(lean=True)
    out = net(batch(0, 0))
    w = net.blocks[1].up.weight
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: the NVFP4 weight blocks.1.up.weight"):
        out.float().sum().backward()
