"""Chapter 10's one distributed display: two ranks each hold half of the gradients (as ZeRO or FSDP shard
them), and only rank 1's half overflows. Each rank's scaler decides alone, then on the flag all-reduced with
MAX, which is what ``DynamicLossScaler(group=...)`` and PyTorch's ``ShardedGradScaler`` do. The two ranks run
in this one process (a launch would cost seconds); the MAX over their flags is the value the all-reduce
returns to each (tests/test_loss_scaler.py runs that all-reduce over real ranks)."""
from __future__ import annotations

import torch

from minipar.precision.loss_scaler import DynamicLossScaler, found_inf

from . import claims


def show_sharded_overflow(init_scale: float = 2.0 ** 16) -> dict:
    """Both ranks' (stepped, scale after), each flag local against all-reduced; returns {way: [per rank]}."""
    shards = [torch.ones(4), torch.tensor([float("inf"), 1.0, 1.0, 1.0])]   # only rank 1's half overflows
    own = [found_inf([s]) for s in shards]
    ways = {"own flag": own, "flag all-reduced (MAX)": [max(own)] * len(shards)}
    decisions = {}
    for way, flags in ways.items():
        scalers = [DynamicLossScaler(init_scale=init_scale) for _ in shards]
        stepped = [scaler.update(flag) for scaler, flag in zip(scalers, flags)]
        decisions[way] = [(s, scaler.loss_scale) for s, scaler in zip(stepped, scalers)]
        print(f"{way:23}: " + " | ".join(f"rank {i}: {'steps' if s else 'skips'}, scale {scale:,.0f}"
                                          for i, (s, scale) in enumerate(decisions[way])))
    claims.check_sharded_overflow_needs_all_reduce(decisions, init_scale)
    return decisions
