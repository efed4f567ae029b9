"""Randomness across ranks: which ranks must draw the same numbers, which must not, and what a restart saves.

Megatron-LM's rules for dropout under tensor parallelism (Shoeybi et al. 2019, §3; megatron/core/
tensor_parallel/random.py, ``model_parallel_cuda_manual_seed``): two generators per rank —

* the **default** one, seeded ``seed + 100 · pp_rank`` (megatron/training/initialize.py ``_set_random_seed``;
  ``+ 10 · dp_rank`` only with ``--data-parallel-random-init``): the same on every rank of a tensor-parallel
  group, for dropout on tensors every TP rank holds **whole** (the residual stream). If those masks differed,
  the ranks' copies of the same activation would differ, and so would the replicated parameters after a step;
* the **tensor-parallel** one, seeded ``seed + 2718 + tp_rank`` (the RNG tracker's "model-parallel-rng"):
  different on every TP rank, for dropout on tensors **split** across the group (attention probabilities of
  each rank's heads). If those were the same, head h on rank 0 and head h on rank 1 would get the same mask:
  correlated, not what one device draws.

minipar's :class:`minipar.tensor.layers.DropoutStreams` are these two (``replicated``, ``per_rank``).
:func:`replica_spread` measures whether tensors that must be equal across a group still are.
A restart must restore **every generator the run draws from**: :func:`rng_state` / :func:`set_rng_state` save
the default CPU generator and any others given (minipar's checkpoint, :mod:`minipar.hybrid.checkpoint`, saves
``torch.get_rng_state()``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["megatron_seeds", "replica_spread", "rng_state", "set_rng_state", "mask_agreement"]


def megatron_seeds(seed: int, tp_rank: int, pp_rank: int = 0, dp_rank: int = 0,
                   data_parallel_random_init: bool = False) -> dict:
    """The two seeds of a rank by Megatron-LM's rules: ``{"default": ..., "tensor_parallel": ...}``."""
    default = seed + 100 * pp_rank + (10 * dp_rank if data_parallel_random_init else 0)
    return {"default": default, "tensor_parallel": default + 2718 + tp_rank}


def replica_spread(tensors: dict, group=None) -> dict:
    """``{name: max |difference|}`` between this rank's tensor and every other rank's copy in ``group``
    (0.0: the replicas agree bit for bit). Collective: every rank of the group calls it with the same names."""
    out = {}
    n = dist.get_world_size(group)
    for name, t in tensors.items():
        copies = [torch.empty_like(t) for _ in range(n)]
        comm.all_gather(copies, t.detach().contiguous(), group=group)
        out[name] = max(float((c - copies[0]).abs().max()) for c in copies)
    return out


def rng_state(generators: dict | None = None) -> dict:
    """The default CPU generator's state and each named generator's: what a checkpoint must hold."""
    state = {"torch": torch.get_rng_state()}
    for name, g in (generators or {}).items():
        state[name] = g.get_state()
    return state


def set_rng_state(state: dict, generators: dict | None = None) -> None:
    torch.set_rng_state(state["torch"])
    for name, g in (generators or {}).items():
        g.set_state(state[name])


def mask_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of positions where two dropout masks agree (independent masks with keep-probability q agree
    on q² + (1 − q)² of the positions; identical ones on all)."""
    return float((a.bool() == b.bool()).double().mean())
