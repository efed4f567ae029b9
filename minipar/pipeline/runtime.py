"""Train with a pipeline schedule: each rank runs its action list, passing activations forward and
gradients backward with point-to-point messages (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021).

Per step, the global batch is cut into m equal micro-batches and each micro-batch's loss is divided by m,
so the gradients summed over micro-batches are those of the global-batch mean loss:

    ∇L = ∇ (1/m) Σ_i L_i       (L_i the mean loss of micro-batch i; equal micro-batch sizes)

and one optimizer step on them equals single-device training up to the order of float summation: within
``minipar.check``'s tolerances (float32: atol 2e-5, rtol 1e-4, observed max |Δ| ~1e-5 after a few Adam
steps; float64: atol 1e-10, rtol 1e-9, observed ~1e-14).

Why it cannot deadlock: sends are ``isend`` (posted, never waited for until they complete on their own) and
a rank blocks only on the ``irecv`` of the input its next action needs. Every message carries a tag naming
(kind, stage, micro-batch), so a receive matches its own message whatever order the peer sent them in. A
rank then waits only for actions that come earlier in the dependency graph, which is acyclic for every
valid schedule (:func:`minipar.pipeline.checker.check` plays its messages, without processes).

The loss is an argument (``loss_fn(output, targets)``, as ``torch.distributed.pipelining`` takes it): the last
stage's output goes through it (:func:`~minipar.pipeline.stages.stage_loss` by default; the 3D trainer passes
the vocabulary-parallel cross-entropy). The rank that holds a stage is the schedule's to say
(``Schedule.rank_of``: round-robin, or the V of ZB-V / DualPipeV), and which messages an action sends and
receives, with their peers and tags, is the lowering's (:func:`minipar.pipeline.lowering.lower`, which the
checker and the simulator read too); a neighbour stage on the same rank gets its tensor handed over locally,
without a message.

Measurement and pacing are not in this file, which only executes the schedule: they are mix-ins fed by its
seams, :meth:`PipelineRank.begin_step`, :meth:`~PipelineRank.begin_action`, :meth:`~PipelineRank.post` (a
send), :meth:`~PipelineRank.wait_for` (a receive) and :meth:`~PipelineRank.action_done`.
:mod:`minipar.pipeline.timeline` records what each rank did and when (``timed(cls)``; :func:`parallel_train`
always uses it), :mod:`minipar.pipeline.paced` holds every action to a calibrated slot (``paced(cls)``).

The B/W split of zero-bubble schedules uses ``torch.autograd.grad`` twice on the stage's graph: B asks for
the input gradient (keeping the graph), W for the parameter gradients. That is exact, but W walks the graph
again, so its cost here is close to a whole backward; a real implementation splits each matmul's backward
(dX = dY Wᵀ now, dW = Xᵀ dY later). The simulator shows the schedule's effect with honest costs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from .. import canonical, comm
from ..invariant_mode import active as invariant_active
from ..recipe import RunResult
from ..memory import LiveTensorTracker
from ..mesh import Mesh, RankMesh
from ..launcher import launch
from ..tensor.layers import recompute_context_fn
from . import paced, schedules
from .actions import Action, Schedule
from .lowering import lower, rank_messages
from .schedules import make_schedule
from .stages import _layers, assign, boundary_shapes, split_model, stage_loss
from .timeline import measured_idle_fraction, step_rows, timed, typical_step  # noqa: F401 (public here too)

__all__ = ["PipelineRank", "PipelineRun", "parallel_train", "run", "validate", "synced_clock",
           "step_rows", "measured_idle_fraction", "typical_step"]


@dataclass
class PipelineRun(RunResult):
    """A :class:`RunResult` plus what the rank recorded: ``timeline`` rows (step, kind, stage, microbatch,
    start, end) with kind F/B/W/BW, ``wait`` (blocked in a receive) or ``send``; ``memory`` rows (time,
    live bytes) after each action; bytes this rank sent."""
    timeline: list = field(default_factory=list)
    memory: list = field(default_factory=list)
    bytes_sent: int = 0
    pace: object = None          # the paced run's minipar.pipeline.paced.Pace (None: unpaced)
    overruns: int = 0            # paced: actions whose compute outlasted their slot


def synced_clock(group=None, device="cpu") -> float:
    """Rank 0's ``perf_counter`` now, broadcast (on ``device``): all ranks' timelines on one time axis."""
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64, device=device)
    comm.broadcast(t0, src=torch.distributed.get_process_group_ranks(group)[0] if group else 0, group=group)
    return float(t0)


class PipelineRank:
    """One rank's part of the pipeline: its stages, its action list, its messages (received on ``device``);
    the last stage's output goes through ``loss_fn(output, targets)``."""

    def __init__(self, schedule: Schedule, stages: dict, mesh: RankMesh, shapes: list,
                 recompute: bool = False, t0: float = 0.0, device="cpu", loss_fn=stage_loss):
        self.schedule, self.stages, self.shapes, self.device = schedule, stages, shapes, torch.device(device)
        self.pp_ranks, self.group, self.pp_rank = mesh.ranks("pp"), mesh.group("pp"), mesh.coord("pp")
        self.program = lower(schedule)[self.pp_rank]      # the actions with their sends and receives
        self.actions = [x for x in self.program if isinstance(x, Action)]
        self.incoming, self.outgoing = rank_messages(self.program)   # {(what, stage, micro-batch): Message}
        self.recompute, self.t0, self.loss_fn = recompute, t0, loss_fn
        self.last = schedule.num_stages - 1
        self.batch_size_in_microbatches = None   # None: the micro-batches of one run() are one batch

    # -- messages: peers and tags as the lowering (minipar.pipeline.lowering) lists them ----------------------
    def send(self, t, what, to_stage, microbatch):
        """The activation entering ``to_stage`` or the gradient of ``to_stage``'s output: a message if the
        lowering lists one, else a local hand-over (this rank holds ``to_stage``: the turn of a V)."""
        msg = self.outgoing.get((what, to_stage, microbatch))
        if msg is None:
            self.local[(what, to_stage, microbatch)] = t
            return
        self.post(t.contiguous(), self.pp_ranks[msg.dst], msg.tag(self.n_micro), to_stage, microbatch)

    def post(self, t, dst: int, tag: int, to_stage: int, microbatch: int) -> None:
        """Post one message (``isend``: never waited for until it completes on its own)."""
        self.pending_sends.append((comm.isend(t, dst, self.group, tag), t))

    def receive(self, what, stage, microbatch):
        """The activation entering ``stage`` (from stage-1) or the gradient of its output (from stage+1)."""
        msg = self.incoming.get((what, stage, microbatch))
        if msg is None:
            return self.local.pop((what, stage, microbatch))
        shape, dtype = self.shapes[stage if what == "act" else stage + 1]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.wait_for(buf, self.pp_ranks[msg.src], msg.tag(self.n_micro), stage, microbatch)
        return buf

    def wait_for(self, buf, src: int, tag: int, stage: int, microbatch: int) -> None:
        """Receive into ``buf``, blocking; ``input_arrived``: when it came (on :meth:`clock`)."""
        comm.irecv(buf, src, self.group, tag).wait()
        self.input_arrived = self.clock()

    def clock(self) -> float:
        """Seconds since ``t0`` (a clock synchronised over the pipeline by :func:`synced_clock`)."""
        return time.perf_counter() - self.t0

    def begin_step(self) -> None:
        """Called before a step's first action (paced mode starts its slots here)."""

    def begin_action(self, action) -> None:
        """Called before each action; ``input_arrived`` stays 0 unless the action receives its input."""
        self.action, self.input_arrived = action, 0.0

    def action_done(self, kind: str) -> None:
        """Called when an action has computed (paced mode holds it to its slot here)."""

    # -- compute ----------------------------------------------------------------------------------------
    def module(self, stage: int, microbatch: int):
        """The module that runs ``stage`` for ``microbatch`` (PipeDream overrides this: weight versions)."""
        return self.stages[stage]

    def forward(self, stage, mb):
        x = self.inputs[mb] if stage == 0 else self.receive("act", stage, mb).requires_grad_()
        module = self.module(stage, mb)
        if self.recompute:                          # TP dropout streams replay the forward's masks
            y = checkpoint(module, x, use_reentrant=False, context_fn=recompute_context_fn(module))
        else:
            y = module(x)
        if stage == self.last:
            y = self.loss_fn(y, self.targets[mb]) / self.loss_divisor   # mean over the global batch
            self.mb_losses[mb] = y.detach()
        else:
            self.send(y.detach(), "act", stage + 1, mb)
        self.saved[(stage, mb)] = (x, y)

    def output_grad(self, stage, mb):
        return None if stage == self.last else self.receive("grad", stage, mb)

    def backward_full(self, stage, mb):
        x, y = self.saved.pop((stage, mb))
        torch.autograd.backward(y, self.output_grad(stage, mb))
        if stage > 0:
            self.send(x.grad, "grad", stage - 1, mb)
        self.after_backward(stage, mb)

    def backward_input(self, stage, mb):
        x, y = self.saved[(stage, mb)]
        dy = self.output_grad(stage, mb)
        if stage > 0:   # stage 0's input is data: nothing to send upstream
            (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
            self.send(dx, "grad", stage - 1, mb)
        self.saved[(stage, mb)] = (dy, y)

    def backward_weight(self, stage, mb):
        dy, y = self.saved.pop((stage, mb))
        params = [p for p in self.module(stage, mb).parameters() if p.requires_grad]
        for p, g in zip(params, torch.autograd.grad(y, params, dy, allow_unused=True)):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self.after_backward(stage, mb)

    def after_backward(self, stage, mb):
        """Called once a micro-batch's weight gradient on ``stage`` is done (PipeDream updates here)."""

    # -- one step ---------------------------------------------------------------------------------------
    def run(self, inputs: list, targets: list, step_index: int = 0):
        """Execute this rank's actions for one global batch; return the loss (last stage) or None."""
        self.inputs, self.targets, self.n_micro = inputs, targets, len(inputs)
        self.step_index, self.saved, self.pending_sends, self.local = step_index, {}, [], {}
        self.begin_step()
        self.loss_divisor = self.batch_size_in_microbatches or self.n_micro
        self.mb_losses = {}
        do = {"F": self.forward, "BW": self.backward_full, "B": self.backward_input, "W": self.backward_weight}
        for a in self.actions:
            self.begin_action(a)
            do[a.kind](a.stage, a.microbatch)
            self.action_done(a.kind)
            self.pending_sends = [(w, t) for w, t in self.pending_sends if not w.is_completed()]
        for work, _ in self.pending_sends:
            work.wait()
        if not any(s == self.last for s in self.stages):
            return None
        losses = [self.mb_losses[i] for i in sorted(self.mb_losses)]
        # the invariant mode: the micro-batches' losses summed as the same tree as one batch's tokens
        return float(canonical.tree_sum(torch.stack(losses)) if invariant_active() else sum(losses))


def parallel_train(rank: int, world_size: int, recipe, *, schedule: str = "1f1b", m: int = 4, v: int = 1,
                   recompute: bool = False, mesh: RankMesh | None = None, track_memory: bool = False,
                   rank_class=PipelineRank, pace=None, loss_fn=stage_loss) -> PipelineRun:
    """Train ``recipe`` with ``schedule`` on a pipeline of all ranks (or ``mesh``'s pp dimension).
    ``pace``: None (as fast as it goes), ``"auto"`` (slots calibrated, :func:`minipar.pipeline.paced.calibrate`),
    a dict of its keyword arguments, or a :class:`~minipar.pipeline.paced.Pace` (fixed slots, seconds);
    ``loss_fn(output, targets)``: the loss of the last stage's output.
    Returns this rank's :class:`PipelineRun` (its stages' parameters, the losses on the last rank)."""
    mesh = mesh or Mesh(world_size, pp=world_size).build(rank)
    p, pp_rank = mesh.size("pp"), mesh.coord("pp")
    sched = make_schedule(schedule, p, m, v)
    all_stages = split_model(recipe.model().to(recipe.dtype), p * v)
    mine = assign(all_stages, p, pp_rank, sched.placement)
    params = [q for s in mine.values() for q in s.parameters()]
    opt = recipe.optimizer(params)
    first_x = recipe.batches[0][0]
    if first_x.shape[0] % m:
        raise ValueError(f"a global batch of {first_x.shape[0]} cannot be cut into m={m} equal micro-batches")
    shapes = boundary_shapes(all_stages, first_x[: first_x.shape[0] // m])
    del all_stages
    rank_class = timed(rank_class)                   # the timeline and memory rows, beside the runtime
    if pace is not None:
        rank_class = paced.paced(rank_class)
    runner = rank_class(sched, mine, mesh, shapes, recompute, synced_clock(mesh.group("pp")), loss_fn=loss_fn)
    if pace is not None:     # before the log: the calibration's barriers are not the pipeline's traffic
        runner.pace = paced.resolve(pace, runner, list(first_x.chunk(m)), list(recipe.batches[0][1].chunk(m)))
    losses = []
    with comm.recording() as log:
        for step, (inputs, targets) in enumerate(recipe.batches):
            opt.zero_grad(set_to_none=True)
            tracker = LiveTensorTracker() if track_memory else None
            if tracker is not None:
                with tracker:
                    loss = runner.run(list(inputs.chunk(m)), list(targets.chunk(m)), step, tracker)
            else:
                loss = runner.run(list(inputs.chunk(m)), list(targets.chunk(m)), step)
            opt.step()
            losses.append(loss)
    reported = {name: t for s in mine.values() for name, t in s.reference_params().items()}
    return PipelineRun(losses if losses[0] is not None else None, reported,
                       runner.timeline, runner.memory, log.bytes_sent, getattr(runner, "pace", None),
                       getattr(runner, "overruns", 0))


def validate(recipe, *, world_size: int, schedule: str = "1f1b", m: int = 4, v: int = 1, pace=None, **_) -> None:
    """Every constraint of a pipeline run, checked before any process starts (ValueError naming it)."""
    paced.check(pace)
    schedules.validate(schedule, world_size, m, v, n_layers=len(_layers(recipe.model())[0]))
    batch = recipe.batches[0][0].shape[0]
    if batch % m:
        raise ValueError(f"a global batch of {batch} cannot be cut into m={m} equal micro-batches")


def run(recipe, *, world_size: int, schedule: str = "1f1b", m: int = 4, v: int = 1, quiet: bool = True,
        **config) -> list:
    """Check the configuration, then run :func:`parallel_train` on ``world_size`` ranks (one stage group
    each); return the per-rank :class:`PipelineRun`."""
    validate(recipe, world_size=world_size, schedule=schedule, m=m, v=v, **config)
    return launch(parallel_train, world_size, recipe, schedule=schedule, m=m, v=v, quiet=quiet, **config)
