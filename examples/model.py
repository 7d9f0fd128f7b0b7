"""A small decoder-only language model for the examples and the end-to-end parity tests.

Pre-norm transformer blocks (causal self-attention + GELU MLP) in plain PyTorch. Every nn.Linear has
``in_features % 16 == 0`` so `fp4_dist.convert_linear_weights` turns all of them into NVFP4 weights; the
embeddings and norms stay dense. Shapes are deliberately awkward for NVFP4 (vocab not a multiple of 16,
``dim % 64 != 0`` by default), which is what the parity tests want.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TinyLMConfig:
    vocab: int = 40
    """Vocabulary size (rows of the output head)."""
    dim: int = 48
    """Model width; a multiple of 16 (NVFP4 K) and of ``heads``."""
    hidden: int = 80
    """MLP width; a multiple of 16."""
    heads: int = 2
    layers: int = 2
    seq: int = 16
    """Context length (learned positional embeddings)."""

    def __post_init__(self):
        if self.dim % 16 or self.hidden % 16 or self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) and hidden ({self.hidden}) must be multiples of 16 and dim of "
                             f"heads ({self.heads}) so every linear layer can be NVFP4")


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [B, T<=seq] -> logits [B, T, vocab] (model dtype)."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy (fp32) of int64 [B, T+1] token windows."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(cfg: TinyLMConfig, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """(model in ``dtype`` on ``device``, fp32 initial values by parameter name) from a seed.

    The fp32 values are the masters' starting point (the model's own bf16 values are their rounding).
    """
    torch.manual_seed(seed)
    model = TinyLM(cfg)
    init = {name: p.detach().clone() for name, p in model.named_parameters()}
    return model.to(device=device, dtype=dtype), {k: v.to(device) for k, v in init.items()}
