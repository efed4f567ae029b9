"""Fault-tolerant data parallelism over replica groups, as a library call (torchft's model, on minipar's trainer).

    result = replicas.run(recipe, replicas=3, layout=Layout(tp=2, micro_batches=1),
                          plan=FaultPlan(replica=1, rank=0, step=2))      # replica 1 dies inside step 2
    reference = replicas.committed_reference(recipe, 3, result.committed)  # one device, the committed rows

R replica groups (each ``layout``: 1 rank, dp, tp, pp, cp, ...) train one model data-parallel with each other;
each step's quorum, commit and healing are :mod:`.lighthouse`'s, the average over the live replicas
:class:`~.quorum.CommitGate`'s. A step committed with n of the R replicas trained on their n·B/R rows (the
effective batch shrinks; each row keeps weight 1/(n·B/R)), so the run equals one device that takes, step by
step, exactly the rows of the replicas in the committed quorum: :func:`committed_reference`.

Not yet: ZeRO inside a replica (its optimizer step is fused with the reduce-scatter the gate must come before),
MoE layers, saving a checkpoint of a replicated run. Source: torchft (PyTorch, 2025; "Fault tolerance for
training", torchtitan), whose Manager runs the same per-step quorum, should_commit vote and live recovery.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout import Layout
from ..recipe import Recipe, RunResult
from ..hybrid.parallel3d import DEFAULTS, validate as validate_layout
from .quorum import FAULT_ACTIONS, FAULT_POINTS, FaultPlan
from .replica import ReplicaSpec, replica_recipe
from .supervisor import Supervisor

__all__ = ["ReplicatedRun", "validate", "run", "committed_reference", "uninterrupted_reference", "run_events"]


@dataclass
class ReplicatedRun:
    """What a replicated run saw: ``params`` {replica: full parameters at the end}, ``generations`` {replica:
    how many times it was started again}, ``committed`` [(step, [replicas in its quorum])], ``losses`` [(step,
    mean loss over the quorum's rows, live replicas)], every round's record (``rounds``, aborted ones too), the
    ``deaths`` and the lighthouse's ``events`` ({"t", "kind", ...}: spawn, quorum, heal_start, heal_end,
    commit, abort, death, finish); ``stats`` {replica: {local rank: {"reduced": [(n, payload bytes)] per
    cross-replica all-reduce, "healed_bytes", "state_bytes"}}} of the generation that ended the run."""
    params: dict = field(default_factory=dict)
    generations: dict = field(default_factory=dict)
    committed: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    rounds: list = field(default_factory=list)
    deaths: list = field(default_factory=list)
    events: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def validate(recipe: Recipe, *, replicas: int, layout: Layout | None = None, plan: FaultPlan | None = None,
             **dims) -> Layout:
    """ValueError naming the reason, before any process starts; returns the layout."""
    layout = Layout.of(layout, DEFAULTS, **dims)
    if not isinstance(replicas, int) or replicas < 2:
        raise ValueError(f"a replicated run needs at least 2 replica groups, got {replicas!r} (1 is the plain run)")
    if layout.zero:
        raise ValueError(f"zero={layout.zero} inside a replica: ZeRO fuses its optimizer step with its reduce-scatter, "
                         f"and the commit gate must come between the gradient and the step (use zero=0)")
    if getattr(recipe.model(), "moe", None) is not None:
        raise ValueError("an MoE model in replica groups: its expert gradients and routing bias are not gated yet")
    rows = recipe.batches[0][0].shape[0]
    if rows % replicas:
        raise ValueError(f"a global batch of {rows} rows does not split over {replicas} replicas")
    validate_layout(replica_recipe(recipe, replicas, 0), layout=layout)      # each replica's B/R rows
    if plan is not None:
        if (plan.at not in FAULT_POINTS or plan.action not in FAULT_ACTIONS or not 0 <= plan.replica < replicas
                or not 0 <= plan.rank < layout.world_size):
            raise ValueError(f"{plan} names no rank of this run, or a point not in {FAULT_POINTS}, or an action "
                             f"not in {FAULT_ACTIONS}")
    return layout


def run(recipe: Recipe, *, replicas: int, layout: Layout | None = None, restarts: int = 1, restart_after: int = 1,
        plan: FaultPlan | None = None, join_timeout: float = 10.0, timeout: float = 60.0, on_commit=None,
        on_event=None, **dims) -> ReplicatedRun:
    """Validate, then train ``recipe`` on ``replicas`` replica groups of ``layout`` (its fields as keywords
    also work); a replica that dies is restarted ``restarts`` times, each once ``restart_after`` steps were committed
    without it. ``plan``: a planted fault (a SIGKILL or a hang). ``join_timeout``: seconds a step's quorum waits
    for a replica; a live replica that misses it is stopped as hung (its ranks' stacks printed) and restarted."""
    layout = validate(recipe, replicas=replicas, layout=layout, plan=plan, **dims)
    spec = ReplicaSpec(recipe, replicas, layout, recipe.steps, timeout, plan)
    result = ReplicatedRun()

    def committed(this, losses):
        result.committed.append((this.step, [r for r, _ in this.members]))
        mean = sum(losses.values()) / len(losses) if losses else None
        result.losses.append((this.step, mean, len(this.members)))
        if on_commit:
            on_commit(this, losses)

    supervisor = Supervisor(spec, restarts=restarts, restart_after=restart_after, join_timeout=join_timeout, on_commit=committed,
                            on_event=on_event)
    finals = supervisor.run()
    result.params = {r: v["params"] for r, v in finals.items()}
    result.generations = {r: v["generation"] for r, v in finals.items()}
    result.stats = {r: v["stats"] for r, v in finals.items()}
    result.rounds, result.deaths = supervisor.lighthouse.rounds, supervisor.deaths
    result.events = supervisor.lighthouse.events
    return result


def committed_reference(recipe: Recipe, replicas: int, committed: list) -> RunResult:
    """One device over the batches actually committed: at each committed step, the rows of the replicas in its
    quorum (replica r's contiguous B/R), their mean loss, one optimizer step."""
    model = recipe.model().to(dtype=recipe.dtype)
    optimizer = recipe.optimizer(model.parameters())
    shards = [replica_recipe(recipe, replicas, r).batches for r in range(replicas)]
    losses = []
    for step, members in committed:
        inputs = torch.cat([shards[r][step][0] for r in members])
        targets = torch.cat([shards[r][step][1] for r in members])
        optimizer.zero_grad(set_to_none=True)
        loss = recipe.loss(model, inputs, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def uninterrupted_reference(recipe: Recipe, replicas: int) -> RunResult:
    """The run no replica left: one device over every step's whole batch (the curve to draw beside)."""
    return committed_reference(recipe, replicas, [(s, list(range(replicas))) for s in range(recipe.steps)])


def run_events(result: ReplicatedRun) -> list:
    """The run as a timeline, in time order: one dict per event with ``t`` (seconds) and ``kind``; per step
    ``quorum`` (members), ``commit`` / ``abort`` (why), ``heal_start`` / ``heal_end`` (source, seconds), the
    ``death`` (which rank, how), ``spawn`` and ``finish``; aborted rounds are the lost work."""
    return sorted(result.events, key=lambda e: e["t"])
