"""The reference models every chapter trains, deterministic from a seed, sized for seconds on a CPU.

* :class:`MLP` — a stack of Linear+GeLU layers (the smallest thing with more than one layer).
* :class:`TinyGPT` — token and position embeddings, pre-LayerNorm blocks with causal multi-head
  attention and a GeLU MLP, dropout that can be turned on, an LM head with optional weight tying
  (Radford et al. 2019, GPT-2; the layout of nanoGPT and picotron).

Parallel strategies cut their shards from these modules' weights, so a parallel run starts from exactly
the single-device model and the two can be compared parameter by parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .loop import lm_loss

__all__ = ["MLP", "GPTConfig", "TinyGPT", "Block", "CausalSelfAttention", "FeedForward"]


class MLP(nn.Module):
    """``sizes = [d0, d1, ..., dk]``: k Linear layers with GeLU between them (none after the last)."""

    def __init__(self, sizes=(16, 64, 64, 8), seed: int = 0, bias: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global RNG
            self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:]))
        for layer in self.layers:  # deterministic init that does not touch the global RNG
            bound = 1 / math.sqrt(layer.in_features)
            with torch.no_grad():
                layer.weight.uniform_(-bound, bound, generator=g)
                if layer.bias is not None:
                    layer.bias.uniform_(-bound, bound, generator=g)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32      # maximum sequence length
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    ffn_mult: int = 4         # FFN hidden size = ffn_mult * n_embd
    dropout: float = 0.0
    tie_weights: bool = False
    bias: bool = True

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_mult * self.n_embd

    def with_(self, **changes) -> "GPTConfig":
        return replace(self, **changes)


class CausalSelfAttention(nn.Module):
    """softmax(Q Kᵀ / √d_head + causal mask) V over ``n_head`` heads; QKV in one Linear, then a projection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def attention(self, q, k, v):
        """The attention core on (batch, heads, seq, d_head) tensors."""
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        t = q.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        att = F.dropout(att, self.dropout, self.training)
        return att @ v

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = self.attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class FeedForward(nn.Module):
    """Linear(h → ffn) · GeLU · Linear(ffn → h) · Dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = FeedForward(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-2-shaped language model. ``forward(idx)`` returns logits (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0):
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):  # the layers' own init draws from the global RNG
            self._build(cfg)
        self._init_weights(seed)

    def _build(self, cfg: GPTConfig) -> None:
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self, seed: int) -> None:
        """GPT-2's init (normal, std 0.02; residual projections scaled by 1/√(2·n_layer)), from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 1:  # LayerNorm weight
                    p.fill_(1.0)
                else:
                    std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                    p.normal_(0.0, std, generator=g)

    def embed(self, idx):
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx, targets):
        logits = self(idx)
        return lm_loss(logits, targets)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
