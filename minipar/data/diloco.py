"""DiLoCo: N replicas train on their own shards for H inner steps with no communication, then agree once
(Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models", Algorithm 1).

Every replica i starts each round from the shared outer parameters θ and takes H steps of the inner
optimizer (the paper: AdamW; here the recipe's optimizer, whose state each replica keeps across rounds)
on its 1/N of each global batch, reaching θ_i. Then::

    Δ  = (1/N) Σ_i (θ − θ_i)          the outer gradient: one all-reduce of the parameters' size
    θ ← OuterOpt(θ, Δ)                 SGD with Nesterov momentum (paper: lr 0.7, momentum 0.9)
    θ_i ← θ                            every replica restarts from it

Bytes sent per rank per H inner steps: 2(N−1)/N · b · Ψ (Ψ parameters, b bytes each) — what DDP sends
every step. With H = 1, outer lr 1 and no momentum, θ ← (1/N) Σ_i θ_i: the replicas' parameters averaged
after every inner step (local SGD with H = 1), which with an inner plain SGD is exactly synchronous
training, θ − lr·(1/N) Σ_i g_i.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"), the part
built here: the parameters are cut into F fragments (consecutive parameters in registration order, about
equal in size) and fragment f is synchronised — the rule above, on its parameters only, with its own
outer momentum — after inner step t (counted from 1) when t ≡ (f+1)·H/F (mod H). Each fragment still
syncs once every H steps, so the bytes per H steps are the same; the peak per sync is 1/F of them.
Left out of the streaming paper: overlapping a fragment's all-reduce with the next τ inner steps (and
the mixing θ_i ← α θ_i + (1−α) θ it allows; here α = 0, replace), and the low-precision (FP4) outer gradients.

The parameters a run reports are θ, the outer parameters (the same on every rank). :func:`diloco_reference`
is the rule in one process (the replicas one after the other); the tests check the ranks against it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import comm
from ..recipe import RunResult
from ..launcher import launch
from ..loop import shard_batch
from ..validation import positive_int

__all__ = ["DiLoCo", "DiLoCoRun", "fragments_of", "sync_steps", "validate", "parallel_train", "run",
           "diloco_reference"]


def fragments_of(params: list, fragments: int) -> list:
    """``params`` cut into ``fragments`` runs of consecutive parameters of about equal size (numel)."""
    total = sum(p.numel() for p in params)
    cuts, running = [[] for _ in range(fragments)], 0
    for p in params:
        cuts[min(fragments - 1, running * fragments // total)].append(p)
        running += p.numel()
    if any(not c for c in cuts):
        raise ValueError(f"{len(params)} parameters cannot make {fragments} non-empty fragments")
    return cuts


def sync_steps(step: int, H: int, fragments: int) -> list:
    """The fragments synchronised after inner step ``step`` (counted from 1): f when step ≡ (f+1)·H/F mod H."""
    return [f for f in range(fragments) if step % H == ((f + 1) * H // fragments) % H]


def outer_optimizer(params, lr: float, momentum: float):
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


class DiLoCo:
    """The outer loop around one replica's ``model``: after every inner step call :meth:`after_inner_step`;
    it synchronises the fragments due then over ``group``."""

    def __init__(self, model, H: int, outer_lr: float = 0.7, outer_momentum: float = 0.9, fragments: int = 1,
                 group=None):
        self.H, self.group, self.inner_steps = H, group, 0
        params = [p for p in model.parameters() if p.requires_grad]
        self.fragments = fragments_of(params, fragments)
        self.outer = [[p.detach().clone() for p in frag] for frag in self.fragments]     # θ, per fragment
        self.outer_opts = [outer_optimizer(o, outer_lr, outer_momentum) for o in self.outer]

    def after_inner_step(self) -> None:
        self.inner_steps += 1
        for f in sync_steps(self.inner_steps, self.H, len(self.fragments)):
            self.synchronise(f)

    @torch.no_grad()
    def synchronise(self, f: int) -> None:
        replica, outer = self.fragments[f], self.outer[f]
        deltas = [o - p for o, p in zip(outer, replica)]        # θ − θ_i
        comm.all_reduce_flat(deltas, group=self.group)          # the one all-reduce per fragment per H steps
        for o, d in zip(outer, deltas):
            o.grad = d / dist.get_world_size(self.group)        # Δ = mean over replicas
        self.outer_opts[f].step()
        for p, o in zip(replica, outer):
            p.copy_(o)                                          # restart from θ; inner optimizer state kept

    def outer_parameters(self, model) -> dict:
        """{name: θ} under the model's names."""
        names = {p: n for n, p in model.named_parameters()}
        return {names[p]: o.detach().clone() for frag, outs in zip(self.fragments, self.outer)
                for p, o in zip(frag, outs)}


@dataclass
class DiLoCoRun(RunResult):
    """A :class:`RunResult` (losses: the mean over replicas of their inner losses; params: θ) plus the bytes
    this rank sent after each inner step, modelled by :mod:`minipar.comm` (0 on steps without a sync) and as
    its sockets carried them (``wire_bytes``, None where unknown)."""
    bytes_sent: list = field(default_factory=list)
    wire_bytes: list = field(default_factory=list)


def validate(recipe, *, world_size: int, H: int, fragments: int = 1, outer_lr: float = 0.7,
             outer_momentum: float = 0.9, **_) -> None:
    """Raise ValueError, before any process starts, for a configuration that cannot run."""
    positive_int("world_size", world_size)
    positive_int("H", H)
    positive_int("fragments", fragments)
    if H % fragments:
        raise ValueError(f"H={H} inner steps cannot be cut into {fragments} equal sync offsets: use F dividing H")
    if not outer_lr > 0 or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got {outer_lr}, {outer_momentum}")
    fragments_of([p for p in recipe.model().parameters() if p.requires_grad], fragments)   # enough parameters
    for step, (inputs, _) in enumerate(recipe.batches):
        if inputs.shape[0] % world_size:
            raise ValueError(f"global batch {step} has {inputs.shape[0]} rows: not divisible by {world_size} replicas")


def parallel_train(rank: int, world_size: int, recipe, *, H: int, outer_lr: float = 0.7,
                   outer_momentum: float = 0.9, fragments: int = 1, group=None) -> DiLoCoRun:
    """Train ``recipe`` with DiLoCo: this rank is replica ``rank``, on 1/N of every global batch."""
    validate(recipe, world_size=world_size, H=H, fragments=fragments, outer_lr=outer_lr,
             outer_momentum=outer_momentum)
    model = recipe.model().to(recipe.dtype)
    inner = recipe.optimizer(model.parameters())
    diloco = DiLoCo(model, H, outer_lr, outer_momentum, fragments, group)
    local_losses, bytes_sent, wire_bytes = [], [], []
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        inner.zero_grad(set_to_none=True)
        loss = recipe.loss(model, x, y)
        loss.backward()
        inner.step()                                            # no communication: this replica alone
        with comm.recording() as log:
            diloco.after_inner_step()
        bytes_sent.append(log.bytes_sent)
        wire_bytes.append(log.observed_bytes_sent)
        local_losses.append(loss.item())
    # the losses for the table, averaged once at the end (not a per-step all-reduce DiLoCo would not make)
    losses = torch.tensor(local_losses, dtype=torch.float64)
    comm.all_reduce(losses, group=group)
    return DiLoCoRun((losses / world_size).tolist(), diloco.outer_parameters(model), bytes_sent, wire_bytes)


def run(recipe, *, world_size: int, H: int, quiet: bool = True, **config) -> list:
    """Check the inputs, then :func:`parallel_train` on ``world_size`` ranks: per-rank DiLoCoRuns."""
    validate(recipe, world_size=world_size, H=H, **config)
    return launch(parallel_train, world_size, recipe, H=H, quiet=quiet, **config)


def diloco_reference(recipe, world_size: int, H: int, *, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                     fragments: int = 1) -> RunResult:
    """The same rule in one process: N replica models stepped one after the other, Δ a plain mean."""
    validate(recipe, world_size=world_size, H=H, fragments=fragments, outer_lr=outer_lr,
             outer_momentum=outer_momentum)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                                    # as every rank runs
    try:
        replicas = [recipe.model().to(recipe.dtype) for _ in range(world_size)]
        inners = [recipe.optimizer(m.parameters()) for m in replicas]
        per_replica = [fragments_of([p for p in m.parameters() if p.requires_grad], fragments) for m in replicas]
        outer = [[p.detach().clone() for p in frag] for frag in per_replica[0]]
        outer_opts = [outer_optimizer(o, outer_lr, outer_momentum) for o in outer]
        losses = []
        for step, batch in enumerate(recipe.batches, start=1):
            step_losses = []
            for i, (model, inner) in enumerate(zip(replicas, inners)):
                x, y = shard_batch(batch, i, world_size)
                inner.zero_grad(set_to_none=True)
                loss = recipe.loss(model, x, y)
                loss.backward()
                inner.step()
                step_losses.append(loss.item())
            losses.append(sum(step_losses) / world_size)
            with torch.no_grad():
                for f in sync_steps(step, H, fragments):
                    for k, o in enumerate(outer[f]):
                        o.grad = sum(o - frags[f][k] for frags in per_replica) / world_size
                    outer_opts[f].step()
                    for frags in per_replica:
                        for p, o in zip(frags[f], outer[f]):
                            p.copy_(o)
        names = [n for n, p in replicas[0].named_parameters() if p.requires_grad]
        flat_outer = [o for outs in outer for o in outs]
        return RunResult(losses, {n: o.clone() for n, o in zip(names, flat_outer)})
    finally:
        torch.set_num_threads(threads)
