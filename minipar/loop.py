"""The pieces every training loop in minipar repeats, written once.

* :func:`lm_loss` — next-token cross-entropy, mean over every position of the batch:
  L = −(1/(B·T)) Σ_{b,t} log softmax(logits[b,t])[target[b,t]].
* :func:`shard_batch` — rank r's contiguous 1/N of a global batch (dim 0).
* :func:`mean_over_ranks` — the loss a data-parallel step reports: (1/N) Σ_r L_r. With equal shards this
  is the global batch's mean loss, the number one device would print.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm

__all__ = ["lm_loss", "shard_batch", "mean_over_ranks", "backward_in_micro_batches"]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V) against ``targets`` (...), averaged over all positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           label_smoothing=label_smoothing)


def shard_batch(batch, rank: int, world_size: int):
    """Rank ``rank``'s contiguous 1/N of every tensor in ``batch`` (split on dim 0).

    The batch must divide evenly: with unequal shards the mean of the ranks' mean losses is not the
    global mean loss, and data parallelism would no longer equal one device."""
    tensors = batch if isinstance(batch, (tuple, list)) else (batch,)
    rows = tensors[0].shape[0]
    if rows % world_size:
        raise ValueError(f"a global batch of {rows} rows does not split evenly over {world_size} ranks; "
                         f"use a batch size divisible by {world_size} (or pad it, as DistributedSampler does)")
    size = rows // world_size
    shards = tuple(t[rank * size: (rank + 1) * size] for t in tensors)
    return shards if isinstance(batch, (tuple, list)) else shards[0]


def mean_over_ranks(loss, group=None) -> float:
    """(1/N) Σ_r loss_r over the ranks of ``group``, as a Python float (one all-reduce of one number,
    logged by :mod:`minipar.comm` like every other collective)."""
    value = (loss.detach().clone().reshape(1) if isinstance(loss, torch.Tensor)
             else torch.tensor([float(loss)], dtype=torch.float64))   # a Python float keeps its 64 bits
    comm.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def backward_in_micro_batches(loss_fn, model, x, y, accum_steps: int = 1) -> torch.Tensor:
    """Gradient accumulation: ``x, y`` split into ``accum_steps`` equal micro-batches, each one's
    ``loss_fn(model, x_m, y_m) / accum_steps`` backpropagated in turn, so the gradients summed in ``.grad`` are
    the whole batch's mean-loss gradient. Returns that mean loss, detached."""
    loss = 0.0
    for x_m, y_m in zip(x.chunk(accum_steps), y.chunk(accum_steps)):
        part = loss_fn(model, x_m, y_m) / accum_steps
        part.backward()
        loss = loss + part.detach()
    return loss
