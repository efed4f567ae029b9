"""PipeDream without flushes: micro-batches of the next batch enter before the previous batch's gradients
are applied, so a stage must remember which weights each in-flight micro-batch saw.

* Asynchronous PipeDream with weight stashing (Narayanan et al. 2019): every input is its own
  mini-batch; a stage updates its weights after every backward. An input's forward on stage r uses the
  newest weights there and stashes them for its backward. Under 1F1B that is version j - (p-r-1) for input
  j (stage r has done that many updates): different stages see different ages, p-r-1 updates old.

      W_r(j+1) = W_r(j) - ν ∇_r f_j(W_0(j - p + 1), ..., W_r(j - (p-r-1)), ..., W_{p-1}(j))

* PipeDream-2BW (Narayanan et al. 2021, "Memory-efficient pipeline-parallel DNN training"): a new weight
  version every m micro-batches (one batch), the gradient of batch t taken at the weights of one version
  earlier on every stage, so two buffers suffice (double-buffered weights):

      W(t+1) = W(t) - ν ∇f_t(W(t-1)),        W(-1) = W(0)

Both run as one long 1F1B schedule over all micro-batches of all steps (no flush between batches).
:func:`reference_async` and :func:`reference_2bw` are the update rules on one device; the tests check the
pipeline against them (not against synchronous training, which they are not).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from ..recipe import RunResult
from ..launcher import launch
from ..mesh import Mesh, RankMesh
from .runtime import PipelineRank, synced_clock
from . import schedules
from .schedules import make_schedule
from .stages import _layers, assign, boundary_shapes, split_model, stage_loss
from .timeline import timed

__all__ = ["PipeDreamRank", "PipeDreamRun", "validate", "parallel_train", "run", "reference_2bw", "reference_async"]


@dataclass
class PipeDreamRun(RunResult):
    """A :class:`RunResult` plus the most weight versions one of this rank's stages held at once, the
    version each action used (``versions_used``: (kind, stage, micro-batch, version), kind F or BW, in the
    order this rank ran them) and the rank's ``timeline`` (as :class:`~minipar.pipeline.runtime.PipelineRun`)."""
    most_versions: int = 1
    versions_used: list = field(default_factory=list)
    timeline: list = field(default_factory=list)


class PipeDreamRank(PipelineRank):
    """A pipeline rank that keeps weight versions per stage and updates with SGD (lr ``lr``) on its own.
    ``mode="async"``: update after every micro-batch, stash the newest version at each forward.
    ``mode="2bw"``: update after every ``m`` micro-batches; micro-batches of batch t use version t-1."""

    def __init__(self, *args, mode: str, lr: float, m: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode, self.lr, self.m = mode, lr, m
        self.batch_size_in_microbatches = m
        self.versions = {s: {0: {n: q.detach().clone() for n, q in st.named_parameters()}}
                         for s, st in self.stages.items()}
        self.latest = {s: 0 for s in self.stages}
        self.stash = {}                                     # (stage, mb) -> version used
        self.grad_sum = {}                                  # (stage, batch) -> {name: grad}
        self.done_in_batch = {}
        self.most_versions = 1                              # the most versions a stage held at once
        self.versions_used = []                             # (kind, stage, mb, version) as they ran

    def version_for(self, stage, mb) -> int:
        if self.mode == "async":
            return self.latest[stage]
        batch = mb // self.m
        v = max(batch - 1, 0)
        if v not in self.versions[stage]:
            raise RuntimeError(f"stage {stage} lacks version {v} for micro-batch {mb}: m < p?")
        return v

    def module(self, stage, mb):
        v = self.stash.setdefault((stage, mb), self.version_for(stage, mb))
        self.versions_used.append(("F", stage, mb, v))
        weights = {n: w.requires_grad_() for n, w in self.versions[stage][v].items()}
        return lambda x: functional_call(self.stages[stage], weights, (x,))

    def backward_full(self, stage, mb):
        x, y = self.saved.pop((stage, mb))
        weights = self.versions[stage][self.stash[(stage, mb)]]
        self.versions_used.append(("BW", stage, mb, self.stash[(stage, mb)]))
        inputs = ([x] if stage > 0 else []) + list(weights.values())
        grads = torch.autograd.grad(y, inputs, self.output_grad(stage, mb))
        if stage > 0:
            self.send(grads[0], "grad", stage - 1, mb)
        acc = self.grad_sum.setdefault((stage, mb // self.m), dict.fromkeys(weights, 0))
        for n, g in zip(weights, grads[-len(weights):]):
            acc[n] = acc[n] + g
        self.after_backward(stage, mb)

    def after_backward(self, stage, mb):
        self.stash.pop((stage, mb))
        batch = mb // self.m
        self.done_in_batch[(stage, batch)] = self.done_in_batch.get((stage, batch), 0) + 1
        if self.done_in_batch[(stage, batch)] < self.m:
            return
        grads = self.grad_sum.pop((stage, batch))
        versions = self.versions[stage]
        # keep the newest version and those stashed by micro-batches still in flight on this stage
        keep = {v for (s, _), v in self.stash.items() if s == stage} | {self.latest[stage]}
        for old in [v for v in versions if v not in keep]:
            del versions[old]
        newest = versions[self.latest[stage]]
        self.latest[stage] += 1
        versions[self.latest[stage]] = {n: (w - self.lr * grads[n]).detach() for n, w in newest.items()}
        self.most_versions = max(self.most_versions, len(versions))


def validate(recipe, *, world_size: int, mode: str = "2bw", m: int = 4, **_) -> None:
    """The constraints, as ValueErrors (call before launching)."""
    p = world_size
    if mode not in ("2bw", "async"):
        raise ValueError(f"mode must be '2bw' or 'async', got {mode!r}")
    if mode == "2bw" and m < p:
        raise ValueError(f"PipeDream-2BW needs m >= p micro-batches per batch for two weight buffers to "
                         f"suffice, got m={m}, p={p}")
    micro = recipe.steps * (m if mode == "2bw" else 1)
    if micro < p:
        raise ValueError(f"the 1F1B stream of all micro-batches needs at least p = {p} of them; "
                         f"{recipe.steps} steps give {micro}")
    schedules.validate("1f1b", p, micro, n_layers=len(_layers(recipe.model())[0]))


def parallel_train(rank: int, world_size: int, recipe, *, mode: str = "2bw", m: int = 4, lr: float = 0.1,
                   mesh: RankMesh | None = None) -> PipeDreamRun:
    """Train ``recipe`` with PipeDream-2BW (``m`` micro-batches per batch) or asynchronous PipeDream
    (``mode="async"``: every batch is one input, m = 1). One 1F1B schedule over all micro-batches."""
    mesh = mesh or Mesh(world_size, pp=world_size).build(rank)
    p, pp_rank = mesh.size("pp"), mesh.coord("pp")
    validate(recipe, world_size=p, mode=mode, m=m)
    m = 1 if mode == "async" else m
    inputs = [x for xb, _ in recipe.batches for x in xb.chunk(m)]
    targets = [y for _, yb in recipe.batches for y in yb.chunk(m)]
    sched = make_schedule("1f1b", p, len(inputs))       # no flush: one schedule over all steps
    all_stages = split_model(recipe.model().to(recipe.dtype), p)
    mine = assign(all_stages, p, pp_rank)
    shapes = boundary_shapes(all_stages, inputs[0])
    runner = timed(PipeDreamRank)(sched, mine, mesh, shapes, t0=synced_clock(mesh.group("pp")), mode=mode, lr=lr,
                                  m=m)
    runner.run(inputs, targets)
    losses = None
    if runner.mb_losses:
        losses = [float(sum(runner.mb_losses[b * m + i] for i in range(m))) for b in range(recipe.steps)]
    params = {}
    for s, st in mine.items():
        names = st.param_names
        params.update({names[n]: w.detach().clone() for n, w in runner.versions[s][runner.latest[s]].items()})
    return PipeDreamRun(losses, params, runner.most_versions, runner.versions_used, runner.timeline)


def run(recipe, *, world_size: int, mode: str = "2bw", m: int = 4, lr: float = 0.1, quiet: bool = True) -> list:
    """Check the configuration, then train with PipeDream on ``world_size`` ranks: per-rank runs."""
    validate(recipe, world_size=world_size, mode=mode, m=m)
    return launch(parallel_train, world_size, recipe, mode=mode, m=m, lr=lr, quiet=quiet)


# ----------------------------------------------------------------------------------------------------
# The update rules on one device
# ----------------------------------------------------------------------------------------------------

def _loss_and_grads(model, weights: dict, inputs, targets):
    weights = {n: w.detach().requires_grad_() for n, w in weights.items()}
    loss = stage_loss(functional_call(model, weights, (inputs,)), targets)
    grads = torch.autograd.grad(loss, list(weights.values()))
    return float(loss.detach()), dict(zip(weights, grads))


def reference_2bw(recipe, lr: float = 0.1) -> RunResult:
    """W(t+1) = W(t) - lr ∇f_t(W(t-1)), W(-1) = W(0), on the full model."""
    model = recipe.model().to(recipe.dtype)
    current = {n: q.detach().clone() for n, q in model.named_parameters()}
    previous, losses = current, []
    for x, y in recipe.batches:
        loss, g = _loss_and_grads(model, previous, x, y)
        previous, current = current, {n: w - lr * g[n] for n, w in current.items()}
        losses.append(loss)
    return RunResult(losses, current)


def reference_async(recipe, p: int, lr: float = 0.1) -> RunResult:
    """Input j sees stage r's weights of version max(0, j-(p-r-1)); each stage steps once per input."""
    model = recipe.model().to(recipe.dtype)
    stage_of = {ref: s.index for s in split_model(recipe.model(), p) for ref in s.param_names.values()}
    history = [{n: q.detach().clone() for n, q in model.named_parameters()}]   # history[k]: after k updates
    losses = []
    for j, (x, y) in enumerate(recipe.batches):
        seen = {n: history[max(0, j - (p - stage_of[n] - 1))][n] for n in history[-1]}
        loss, g = _loss_and_grads(model, seen, x, y)
        history.append({n: w - lr * g[n] for n, w in history[-1].items()})
        losses.append(loss)
    return RunResult(losses, history[-1])
