"""A rank's side of the quorum (:mod:`.lighthouse` is the other): register for a round, read its quorum, build
the quorum's process group, vote, read the decision; and :class:`CommitGate`, the optimizer a replica's trainer
steps through, which averages the gradient over the quorum and steps only a committed step.

The cross-replica average, for a quorum of n live replicas of the R configured, each holding B/R rows of the
global batch B::

    g = (1/n) · Σ_{r in quorum} g_r,      g_r = ∇ (mean loss over replica r's B/R rows)

so g is the gradient of the mean loss over the n·B/R rows the live replicas hold: the step's **effective batch
shrinks to n·B/R** while a replica is missing, and each row keeps weight 1/(n·B/R). Dividing by R instead (the
configured count) would shrink the step by n/R: wrong. Local rank i of every replica holds the same shard (all
replicas share one layout), so each local rank has its own quorum group: ``PrefixStore(f"q{id}/l{i}")``.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..flat import FlatLayout

__all__ = ["StepAborted", "FaultPlan", "Quorum", "QuorumClient", "CommitGate", "FAULT_POINTS", "FAULT_ACTIONS"]

FAULT_POINTS = ("before_reduce", "after_reduce", "before_register")   # where a planted fault lands
FAULT_ACTIONS = ("kill", "hang")


class StepAborted(RuntimeError):
    """The lighthouse aborted this round: nothing of the step was applied; the next round retries it."""


@dataclass(frozen=True)
class FaultPlan:
    """A planted failure, for tests and the chapter: rank ``rank`` of replica ``replica`` (its first generation)
    at step ``step``, ``at`` one of :data:`FAULT_POINTS` (``after_reduce``: its gradient is already in the others'
    all-reduce, its vote not yet cast: the half-done step; ``before_register``: the step committed, the next
    quorum not yet asked for), either sends itself SIGKILL (``action="kill"``) or stops making progress while
    alive (``"hang"``: a wedged device or a deadlock, which only a deadline can tell from slowness)."""
    replica: int
    rank: int
    step: int
    at: str = "after_reduce"
    action: str = "kill"

    def fire(self, replica: int, generation: int, rank: int, step: int, at: str) -> None:
        if (replica, generation, rank, step, at) != (self.replica, 0, self.rank, self.step, self.at):
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:                 # "hang": alive, answering signals, never registering again
            time.sleep(3600)


@dataclass
class Quorum:
    round: int
    id: int
    members: list          # [replica] in order: a member's index is its rank in the quorum's group
    step: int
    heal: dict             # {healing replica: source replica}

    def index(self, replica: int) -> int:
        return self.members.index(replica)


class QuorumClient:
    """Replica ``replica`` (generation ``generation``), local rank ``rank``, talking to the lighthouse's
    ``store``. ``timeout``: seconds a cross-replica collective may wait."""

    def __init__(self, store, *, replica: int, generation: int, rank: int, world_size: int, timeout: float):
        self.store, self.replica, self.generation, self.rank = store, replica, generation, rank
        self.timeout = datetime.timedelta(seconds=timeout)
        self.round = self.first_round(store, world_size)
        self.group, self.group_id, self.retired = None, None, []
        self.healed_bytes = 0               # state received from peers (heal.exchange counts it)

    @staticmethod
    def first_round(store, world_size: int) -> int:
        """The round after the latest the lighthouse published (0 at the start; later for a restarted replica),
        the same on every rank of the replica (the largest any read: they read at different moments)."""
        latest = torch.tensor([int(store.get("latest")) if store.check(["latest"]) else -1])
        if world_size > 1:
            comm.all_reduce(latest, op=dist.ReduceOp.MAX)
        return int(latest) + 1

    def next_quorum(self, committed: int) -> Quorum:
        """Register for the next round with ``committed`` steps done; the first quorum that includes this
        replica (a round formed without it, too late, is skipped)."""
        while True:
            if self.rank == 0:
                self.store.set(f"ready/{self.round}/{self.replica}",
                               json.dumps({"gen": self.generation, "step": committed}))
            q = json.loads(self.store.get(f"quorum/{self.round}"))      # waits for the lighthouse
            members = dict((r, g) for r, g in q["members"])
            if members.get(self.replica) == self.generation:
                quorum = Quorum(self.round, q["id"], sorted(members), q["step"],
                                {int(r): s for r, s in q["heal"].items()})
                self._join_group(quorum)
                return quorum
            self.round += 1

    def _join_group(self, q: Quorum) -> None:
        if q.id == self.group_id:
            return
        if self.group is not None:          # kept, never destroyed: tearing down a group whose peer died can block
            self.retired.append(self.group)
        prefix = dist.PrefixStore(f"q{q.id}/l{self.rank}", self.store)
        self.group = dist.ProcessGroupGloo(prefix, q.index(self.replica), len(q.members), self.timeout)
        self.group_id = q.id

    def vote(self, ok: bool, why: str = "", heal_s: float | None = None) -> None:
        self.store.set(f"vote/{self.round}/{self.replica}/{self.rank}",
                       json.dumps({"ok": ok, "why": why, "heal_s": heal_s}))

    def finished_unless_aborted(self, work, poll: float = 0.0005, check_every: int = 20) -> bool:
        """Wait for this round's cross-replica collective ``work``; False as soon as the lighthouse has aborted the
        round instead. Needed because a collective whose member died need not fail everywhere: gloo fails the
        ranks that talk to the dead one, and a survivor waiting on another survivor (which failed and left the
        collective, its sockets open) would wait out the whole timeout — past the next quorum's deadline. A
        decision that exists before this rank voted can only be an abort."""
        key, polls = f"decision/{self.round}", 0
        while not work.is_completed():
            time.sleep(poll)
            polls += 1
            if polls % check_every == 0 and self.store.check([key]):
                return False
        work.wait()                         # raises what the collective raised
        return True

    def decision(self) -> bool:
        """Whether the round committed; the next round follows either way. After an abort the group is
        dropped (a peer may have died in its collective) and the next quorum builds a fresh one."""
        committed = self.store.get(f"decision/{self.round}").decode() == "commit"
        self.round += 1
        if not committed:
            self.group_id = None
        return committed

    def report_loss(self, step: int, loss: float) -> None:
        self.store.set(f"loss/{step}/{self.replica}", repr(float(loss)))


class CommitGate:
    """Stands in for a trainer's optimizer (:class:`minipar.hybrid.parallel3d.Trainer3D` calls ``step()`` once
    its gradients are averaged inside the replica): averages them over the quorum (÷ n live replicas), votes,
    and steps the real optimizer only if the lighthouse commits; else raises :class:`StepAborted` with the
    parameters and optimizer state untouched. Everything else is the real optimizer's."""

    def __init__(self, optimizer, params: list, client: QuorumClient, plan: FaultPlan | None = None):
        self.optimizer, self.params, self.client, self.plan = optimizer, params, client, plan
        self.quorum, self.heal_s = None, None
        self.reduced = []                   # [(quorum size n, payload bytes)] per all-reduce that completed

    def arm(self, quorum: Quorum, heal_s: float | None) -> None:
        self.quorum, self.heal_s = quorum, heal_s

    def _fire(self, at: str) -> None:
        if self.plan is not None:
            c = self.client
            self.plan.fire(c.replica, c.generation, c.rank, self.quorum.step, at)

    def step(self) -> None:
        self._fire("before_reduce")
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        layout = FlatLayout([g.shape for g in grads])
        flat = layout.flatten(grads)
        try:        # the group itself, not minipar.comm: the comm log names groups by ranks new_group registered
            if not self.client.finished_unless_aborted(self.client.group.allreduce([flat])):
                raise RuntimeError(f"the lighthouse aborted round {self.quorum.round} during its all-reduce")
            layout.unflatten(flat.div_(len(self.quorum.members)), grads)
            self.reduced.append((len(self.quorum.members), flat.numel() * flat.element_size()))
            ok, why = True, ""
        except RuntimeError as exc:         # a member died inside the collective: this step cannot commit
            ok, why = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        self._fire("after_reduce")
        self.client.vote(ok, why, self.heal_s)
        if not self.client.decision():
            raise StepAborted(f"round {self.quorum.round} (step {self.quorum.step}) aborted")
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name):            # state, param_groups, state_dict: the real optimizer's
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)
