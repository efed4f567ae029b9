"""Randomness across ranks: which ranks must draw the same numbers, which must not, and what a restart saves.

Megatron-LM's rule for dropout under tensor parallelism — a **default** generator the same on every rank of a
tensor-parallel group (``seed + 100 · pp_rank``) and a **tensor-parallel** one different on every rank
(``seed + 2718 + tp_rank``) — lives in :mod:`minipar.rng` (:func:`~minipar.rng.megatron_seeds`, and
:class:`~minipar.rng.DropoutStreams`, the two streams minipar's tensor-parallel dropout draws from); this
module checks it at run time. :func:`replica_spread` measures whether tensors that must be equal across a group still are.
A restart must restore **every generator the run draws from**: :func:`rng_state` / :func:`set_rng_state` save
the default CPU generator and any others given (minipar's checkpoint, :mod:`minipar.hybrid.checkpoint`, saves
``torch.get_rng_state()``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["replica_spread", "rng_state", "set_rng_state", "mask_agreement"]


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
