"""Context parallelism: the tiny GPT trained with its sequence split across N ranks, every layer included.

Each rank holds the whole model (replicated, like data parallelism) and, of every sample in the batch, only
its tokens: contiguous s/N (``ring``, ``rsa``, ``ulysses``) or the zig-zag pair of chunks
(``ring-zigzag``). Everything but attention acts token by token — embeddings (at the tokens' *global*
positions), LayerNorm, the projections, the MLP, the LM head and the loss — so it runs on the shard as is;
attention is the only place tokens meet, and its core (q, k, v → context) is replaced by one of
(:func:`minipar.models.set_attention_core`; the projections and everything else stay the reference's):

=============  =====================================================  ==============================
method         attention                                              refused when
=============  =====================================================  ==============================
ring           :func:`.ring_attention.ring_attention` (LSE merge)    s not divisible by N
ring-zigzag    the same, zig-zag chunks (load balanced)              s not divisible by 2N
ulysses        :func:`.ulysses.ulysses_attention` (all-to-all)       n_head not divisible by N
rsa            :func:`.ring_self_attention.ring_self_attention`      s not divisible by N
=============  =====================================================  ==============================

The loss: rank r adds its tokens' cross-entropies and divides by the *global* token count b·s, so the
ranks' losses sum to the single-device mean, and the parameter gradients **sum** over ranks (one
all-reduce per step) to the single-device gradient — the same 1/N as an average of per-rank means
(see :mod:`.ring_self_attention` for why it must be applied once).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import comm
from ..recipe import Recipe, RunResult
from ..launcher import launch
from ..loop import lm_loss
from ..models import attention_core, set_attention_core
from ..validation import positive_int
from ..tensor.sequence import sync_sequence_parallel_grads
from . import ring_attention, ring_self_attention, ulysses

__all__ = ["METHODS", "check_split", "validate", "local_positions", "attention_for", "parallel_train", "run"]

METHODS = ("ring", "ring-zigzag", "ulysses", "rsa")


def check_split(method: str, *, seq_len: int, n_head: int, cp: int, dropout: float = 0.0, tp: int = 1) -> None:
    """ValueError naming the reason if ``method`` cannot split a sequence of ``seq_len`` tokens over ``cp``
    ranks — the one rule, for chapter 06b's runs and for the hybrid trainer's cp groups alike: a known method;
    no dropout (the shards would draw other masks than one device); Ulysses needs whole heads per rank (of the
    ``n_head / tp`` heads a tensor-parallel shard holds); ring methods need equal chunks (zig-zag: 2·cp)."""
    if method not in METHODS:
        raise ValueError(f"unknown context-parallel method {method!r}; choose one of {', '.join(METHODS)}")
    if cp == 1:
        return
    if dropout:
        raise ValueError(f"dropout = {dropout} with cp = {cp}: the sequence shards would draw different masks "
                         f"than one device; use dropout = 0 to compare with single-device training")
    if method == "ulysses" and tp > 1 and (n_head // tp) % cp:
        raise ValueError(f"Ulysses gives each cp rank whole heads of its tensor-parallel shard, but "
                         f"n_head / tp = {n_head} / {tp} = {n_head // tp} heads are not divisible by "
                         f"cp = {cp}: n_head must be divisible by cp · tp = {cp * tp} (or use ring attention)")
    if method == "ulysses":
        ulysses.validate_heads(n_head, cp)
    ring_attention.validate_sequence(seq_len, cp, zigzag=method == "ring-zigzag")


def validate(recipe: Recipe, *, world_size: int, method: str = "ring") -> None:
    """ValueError, before any process starts, if ``recipe`` cannot run with ``method`` on ``world_size``."""
    if method not in METHODS:
        raise ValueError(f"unknown context-parallel method {method!r}; choose one of {', '.join(METHODS)}")
    positive_int("world_size", world_size)
    cfg = recipe.model().cfg
    inputs, targets = recipe.batches[0]
    if targets.dtype != torch.long or inputs.dim() != 2:
        raise ValueError("context parallelism here trains a language model: (batch, seq) token ids and targets")
    check_split(method, seq_len=inputs.shape[1], n_head=cfg.n_head, cp=world_size, dropout=cfg.dropout)


def local_positions(seq_len: int, rank: int, world_size: int, method: str) -> torch.Tensor:
    """The global positions of the tokens this rank holds."""
    return ring_attention.positions(seq_len, rank, world_size, zigzag=method == "ring-zigzag")


def attention_for(method: str, group):
    """The attention core (b, heads, s_local, d)³ → (b, heads, s_local, d) for ``method``."""
    if method in ("ring", "ring-zigzag"):
        return functools.partial(ring_attention.ring_attention, group=group, zigzag=method == "ring-zigzag")
    if method == "ulysses":
        return functools.partial(ulysses.ulysses_attention, group=group)
    return functools.partial(ring_self_attention.ring_self_attention, group=group)


def attention_layer(attn, x, attend):
    """The reference model's attention module on a shard: its own weights, ``attend`` as the core."""
    with attention_core(attn, attend):
        return attn(x)


def parallel_train(rank: int, world_size: int, recipe: Recipe, *, method: str = "ring") -> RunResult:
    """Train ``recipe`` with the sequence split over the ranks; return the losses and (replicated) params."""
    group = dist.new_group(list(range(world_size)))
    model = recipe.model().to(recipe.dtype)
    params = list(model.parameters())
    opt = recipe.optimizer(params)
    set_attention_core(model, attention_for(method, group))
    losses = []
    for inputs, targets in recipe.batches:
        pos = local_positions(inputs.shape[1], rank, world_size, method)
        opt.zero_grad(set_to_none=False)
        logits = model(inputs[:, pos], pos)                  # embeddings at my tokens' global positions
        mine = targets[:, pos]
        share = lm_loss(logits, mine) * (mine.numel() / targets.numel())   # Σ over my tokens / ALL tokens
        share.backward()
        sync_sequence_parallel_grads(params, group)                                # Σ_r = the single-device gradient
        opt.step()
        total = share.detach().reshape(1).clone()
        comm.all_reduce(total, group=group)
        losses.append(total.item())
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def run(recipe: Recipe, *, world_size: int, method: str = "ring", **launch_kwargs) -> list:
    """Validate, then train ``recipe`` on ``world_size`` ranks with ``method``; the per-rank RunResults."""
    validate(recipe, world_size=world_size, method=method)
    return launch(parallel_train, world_size, recipe, method=method, **launch_kwargs)
