"""A small decoder-only transformer (GPT-2's shape) for the language-model workload.

Pre-norm blocks, causal ``scaled_dot_product_attention`` (PyTorch picks the fused kernel
the device has), a GELU MLP four times the width, learned positions, and the output
head tied to the token embedding: the tied weight is one parameter, so the flat buffer
(``models.flatten_``), the signatures and every merge see it once. Initialised as GPT-2:
normal(0, 0.02), the residual projections scaled by 1/sqrt(2 x layers).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, embed: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1 = nn.LayerNorm(embed)
        self.qkv = nn.Linear(embed, 3 * embed)
        self.proj = nn.Linear(embed, embed)
        self.norm2 = nn.LayerNorm(embed)
        self.up = nn.Linear(embed, 4 * embed)
        self.down = nn.Linear(4 * embed, embed)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm1(h)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        h = h + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return h + self.drop(self.down(F.gelu(self.up(self.norm2(h)))))


class GPT(nn.Module):
    """Token ids (batch, time) to next-token logits (batch, time, vocab)."""

    def __init__(self, vocab: int, context: int, *, layers: int = 4, heads: int = 4, embed: int = 128,
                 dropout: float = 0.0):
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, embed)
        self.positions = nn.Embedding(context, embed)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(embed, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(embed)
        self.head = nn.Linear(embed, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: one parameter
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"a window of {t} tokens exceeds the model's context of {self.context}")
        pos = torch.arange(t, device=idx.device)
        h = self.drop(self.tokens(idx.long()) + self.positions(pos))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))
