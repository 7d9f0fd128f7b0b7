"""A small transformer with NVFP4 linear weights under torch.compile (run as a script by test_compile.py, so that
torch's logs and warnings land in the test's captured output): prints the compiled/eager comparison."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

import fp4_dist


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        q, k, v = self.qkv(self.n1(x)).chunk(3, -1)
        x = x + self.proj(q * torch.sigmoid(k) + v)
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


def main() -> None:
    backend, blocks = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    # a stack of blocks, then a tail of linears of every other shape (one frame resumes with each)
    net = nn.Sequential(*[Block(32) for _ in range(blocks)], nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48),
                        nn.ReLU(), nn.Linear(48, 80), nn.ReLU(), nn.Linear(80, 16)).to(torch.bfloat16)  # fmt: skip
    fp4_dist.convert_linear_weights(net)
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    for _ in range(3):
        net.zero_grad()
        y = compiled(x)
        y.float().sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    ref = net(x)
    ref.float().sum().backward()
    same_out = torch.equal(y, ref)
    same_grads = all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))
    print(f"COMPILED_EQUALS_EAGER output {same_out} gradients {same_grads}")


if __name__ == "__main__":
    main()
