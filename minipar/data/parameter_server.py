"""A synchronous parameter server: workers push gradients, the server updates, workers pull weights.

Rank ``server`` holds the only optimizer (and its state). Every step, every rank (the server too, which
also computes on its shard) computes the gradient of its 1/N of the global batch; then

    push:  each worker sends its gradient to the server          worker sends P,  server receives (N-1)·P
    update: server averages g = (1/N) Σ_r g_r and steps           (same step as one device on the batch)
    pull:  the server sends the new weights to every worker      server sends (N-1)·P, worker receives P

(P = bytes of the parameters = bytes of the gradients in float32.) A worker's traffic is constant, but
the server's is (N-1)·P each way: it grows with N and its link becomes the bottleneck, which is why
collective all-reduce (2(N-1)/N · P per rank, for every rank) replaced it for dense models. Averaged over
the ranks both move 2(N-1)/N · P: the difference is that the parameter server puts it all on one link.

Li et al. 2014, "Scaling Distributed Machine Learning with the Parameter Server" (OSDI); Dean et al. 2012
(DistBelief). Synchronous here, so that it equals one device; the original ones also ran asynchronously.

Gradients and weights travel as one flat buffer each (:class:`minipar.flat.FlatLayout` with one
part: nothing is sharded, the server holds it all).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..recipe import RunResult
from ..launcher import launch
from ..loop import mean_over_ranks, shard_batch
from ..flat import FlatLayout

__all__ = ["push_gradients", "pull_weights", "validate", "parallel_train", "run", "parameter_server_bytes_sent"]


def parameter_server_bytes_sent(rank: int, world_size: int, param_bytes: int, server: int = 0) -> int:
    """Bytes ``rank`` sends in one step: (N-1)·P on the server (the pull), P on a worker (the push)."""
    return (world_size - 1) * param_bytes if rank == server else param_bytes


def _layout(params) -> FlatLayout:
    return FlatLayout([p.shape for p in params])              # one part: the whole buffer, unpadded


def push_gradients(params: list, server: int) -> torch.Tensor | None:
    """Workers send their flat gradient to ``server``; the server returns the average over all ranks
    (its own included, summed in rank order), workers return None."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = _layout(params).flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    if rank != server:
        comm.send(mine, dst=server)
        return None
    total = mine.clone()
    incoming = torch.empty_like(mine)
    for worker in range(world_size):
        if worker != server:
            total += comm.recv(incoming, src=worker)
    return total / world_size


def pull_weights(params: list, server: int) -> None:
    """The server sends its flat weights to every worker; workers overwrite theirs with them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = _layout(params)
    with torch.no_grad():
        flat = layout.flatten([p.detach() for p in params])
        if rank == server:
            pending = [comm.isend(flat, dst=w) for w in range(world_size) if w != server]
            for req in pending:
                req.wait()
            return
        comm.recv(flat, src=server)
        for p, weights in zip(params, layout.views(flat)):
            p.copy_(weights)


def parallel_train(rank: int, world_size: int, recipe, *, server: int = 0, step_log=None):
    """Train ``recipe`` with a parameter server on rank ``server`` (every rank also computes its 1/N of
    the batch). Traffic of the steps goes to ``step_log``; the initial pull and the loss report do not."""
    model = recipe.model().to(recipe.dtype)
    params = list(model.parameters())
    pull_weights(params, server)  # everyone starts from the server's weights
    opt = recipe.optimizer(params) if rank == server else None  # optimizer state lives on the server only
    losses = []
    for batch in recipe.batches:
        inputs, targets = shard_batch(batch, rank, world_size)
        with comm.recording(step_log if step_log is not None else comm.CommLog()):
            model.zero_grad(set_to_none=True)
            loss = recipe.loss(model, inputs, targets)
            loss.backward()
            average = push_gradients(params, server)
            if rank == server:
                for p, grad in zip(params, _layout(params).views(average)):
                    p.grad = grad.clone()
                opt.step()
            pull_weights(params, server)
        losses.append(mean_over_ranks(loss.double()))
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def validate(recipe, *, world_size: int, server: int = 0, **_) -> None:
    """ValueError, before any process starts, for a layout a parameter server cannot run."""
    if world_size < 2:
        raise ValueError(f"a parameter server needs at least 2 ranks, got {world_size}")
    if not 0 <= server < world_size:
        raise ValueError(f"server rank {server} is not in 0..{world_size - 1}")
    for step, (inputs, _) in enumerate(recipe.batches):
        if inputs.shape[0] % world_size:
            raise ValueError(f"global batch {step} has {inputs.shape[0]} rows: not divisible by {world_size} ranks")


def run(recipe, *, world_size: int, server: int = 0, quiet: bool = True) -> list:
    """Check the inputs, then run :func:`parallel_train` on ``world_size`` ranks."""
    validate(recipe, world_size=world_size, server=server)
    return launch(parallel_train, world_size, recipe, server=server, quiet=quiet)
