"""Random streams across ranks: Megatron-LM's seed rule, in one place.

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

:func:`megatron_seeds` is the rule; :class:`DropoutStreams` are the two generators a tensor-parallel rank's
dropout layers draw from (``replicated``, ``per_rank``), seeded by it at every step. The debugging tools
that check the rule at run time (replicas that drift, masks that agree) are :mod:`minipar.debug.seeds`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["megatron_seeds", "DropoutStreams"]


def megatron_seeds(seed: int, tp_rank: int, pp_rank: int = 0, dp_rank: int = 0,
                   data_parallel_random_init: bool = False) -> dict:
    """The two seeds of a rank by Megatron-LM's rules: ``{"default": ..., "tensor_parallel": ...}``."""
    default = seed + 100 * pp_rank + (10 * dp_rank if data_parallel_random_init else 0)
    return {"default": default, "tensor_parallel": default + 2718 + tp_rank}


class DropoutStreams:
    """Two random streams per rank: ``replicated`` (Megatron's default seed, the same on every rank of the
    tensor-parallel ``group``: a mask for a tensor all ranks hold whole must agree, or the replicas drift
    apart) and ``per_rank`` (Megatron's tensor-parallel seed, offset by the rank: masks for different heads or
    sequence shards must be independent).

    Counter-based, as GPU generators are (a seed and an offset): :meth:`start_step` seeds both from (seed,
    step), so step k draws the same masks whether the run got there uninterrupted or resumed from a
    checkpoint — the streams need no place in it. :func:`minipar.tensor.layers.recompute_context_fn` makes an
    activation checkpoint's recomputation draw the masks its forward drew (``torch.utils.checkpoint``
    restores torch's global generator only; Megatron's ``CudaRNGStatesTracker`` does the same for its
    streams)."""

    STEP_STRIDE = 1_000_003                    # seeds of different steps never meet (2718 + tp rank is far less)

    def __init__(self, seed: int, group, device="cpu", pp_rank: int = 0):
        self.seeds = megatron_seeds(seed, dist.get_rank(group), pp_rank)
        self.replicated, self.per_rank = torch.Generator(device), torch.Generator(device)
        self.start_step(0)

    def start_step(self, step: int) -> None:
        """Seed both streams for optimizer step ``step`` (step 0: :func:`megatron_seeds`' two seeds)."""
        offset = self.STEP_STRIDE * step
        self.replicated.manual_seed(self.seeds["default"] + offset)
        self.per_rank.manual_seed(self.seeds["tensor_parallel"] + offset)
