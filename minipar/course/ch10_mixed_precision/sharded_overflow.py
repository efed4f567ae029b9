"""Chapter 10's one distributed run: two gloo ranks each hold half of the gradients (as ZeRO or FSDP shard
them), and only rank 1's half overflows. Each rank's scaler decides once on its own flag
(``DynamicLossScaler()``) and once with the flag all-reduced with MAX over the group
(``DynamicLossScaler(group=...)``, as PyTorch's ``ShardedGradScaler`` does)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from minipar.launcher import launch
from minipar.precision.loss_scaler import DynamicLossScaler

from . import claims

WAYS = ("own flag", "flag all-reduced (MAX)")


def _decide_on_shard(rank: int, world_size: int, init_scale: float) -> list[tuple[bool, float]]:
    """This rank's (stepped, scale after) for its own shard, without and with the scaler's group."""
    shard = torch.ones(4)
    if rank == 1:
        shard[0] = float("inf")                      # only rank 1's half overflows
    decisions = []
    for group in (None, dist.group.WORLD):
        scaler = DynamicLossScaler(init_scale=init_scale, group=group)
        stepped = scaler.update(scaler.check_overflow([shard]))
        decisions.append((stepped, scaler.loss_scale))
    return decisions


def show_sharded_overflow(init_scale: float = 2.0 ** 16) -> dict:
    """Both ranks' (stepped, scale after), each flag local against all-reduced; returns {way: [per rank]}."""
    per_rank = launch(_decide_on_shard, 2, init_scale, quiet=True)
    decisions = {way: [ranks[i] for ranks in per_rank] for i, way in enumerate(WAYS)}
    for way, ranks in decisions.items():
        print(f"{way:23}: " + " | ".join(f"rank {r}: {'steps' if s else 'skips'}, scale {scale:,.0f}"
                                          for r, (s, scale) in enumerate(ranks)))
    claims.check_sharded_overflow_needs_all_reduce(decisions, init_scale)
    return decisions
