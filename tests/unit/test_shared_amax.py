"""Shared-amax groups (fp4_dist.shared_amax): one amax, the group's largest, in every cast of the package.

Each cast is checked against `quantize(master, amax=group max)`, the whole-tensor quantize with the shared amax,
on random weights of several shapes (M not a multiple of 16, K % 64 != 0), with poisoned outputs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fp4_dist
from fp4_dist.export import VLLM_FUSED
from fp4_dist.optim import Zero1Optimizer
from fp4_dist.cast import cast_master_weights_to_nvfp4
from fp4_dist.shared_amax import AmaxGroup, group_of
from fp4_dist.tensor import NVFP4Tensor
from fp4_dist.testing import assert_bytes_equal, poison_, random_weight

FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax")


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(48, 48), nn.Linear(48, 16), nn.Linear(48, 16)
        self.o_proj = nn.Linear(48, 48)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(48, 80), nn.Linear(48, 80), nn.Linear(80, 48)

    def forward(self, x):
        a = self.attn
        h = self.attn.o_proj(a.q_proj(x) * torch.cat([a.k_proj(x), a.v_proj(x), a.k_proj(x)], -1))
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def block(seed=0):
    torch.manual_seed(seed)
    net = Block().to(torch.bfloat16)
    with torch.no_grad():  # different magnitudes, so the shared amax differs from most members' own
        for i, m in enumerate([net.attn.q_proj, net.attn.k_proj, net.attn.v_proj, net.gate_proj, net.up_proj]):
            m.weight.mul_(0.5 + i)
    return net


def own_amax(t):
    return t.detach().to(torch.bfloat16).abs().max().float().reshape(1)


def test_convert_gives_each_sibling_group_its_largest_amax():
    net = block()
    plain = {n: p.detach().clone() for n, p in net.named_parameters()}
    report = fp4_dist.convert_linear_weights(net, shared_amax=VLLM_FUSED)
    qkv = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight")
    assert set(report.shared_amax) == set(qkv) | {"gate_proj.weight", "up_proj.weight"}
    assert group_of(net.attn.q_proj.weight) == AmaxGroup(qkv)
    assert group_of(net.attn.o_proj.weight) is None
    for members in (qkv, ("gate_proj.weight", "up_proj.weight")):
        shared = torch.stack([own_amax(plain[m]) for m in members]).max().reshape(1)
        for m in members:
            w = net.get_parameter(m)
            ref = fp4_dist.quantize(plain[m], amax=shared)
            assert float(w.amax) == float(shared)
            for f in FIELDS:
                assert_bytes_equal(getattr(w, f), getattr(ref, f), f"{m} {f}")
    assert float(net.down_proj.weight.amax) == float(own_amax(plain["down_proj.weight"]))
    assert "one amax: attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight" in str(report)


def test_the_te_signature_cast_keeps_the_group_amax():
    shapes = [(40, 48), (24, 48), (17, 48), (33, 80)]  # three in a group, M % 16 != 0, K % 64 != 0
    g = torch.Generator().manual_seed(0)
    masters = [random_weight(m, k, generator=g) * (i + 1) for i, (m, k) in enumerate(shapes)]
    ws = [NVFP4Tensor.empty(s) for s in shapes]
    group = AmaxGroup(("a.weight", "b.weight", "c.weight"))
    for w in ws[:3]:
        w.fp4_dist_amax_group = group
    for w in ws:
        for f in FIELDS:
            poison_(getattr(w, f))
    cast_master_weights_to_nvfp4(ws, [m.reshape(-1) for m in masters], [0] * 4)
    shared = torch.stack([own_amax(m) for m in masters[:3]]).max().reshape(1)
    for i, (w, m) in enumerate(zip(ws, masters)):
        ref = fp4_dist.quantize(m, amax=shared if i < 3 else None)
        for f in FIELDS:
            assert_bytes_equal(getattr(w, f), getattr(ref, f), f"weight {i} {f}")


def test_a_cast_of_part_of_a_group_is_refused():
    ws = [NVFP4Tensor.empty((32, 32)) for _ in range(2)]
    group = AmaxGroup(("a.weight", "b.weight", "c.weight"))
    for w in ws:
        w.fp4_dist_amax_group = group
    with pytest.raises(ValueError, match=r"share one amax, but this cast was given 2 of the 3"):
        cast_master_weights_to_nvfp4(ws, [torch.randn(1024), torch.randn(1024)], [0, 0])


def test_zero1_keeps_the_group_amax_every_step():
    net = block(1)
    fp4_dist.convert_linear_weights(net, shared_amax=VLLM_FUSED)
    opt = Zero1Optimizer(net.named_parameters(), lambda groups: torch.optim.AdamW(groups, lr=0.05))
    names = [n for n, _ in net.named_parameters()]
    qkv = [names.index(f"attn.{p}_proj.weight") for p in "qkv"]
    x = torch.randn(8, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for _ in range(3):
        net(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        masters = opt.full_masters()
        shared = torch.stack([own_amax(masters[i]) for i in qkv]).max().reshape(1)
        for i in qkv:
            w = net.get_parameter(names[i])
            ref = fp4_dist.quantize(masters[i].reshape(w.shape), amax=shared)
            for f in FIELDS:
                assert_bytes_equal(getattr(w, f), getattr(ref, f), f"{names[i]} {f}")


def test_quantize_into_a_group_member_keeps_the_group_amax_or_refuses():
    net = block(2)
    fp4_dist.convert_linear_weights(net, shared_amax=VLLM_FUSED)
    w = net.attn.k_proj.weight
    amax = float(w.amax)
    with torch.no_grad():
        w.copy_(torch.full(w.shape, amax / 4, dtype=torch.bfloat16))
    assert float(w.amax) == amax  # the group's, not the new values' own
    with pytest.raises(ValueError, match="shares one amax with attn.q_proj.weight"):
        w.quantize_(torch.full(w.shape, amax * 2))
