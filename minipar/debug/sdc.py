"""Silent data corruption: a bit that flips in one rank's gradient after the reduction, caught before the
optimizer steps, and a deterministic replay of the suspect step as the second line.

After DP's all-reduce every replica of a rank — the ranks of its dp × cp group, same pipeline stage, same tp
coordinate — holds the same averaged gradient, bit for bit. A flip in one of them (a bad HBM cell, a flaky
ALU in the optimizer's fused kernel, a stray write) goes on silently: the replicas' parameters part and
nothing errors. Meta's Llama 3 report (§3.3.4) lists silent data corruption among its unexpected
interruptions; Dixit et al., "Silent Data Corruptions at Scale" (2021), and Hochschild et al., "Cores that don't
count" (HotOS 2021), measure it on fleets. The check, before every optimizer step:

    fingerprint(g) = (Σ low 32 bits, Σ high 32 bits) of g's elements read as integers (one int64 pair per tensor)
    all-gather the fingerprints over the replicas; a tensor whose fingerprints differ is corrupt

A single flipped bit k changes one integer sum by exactly ±2^(k mod 32), never absorbed (a float sum is: a flip
in a low mantissa bit of a small element next to a large one rounds away). The sums are exact (no overflow for
fewer than 2^31 elements), so the check has no false alarm; two flips that cancel (+2^k here, −2^k there) pass,
which a cryptographic hash would not (at a full hash's cost). Cost per step: one read of the gradients and an
all-gather of 16 bytes per tensor per replica, and one all-reduce of an integer over every rank (a replica
group that disagrees makes every rank replay: the step's pipeline and TP collectives span the groups).

Naming the rank: with three or more replicas the majority's value is the right one and the others are named.
With two there is no majority; the second line decides: a deterministic replay of the suspect step (the same
batch, the same parameters, the same dropout masks — a function of (seed, step)) recomputes the reduced gradient
on every replica, and a rank's held fingerprint is compared with the replay computed by *another* replica (a
transient flip does not repeat; a faulty device replaying its own work could). The rank whose held gradient
differs is named, and the step is taken with the replayed gradient: the run equals one that never flipped.
What the check cannot see: corruption before the reduction (a wrong local gradient is averaged into every
replica alike) — that needs a replay of the local backward on another device, as this module's replay is, for
a step flagged by other means (a loss spike).

Where it applies: dense replicas of :class:`~minipar.hybrid.parallel3d.Trainer3D` with dp·cp > 1 (dp; dp × tp;
dp × pp; × cp). Not under ZeRO (1/2/3 or FSDP over the whole dp group): the reduce-scatter leaves each shard of
the gradient on one rank only, so there is no replica to compare with (HSDP's replicate dimension would be the
place: :func:`guard_optimizer` checks HSDP's shard gradients across its replicate group, without the replay);
nor an MoE model's experts (stepped by their own optimizer, earlier in the step).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["fingerprint", "flip_bit", "disagreements", "ReplicaMismatch", "Finding", "Flip", "CheckedTrainer",
           "guard_optimizer"]

_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def fingerprint(tensors: list) -> torch.Tensor:
    """(len(tensors), 2) int64: each tensor's elements read as integers of their width, the sums of their low and
    high 32 bits. Exact: any single flipped bit changes one of the two sums."""
    rows = []
    for t in tensors:
        bits = t.detach().contiguous().view(_INT[t.element_size()]).reshape(-1).to(torch.int64)
        rows.append(torch.stack([(bits & 0xFFFFFFFF).sum(), (bits >> 32).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit ``bit`` of element ``index`` (flat) of ``t`` in place: the planted corruption."""
    flat = t.detach().view(-1).view(_INT[t.element_size()])
    flat[index] ^= torch.tensor(1 << bit if bit < 8 * t.element_size() - 1 else -(1 << bit), dtype=flat.dtype)


def disagreements(gathered: torch.Tensor, names: list, ranks: list) -> list[tuple[str, list]]:
    """[(tensor name, ranks off the majority)] from ``gathered`` (replicas, tensors, 2): for each tensor whose
    fingerprints differ, the ranks not holding the most common one (every rank when there is no majority)."""
    found = []
    for j, name in enumerate(names):
        values = [tuple(gathered[i, j].tolist()) for i in range(len(ranks))]
        if len(set(values)) == 1:
            continue
        (top, count), *rest = Counter(values).most_common()
        tie = rest and rest[0][1] == count
        found.append((name, list(ranks) if tie else [r for r, v in zip(ranks, values) if v != top]))
    return found


class ReplicaMismatch(RuntimeError):
    """The replicas' gradients differ before the optimizer step (raised on every replica alike)."""

    def __init__(self, step: int, found: list):
        self.step, self.found = step, found
        if not found:                                # this rank's replicas agree; another group's did not
            super().__init__(f"step {step}: another replica group's gradients differ (silent data corruption), "
                             f"caught before the optimizer step; this rank's replicas agree")
            return
        name, ranks = found[0]
        who = (f"rank {ranks[0]}'s gradient of {name}" if len(ranks) == 1 else
               f"the gradient of {name} on ranks {', '.join(map(str, ranks))}")
        more = f" (and {len(found) - 1} more tensors)" if len(found) > 1 else ""
        super().__init__(f"step {step}: {who}{more} differs from its replicas' after the reduction: silent data "
                         f"corruption, caught before the optimizer step")


@dataclass(frozen=True)
class Finding:
    step: int
    rank: int
    tensor: str
    how: str                    # "majority" or "replay"


@dataclass(frozen=True)
class Flip:
    """The planted corruption: at global ``step``, on ``rank``, flip ``bit`` of element ``index`` of the gradient of
    ``tensor`` (a reference name) after the reduction."""
    step: int
    rank: int
    tensor: str
    index: int = 0
    bit: int = 30


class CheckedTrainer:
    """``trainer`` (a Trainer3D) whose every optimizer step is preceded by the replicas' fingerprint check.
    ``replay``: on a mismatch, replay the step and go on (True), or raise :class:`ReplicaMismatch` (False; the
    parameters are untouched). ``flip``: a :class:`Flip` to plant (the test). ``findings``: what was caught."""

    def __init__(self, trainer, *, replay: bool = True, flip: Flip | None = None):
        if trainer.zero is not None:
            raise ValueError("the gradient check compares replicas, and ZeRO over the dp group leaves each gradient "
                             "shard on one rank only: nothing to compare with (run it without --zero)")
        if trainer.experts:
            raise ValueError("the gradient check covers dense models: an MoE model's experts step before it")
        if trainer.reducer is None:
            raise ValueError("the gradient check needs replicas: dp·cp > 1")
        self.trainer, self.replay, self.flip, self.findings = trainer, replay, flip, []
        self.group = trainer.dp_group
        self.ranks = dist.get_process_group_ranks(self.group)        # in the all-gather's order
        self.params = trainer.dense_params
        self.names = [trainer.names[id(p)] for p in self.params]
        self._step_optimizer, self._suspect, self._step = trainer.optimizer.step, None, 0
        trainer.optimizer.step = self._checked_step      # runs after the reduction, before the update

    def step(self, inputs, targets, index: int):
        """The trainer's step ``index``, checked; a mismatch is replayed (or raised, ``replay=False``)."""
        self._step = index
        try:
            return self.trainer.step(inputs, targets, index)
        except ReplicaMismatch as exc:
            if not self.replay:
                raise
            if len(self.ranks) > 2:
                self.findings += [Finding(index, r, name, "majority") for name, ranks in exc.found for r in ranks]
            self._suspect = fingerprint([p.grad for p in self.params])
            try:
                return self.trainer.step(inputs, targets, index)     # the replay: the same batch, params, masks
            finally:
                self._suspect = None

    def _gather(self, fp: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(self.ranks) * fp.numel(), dtype=fp.dtype, device=fp.device)
        comm.all_gather_into_tensor(out, fp.reshape(-1), group=self.group)
        return out.view(len(self.ranks), *fp.shape)

    def _anywhere(self, flag: bool) -> bool:
        """Whether any rank of the world found a mismatch (an all-reduce of one integer over every rank)."""
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.trainer.device)
        comm.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _checked_step(self, *args, **kwargs):
        grads = [p.grad for p in self.params]
        f = self.flip
        if f and self._suspect is None and f.step == self._step and f.rank == dist.get_rank() and f.tensor in self.names:
            flip_bit(grads[self.names.index(f.tensor)], f.index, f.bit)
        gathered = self._gather(fingerprint(grads))
        found = disagreements(gathered, self.names, self.ranks)
        anywhere = self._anywhere(bool(found))                # every rank replays, or none: the step is collective
        if self._suspect is None:
            if anywhere:
                raise ReplicaMismatch(self._step, found)
            return self._step_optimizer(*args, **kwargs)
        if anywhere:                                          # the replay disagrees too: not a transient flip
            raise RuntimeError(f"step {self._step}: the replay's gradients differ between replicas as well "
                               f"({found[0] if found else 'in another group'}): a faulty device, not a transient flip")
        held = self._gather(self._suspect)
        for i, r in enumerate(self.ranks):                   # rank r's held gradient against another's replay
            other = gathered[(i + 1) % len(self.ranks)]
            for j, name in enumerate(self.names):
                if not torch.equal(held[i, j], other[j]) and not any(
                        (x.rank, x.tensor) == (r, name) for x in self.findings if x.step == self._step):
                    self.findings.append(Finding(self._step, r, name, "replay"))
        return self._step_optimizer(*args, **kwargs)


def guard_optimizer(optimizer, grads, names: list, group, *, flip: Flip | None = None, device="cpu") -> None:
    """Check before every ``optimizer.step()`` that the replicas in ``group`` hold the same ``grads()`` (a list of
    tensors named ``names``), raising :class:`ReplicaMismatch` on every rank of the world otherwise (the
    parameters untouched). For a strategy whose replicas are not the whole data-parallel group: HSDP's shard
    gradients after the all-reduce across its replicate group (``ZeRO(..., replicate_group=cross)``; wrap
    ``zero.optimizer``, ``grads=lambda: [u.master.grad for u in zero.units]``). ``flip``: planted at the
    ``flip.step``-th call (counted from 0) on ``flip.rank``. No replay: with two replicas it names both ranks."""
    step_optimizer, ranks, calls = optimizer.step, dist.get_process_group_ranks(group), [0]

    def checked(*args, **kwargs):
        held = grads()
        if flip and flip.step == calls[0] and flip.rank == dist.get_rank():
            flip_bit(held[names.index(flip.tensor)], flip.index, flip.bit)
        fp = fingerprint(held)
        gathered = torch.empty(len(ranks) * fp.numel(), dtype=fp.dtype, device=fp.device)
        comm.all_gather_into_tensor(gathered, fp.reshape(-1), group=group)
        found = disagreements(gathered.view(len(ranks), *fp.shape), names, ranks)
        flag = torch.tensor([int(bool(found))], dtype=torch.int64, device=device)
        comm.all_reduce(flag, op=dist.ReduceOp.MAX)
        step, calls[0] = calls[0], calls[0] + 1
        if flag.item():
            raise ReplicaMismatch(step, found)
        return step_optimizer(*args, **kwargs)

    optimizer.step = checked
