"""The lighthouse: who is in the quorum of each round, and whether the round's step is committed.

It runs inside the supervising process (:mod:`.supervisor`), which outlives every replica, and talks to the ranks
only through a store (a ``FileStore`` in the supervisor's folder). Rounds are numbered k = 0, 1, 2, ...; a round
is one attempt at one step::

    forming   replica r's local rank 0 writes  ready/{k}/{r} = {"gen", "step": its committed steps}
              the quorum is every live replica registered once all expected ones are, or ``join_timeout`` s
              after the round began if some are not; expected: the live replicas but those that missed a
              deadline and those restarted and not yet in a quorum (the others go on while it starts; only
              the last step waits for it, so that it ends with the run's parameters)
              -> quorum/{k} = {"id", "members": [[r, gen]...], "step": s, "heal": {r: source}}
    voting    each rank of each member writes  vote/{k}/{r}/{i} = {"ok", "why", "heal_s"}  after its
              cross-replica all-reduce (before its optimizer step)
              commit iff every member's every rank voted ok; abort at the first failed vote, at a member's
              death, or ``vote_timeout`` s after the quorum -> decision/{k} = "commit" | "abort"

s is the number of steps committed so far; a member behind s (a restarted replica) heals from the first member
at s. The quorum id changes when the members (replica, generation) change or the previous round aborted (its
group may be broken): the ranks then build a fresh group. Time in the events is seconds since the lighthouse
started.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

__all__ = ["Round", "Lighthouse", "NoQuorum"]


class NoQuorum(RuntimeError):
    """No quorum can be formed: every replica is gone, no live replica holds the committed state, or the rounds
    keep aborting."""


@dataclass
class Round:
    """One attempt at one step: its quorum, and what became of it (``outcome`` "commit" / "abort")."""
    index: int
    quorum_id: int
    step: int
    members: list                    # [(replica, generation)]
    heal: dict                       # {healing replica: source replica}
    started: float
    decided: float | None = None
    outcome: str | None = None
    why: str = ""
    heal_seconds: dict = field(default_factory=dict)     # {replica: seconds its slowest rank spent healing}


class Lighthouse:
    """The quorum and commit decisions of a replicated run (see the module docstring); ``poll()`` advances them,
    the supervisor tells it who was ``spawned``, who ``died`` and who ``finished``."""

    def __init__(self, store, *, steps: int, ranks_per_replica: int, join_timeout: float, vote_timeout: float,
                 max_aborts: int = 5, clock=time.monotonic):
        self.store, self.steps, self.ranks = store, steps, ranks_per_replica
        self.join_timeout, self.vote_timeout, self.max_aborts, self.clock = join_timeout, vote_timeout, max_aborts, clock
        self.t0 = clock()
        self.live: dict = {}              # replica -> generation of its running processes
        self.laggards: set = set()        # live replicas that missed a deadline: not waited for again
        self.joining: set = set()         # restarted replicas not yet in a quorum
        self.committed = 0                # steps committed so far
        self.rounds: list = []            # every Round, aborted ones included
        self.events: list = []            # {"t", "kind", ...}
        self.k, self.phase, self.t_phase = 0, "forming", clock()
        self.quorum_id, self.aborts_in_a_row = 0, 0

    def now(self) -> float:
        return self.clock() - self.t0

    def event(self, kind: str, **fields) -> None:
        self.events.append({"t": self.now(), "kind": kind, **fields})

    # --- what the supervisor tells it -----------------------------------------------------------------------
    def spawned(self, replica: int, generation: int, pids: list) -> None:
        self.live[replica] = generation
        self.laggards.discard(replica)
        if self.rounds:                   # a restart: the others do not wait for it (but the last step does)
            self.joining.add(replica)
        self.event("spawn", replica=replica, generation=generation, pids=pids)

    def died(self, replica: int, why: str) -> None:
        generation = self.live.pop(replica, None)
        self.laggards.discard(replica)
        self.joining.discard(replica)
        self.event("death", replica=replica, generation=generation, why=why, step=self.committed)
        current = self.rounds[-1] if self.rounds else None
        if self.phase == "voting" and (replica, generation) in current.members:
            self._decide("abort", f"replica {replica} died during step {current.step}")

    def finished(self, replica: int) -> None:
        self.event("finish", replica=replica, generation=self.live.pop(replica, None), step=self.committed)

    @property
    def done(self) -> bool:
        return self.committed >= self.steps

    # --- the rounds ------------------------------------------------------------------------------------------
    def poll(self) -> None:
        if self.phase == "forming" and not self.done:
            self._form()
        elif self.phase == "voting":
            self._tally()

    def _read(self, key: str):
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _form(self) -> None:
        if not self.live:
            raise NoQuorum(f"every replica is gone at step {self.committed} of {self.steps}")
        registered = {}
        for replica, generation in self.live.items():
            info = self._read(f"ready/{self.k}/{replica}")
            if info is not None and info["gen"] == generation:
                registered[replica] = info
        expected = set(self.live) - self.laggards - self.joining
        if self.committed == self.steps - 1:          # the last step waits for a restarted replica on its way
            expected |= self.joining
        if not registered or (not expected <= set(registered) and self.clock() - self.t_phase < self.join_timeout):
            return
        self.laggards |= expected - set(registered)
        members = sorted(registered)
        sources = [r for r in members if registered[r]["step"] == self.committed]
        if not sources:
            raise NoQuorum(f"no live replica holds the {self.committed} committed steps (replicas {members} are at "
                           f"{[registered[r]['step'] for r in members]}): nothing to heal from")
        heal = {r: sources[0] for r in members if registered[r]["step"] != self.committed}
        ident = [(r, self.live[r]) for r in members]
        previous = self.rounds[-1] if self.rounds else None
        if previous is None or previous.members != ident or previous.outcome == "abort":
            self.quorum_id += 1
        this = Round(self.k, self.quorum_id, self.committed, ident, heal, self.now())
        self.rounds.append(this)
        self.store.set(f"quorum/{self.k}", json.dumps({"id": this.quorum_id, "members": ident, "step": this.step,
                                                       "heal": {str(r): s for r, s in heal.items()}}))
        self.store.set("latest", str(self.k))
        self.laggards -= set(members)
        self.joining -= set(members)
        for healer, source in heal.items():
            self.event("heal_start", replica=healer, source=source, step=this.step, round=this.index)
        self.event("quorum", round=this.index, step=this.step, members=[r for r, _ in ident], id=this.quorum_id)
        self.phase, self.t_phase = "voting", self.clock()

    def _tally(self) -> None:
        this = self.rounds[-1]
        votes, missing = [], False
        for replica, _ in this.members:
            for rank in range(self.ranks):
                vote = self._read(f"vote/{this.index}/{replica}/{rank}")
                if vote is None:
                    missing = True
                    continue
                if not vote["ok"]:
                    return self._decide("abort", f"replica {replica} rank {rank}: {vote['why']}")
                if vote.get("heal_s") is not None:
                    this.heal_seconds[replica] = max(this.heal_seconds.get(replica, 0.0), vote["heal_s"])
                votes.append(vote)
        if not missing:
            return self._decide("commit", "")
        if self.clock() - self.t_phase > self.vote_timeout:
            late = [r for r, _ in this.members if not all(self.store.check([f"vote/{this.index}/{r}/{i}"])
                                                          for i in range(self.ranks))]
            self._decide("abort", f"replicas {late} did not finish step {this.step} within {self.vote_timeout:g} s")

    def _decide(self, outcome: str, why: str) -> None:
        this = self.rounds[-1]
        this.outcome, this.why, this.decided = outcome, why, self.now()
        self.store.set(f"decision/{this.index}", outcome)
        for healer, seconds in this.heal_seconds.items():     # healed, whatever became of the step after it
            self.event("heal_end", replica=healer, source=this.heal.get(healer), step=this.step, round=this.index,
                       seconds=seconds)
        if outcome == "commit":
            self.committed += 1
            self.aborts_in_a_row = 0
        else:
            self.aborts_in_a_row += 1
        self.event(outcome, round=this.index, step=this.step, members=[r for r, _ in this.members], why=why)
        self.k, self.phase, self.t_phase = self.k + 1, "forming", self.clock()
        if self.aborts_in_a_row > self.max_aborts:
            raise NoQuorum(f"{self.aborts_in_a_row} rounds in a row aborted at step {this.step}; the last: {why}")

    def committed_rounds(self) -> list:
        return [r for r in self.rounds if r.outcome == "commit"]
