"""The supervising process of a replicated run: it starts the replicas, holds the lighthouse, and watches.

Unlike :func:`minipar.launch`, which ends the whole run when any rank dies, it tolerates the death of a
replica: a rank **killed by a signal** (SIGKILL, a segfault, the OOM killer) takes its replica down — the
replica's other ranks are killed, the death is reported (:attr:`Supervisor.deaths`, the lighthouse's events),
the others go on, and the replica is started again (a new generation that heals from a peer) while
``restarts`` allow. Every other failure — a rank that raises, or exits by itself before it is done — is a bug
that would hit every replica: the run ends with :class:`ReplicaRankError` naming the replica and the rank, its
traceback and output. No quorum possible (:class:`~.lighthouse.NoQuorum`) ends it too. Whatever ends the run,
no process is left behind (the ranks also die with this process: ``PR_SET_PDEATHSIG``).

A replica that is alive but misses a step's quorum deadline (``join_timeout``) is **hung**, as far as anyone can
tell (a wedged device, a deadlock, a rank stopped in a debugger): its ranks are asked for their Python stacks
(SIGUSR1, :mod:`faulthandler`), which are reported with its death, then it is stopped and restarted like a
dead one. Silence is never taken for progress: torchft's lighthouse drops a replica whose heartbeats stop.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from ..launcher import RankError, describe_exit, remove_stale_workdirs
from .lighthouse import Lighthouse
from .replica import COORDINATOR, ReplicaSpec, output_path, read_result, replica_main, result_path

__all__ = ["Supervisor", "ReplicaRankError"]

GRACE = 1.0        # seconds to wait, after a rank raised, for a sibling's death that would explain it


class ReplicaRankError(RankError):
    """A rank of a replica failed other than by a signal: ``replica``, ``local_rank``; ``rank`` is its global
    number, replica · ranks per replica + local rank."""

    def __init__(self, replica: int, local_rank: int, ranks: int, message: str, tb: str = "", output: str = ""):
        self.replica, self.local_rank = replica, local_rank
        super().__init__(replica * ranks + local_rank, f"(replica {replica}, its rank {local_rank}) {message}", tb,
                         output)


class Supervisor:
    """Run ``spec`` on ``spec.replicas`` replicas; ``run()`` returns {replica: its final result}.
    ``join_timeout``: seconds a round waits for an expected replica; a dead replica is started again once
    ``restart_after`` more steps are committed without it (a replacement takes time; counted in steps, the run
    always shows a step it lost, whatever the machine's speed); ``on_commit(round, losses)`` is called for each
    committed round, once the losses of its members that are still alive have arrived."""

    def __init__(self, spec: ReplicaSpec, *, restarts: int = 1, restart_after: int = 1, join_timeout: float = 10.0,
                 on_commit=None, on_event=None):
        self.spec, self.restarts, self.restart_after, self.join_timeout = spec, restarts, restart_after, join_timeout
        self.pending: list = []          # [(replica, generation, start once this many steps are committed)]
        self.on_commit, self.on_event = on_commit, on_event
        self.ranks = spec.layout.world_size
        self.procs: dict = {}            # replica -> (generation, [process])
        self.done: dict = {}             # replica -> {local rank: result}
        self.restarted: dict = {}        # replica -> restarts used
        self.deaths: list = []
        self.lighthouse = None
        self.reported = 0                # committed rounds handed to on_commit

    def run(self) -> dict:
        remove_stale_workdirs()
        import torch._dynamo  # noqa: F401 - as the launcher does: else every forked rank's first optimizer imports it
        self.workdir = tempfile.mkdtemp(prefix=f"minipar-{os.getpid()}-")
        store = dist.FileStore(os.path.join(self.workdir, COORDINATOR), -1)
        self.lighthouse = Lighthouse(store, steps=self.spec.steps, ranks_per_replica=self.ranks,
                                     join_timeout=self.join_timeout, vote_timeout=self.spec.timeout)
        self.store = store
        try:
            for replica in range(self.spec.replicas):
                self._spawn(replica, 0)
            while not self._finished():
                self._restart_due()
                self._watch()
                self.lighthouse.poll()
                self._stop_hung()
                self._report()
                time.sleep(0.005)
            self._report()
            return {r: self._merge(results) for r, results in self.done.items() if len(results) == self.ranks}
        finally:
            for _, procs in self.procs.values():
                for p in procs:
                    if p.is_alive():
                        p.kill()
            for _, procs in self.procs.values():
                for p in procs:
                    p.join(timeout=5)
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _spawn(self, replica: int, generation: int) -> None:
        context = mp.get_context("fork")
        procs = [context.Process(target=replica_main, args=(replica, generation, rank, self.spec, self.workdir),
                                 daemon=True) for rank in range(self.ranks)]
        for p in procs:
            p.start()
        self.procs[replica] = (generation, procs)
        self.lighthouse.spawned(replica, generation, [p.pid for p in procs])

    def _finished(self) -> bool:
        """Every committed step done and every replica that trained to the end has returned; a replica still
        waiting to join then is stopped (it came too late to heal)."""
        if not self.lighthouse.done:
            return False
        last = {r for r, _ in self.lighthouse.committed_rounds()[-1].members}
        if not all(r in self.done and len(self.done[r]) == self.ranks for r in last if r in self.procs):
            return False
        for replica in [r for r in self.lighthouse.live if r not in last]:
            self._kill(replica, "came too late: every step was committed before it could join")
        return True

    def _watch(self) -> None:
        for replica, (generation, procs) in list(self.procs.items()):
            if replica not in self.lighthouse.live:
                continue
            for rank, p in enumerate(procs):
                if p.exitcode is None or rank in self.done.get(replica, {}):
                    continue
                status, value = read_result(result_path(self.workdir, replica, generation, rank))
                if status == "ok":
                    self.done.setdefault(replica, {})[rank] = value
                elif p.exitcode < 0:
                    return self._died(replica, rank, p)
                else:
                    return self._failed(replica, rank, p, status, value)
            if len(self.done.get(replica, {})) == self.ranks:
                self.lighthouse.finished(replica)

    def _died(self, replica: int, rank: int, p) -> None:
        generation, procs = self.procs[replica]
        why = f"rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}"
        self.deaths.append({"replica": replica, "generation": generation, "rank": rank, "pid": p.pid,
                            "exitcode": p.exitcode, "step": self.lighthouse.committed, "hung": False})
        self._lost(replica, generation, why)

    def _lost(self, replica: int, generation: int, why: str) -> None:
        """Stop the replica's ranks, report it, and schedule its restart while ``restarts`` allow."""
        self._kill(replica, why)
        if self.on_event:
            self.on_event(f"replica {replica} lost: {why}; its ranks stopped")
        used = self.restarted.get(replica, 0)
        if used < self.restarts:
            self.restarted[replica] = used + 1
            self.done.pop(replica, None)
            self.pending.append((replica, generation + 1, self.lighthouse.committed + self.restart_after))

    def _stop_hung(self) -> None:
        """Every live replica the lighthouse left out for missing a deadline: its stacks, then stopped and restarted."""
        for replica in sorted(self.lighthouse.laggards):
            generation, procs = self.procs[replica]
            stacks = ask_for_stacks(procs, [output_path(self.workdir, replica, generation, rank)
                                            for rank in range(self.ranks)])
            why = (f"hung: alive but not registered for step {self.lighthouse.committed + 1}'s quorum within "
                   f"{self.join_timeout:g} s; " + "; ".join(f"rank {rank} was in {where}" for rank, where in stacks))
            self.deaths.append({"replica": replica, "generation": generation, "rank": None, "pid": None,
                                "exitcode": None, "step": self.lighthouse.committed, "hung": True})
            self._lost(replica, generation, why)

    def _restart_due(self) -> None:
        for replica, generation, due in list(self.pending):
            if self.lighthouse.committed >= due and not self.lighthouse.done:
                self.pending.remove((replica, generation, due))
                self._spawn(replica, generation)
                if self.on_event:
                    self.on_event(f"replica {replica} restarted (generation {generation}): it heals from a peer")

    def _kill(self, replica: int, why: str) -> None:
        for q in self.procs[replica][1]:
            if q.is_alive():
                q.kill()
        for q in self.procs[replica][1]:
            q.join(timeout=5)
        self.lighthouse.died(replica, why)

    def _failed(self, replica: int, rank: int, p, status: str, value) -> None:
        """A rank raised or exited by itself: a consequence if a sibling died by a signal, else the run's error."""
        generation, procs = self.procs[replica]
        deadline = time.monotonic() + GRACE
        while time.monotonic() < deadline and not any(q.exitcode is not None and q.exitcode < 0 for q in procs):
            time.sleep(0.01)
        for other, q in enumerate(procs):
            if q.exitcode is not None and q.exitcode < 0:
                return self._died(replica, other, q)
        output = _read(output_path(self.workdir, replica, generation, rank))
        if status == "error":
            message, tb, _ = value
            raise ReplicaRankError(replica, rank, self.ranks, message, tb, output)
        raise ReplicaRankError(replica, rank, self.ranks, f"process {describe_exit(p.exitcode)} without returning",
                               output=output)

    def _report(self) -> None:
        rounds = self.lighthouse.committed_rounds()
        while self.reported < len(rounds):
            this = rounds[self.reported]
            losses = {}
            for replica, generation in this.members:
                key = f"loss/{this.step}/{replica}"
                if self.store.check([key]):
                    losses[replica] = float(self.store.get(key))
                elif self.lighthouse.live.get(replica) == generation:
                    return                       # still on its way
            if self.on_commit:
                self.on_commit(this, losses)
            self.reported += 1

    def _merge(self, results: dict) -> dict:
        """A replica's ranks' results as one: its full parameters (every stage's), generation, committed steps."""
        params = {}
        for rank in sorted(results):
            params.update(results[rank]["params"])
        first = results[min(results)]
        return {"params": params, "generation": first["generation"], "committed": first["committed"],
                "stats": {rank: results[rank]["stats"] for rank in sorted(results)}}


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


STACK_HEADER = "(most recent call first):"     # faulthandler's line above each thread's frames


def ask_for_stacks(procs, outputs: list, wait: float = 2.0) -> list:
    """[(local rank, "f (file:line) <- caller (file:line) <- ...")]: each live rank's innermost frames, which it
    writes to its output file on SIGUSR1 (:func:`faulthandler.register` in :func:`~.replica.replica_main`)."""
    before = [_read(path).count(STACK_HEADER) for path in outputs]
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
    deadline, found = time.monotonic() + wait, {}
    while time.monotonic() < deadline and len(found) < sum(p.is_alive() for p in procs):
        time.sleep(0.05)               # a dump is a few lines written at once: whole by the next look
        for rank, path in enumerate(outputs):
            text = _read(path)
            if text.count(STACK_HEADER) > before[rank]:
                found[rank] = _innermost(text[text.rindex(STACK_HEADER):])
    return [(rank, found.get(rank, "(no stack: the rank did not answer)")) for rank in range(len(procs))]



def _innermost(dump: str, frames: int = 4) -> str:
    found = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', dump)[:frames]
    return " <- ".join(f"{func} ({os.path.basename(path)}:{line})" for path, line, func in found)
