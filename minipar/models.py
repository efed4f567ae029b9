"""The reference models every chapter trains, deterministic from a seed, sized for seconds on a CPU.

* :class:`MLP` — a stack of Linear+GeLU layers (the smallest thing with more than one layer).
* :class:`TinyGPT` — token and position embeddings, pre-LayerNorm blocks with causal multi-head
  attention and a GeLU MLP, dropout that can be turned on, an LM head with optional weight tying
  (Radford et al. 2019, GPT-2; the layout of nanoGPT and picotron).

Parallel strategies cut their shards from these modules' weights, so a parallel run starts from exactly
the single-device model and the two can be compared parameter by parameter. They plug into two seams
instead of copying the model's code:

* **embeddings + positions** — :class:`TokenPositionEmbedding`'s ``embed(idx, positions)``: ``x = Dropout(
  E_tok[idx] + E_pos[positions])``. A strategy passes (or computes, in ``positions_held``) the *global*
  positions of the tokens its rank holds: a TP+SP rank its s/t shard, a CP rank s/N tokens (zig-zag: two
  chunks), a pipeline's first stage the whole sequence. TP swaps ``tok_emb`` for a vocabulary-parallel one.
* **attention core** — :func:`causal_attention` (q, k, v → context on (batch, heads, seq, d_head)), called by
  :meth:`CausalSelfAttention.attention`. A context-parallel method replaces it (:func:`set_attention_core`)
  while the QKV and output projections, the head split and TP's sharding of them stay as they are.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import canonical
from .invariant_mode import active as invariant_active
from .loop import lm_loss

__all__ = ["MLP", "GPTConfig", "TinyGPT", "Block", "CausalSelfAttention", "FeedForward", "TokenPositionEmbedding",
           "token_positions", "causal_attention", "split_heads", "merge_heads", "set_attention_core",
           "attention_core"]


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


def token_positions(seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """0, 1, …, seq_len − 1: the positions of a whole sequence; ValueError past the position table."""
    if seq_len > block_size:
        raise ValueError(f"sequence length {seq_len} exceeds block_size {block_size}")
    return torch.arange(seq_len, device=device)


class TokenPositionEmbedding:
    """The embedding seam (a mixin): ``embed(idx, positions) = drop(tok_emb(idx) + pos_emb(positions))``.

    The class using it has ``cfg``, ``tok_emb`` (an ``nn.Embedding`` or TP's vocabulary-parallel one),
    ``pos_emb`` and ``drop``; its parameter names stay its own (``tok_emb.weight``, ``pos_emb.weight``).
    ``positions`` are the global positions of the rows ``tok_emb(idx)`` returns; left out, they are
    :meth:`positions_held` (the whole sequence here; a sequence-parallel rank overrides it with its shard's).
    """

    def positions_held(self, idx: torch.Tensor) -> torch.Tensor:
        return token_positions(idx.shape[1], self.cfg.block_size, idx.device)

    def sequence_split_group(self):
        """The group whose ranks hold chunks of each row's positions here (None: every position is here)."""
        return None

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        positions = self.positions_held(idx) if positions is None else positions
        if invariant_active():     # the position table's gradient: a tree over the rows (and the SP ranks)
            held = positions.expand(idx.shape[0], -1)
            pos = canonical.embedding(held, self.pos_emb.weight, self.sequence_split_group())
            return self.drop(self.tok_emb(idx) + pos)
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))


def causal_attention(q, k, v, dropout=None):
    """The attention core, ``softmax(Q Kᵀ / √d_head + M) V`` with M the causal mask (0 on and below the
    diagonal, −∞ above), on (batch, heads, seq, d_head) tensors holding whole sequences (Vaswani et al. 2017).
    ``dropout``, if given, acts on the attention probabilities. In the invariant mode:
    :func:`minipar.canonical.causal_attention`."""
    if invariant_active():
        return canonical.causal_attention(q, k, v, dropout)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    t = q.shape[-2]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (att if dropout is None else dropout(att)) @ v


def split_heads(qkv: torch.Tensor, n_head: int) -> tuple:
    """(b, s, 3·w) fused QKV output → q, k, v each (b, n_head, s, w / n_head)."""
    b, t, width = qkv.shape
    return tuple(z.view(b, t, n_head, width // 3 // n_head).transpose(1, 2) for z in qkv.split(width // 3, -1))


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(b, heads, s, d) → (b, s, heads · d): the heads side by side again."""
    b, heads, t, d = y.shape
    return y.transpose(1, 2).reshape(b, t, heads * d)


class CausalSelfAttention(nn.Module):
    """softmax(Q Kᵀ / √d_head + causal mask) V over ``n_head`` heads; QKV in one Linear, then a projection.

    ``core``: None for :func:`causal_attention`, or a (q, k, v) → context function a strategy puts in its
    place (a context-parallel method). TP subclasses this module with sharded ``qkv``/``proj`` (its local
    heads in ``n_head``) and its own dropouts; ``forward`` is the same for all of them."""

    core = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def attention_dropout(self, att):
        return F.dropout(att, self.dropout, self.training)

    def attention(self, q, k, v):
        """The attention core on (batch, heads, seq, d_head) tensors: ``core`` if set, else causal."""
        if self.core is not None:
            return self.core(q, k, v)
        return causal_attention(q, k, v, self.attention_dropout)

    def forward(self, x):
        q, k, v = split_heads(self.qkv(x), self.n_head)
        return self.resid_drop(self.proj(merge_heads(self.attention(q, k, v))))


def set_attention_core(model: nn.Module, core) -> nn.Module:
    """Make every attention layer in ``model`` (or ``model`` itself) use ``core`` (q, k, v) → context;
    ``None`` restores :func:`causal_attention`. Parameters and their names are untouched. Returns ``model``."""
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            m.__dict__.pop("core", None)
            if core is not None:
                m.core = core
    return model


@contextmanager
def attention_core(model: nn.Module, core):
    """``with attention_core(model, core):`` — :func:`set_attention_core` for the block, then the causal core
    again."""
    set_attention_core(model, core)
    try:
        yield model
    finally:
        set_attention_core(model, None)


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


class TinyGPT(TokenPositionEmbedding, nn.Module):
    """A GPT-2-shaped language model. ``forward(idx, positions=None)`` returns logits (batch, seq, vocab):
    ``positions`` are the global positions of the tokens ``idx`` (default: 0 … seq − 1)."""

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

    def forward(self, idx, positions=None):
        x = self.embed(idx, positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx, targets):
        logits = self(idx)
        return lm_loss(logits, targets)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
