"""The equivalence harness: does a parallel strategy train exactly like one device?

A :class:`Recipe` says what to train: a deterministic model factory, an optimizer factory, the global
batches (one per optimizer step) and a loss (:mod:`minipar.recipe`, which holds it and :class:`RunResult`;
re-exported here). :func:`train_reference` trains it on one device.
A strategy provides ``parallel_train(rank, world_size, recipe, ...)``, run by :func:`minipar.launch`, that
trains the same recipe on every rank and returns a :class:`RunResult`: the losses it saw (or ``None`` on a
rank that never computes the loss, such as an early pipeline stage) and the full parameters it can report,
under the reference model's names (a rank may report only some: a pipeline stage reports its layers; a
sharded strategy gathers its shards first). :func:`check_equivalence` runs both and compares the loss at
every step and every reported parameter at the end. Replicated parameters are compared on every rank that
reports them, so replicas that drift apart are caught too.

A difference passes when ``|parallel - reference| <= atol + rtol * |reference|`` element-wise. The default
tolerances per dtype (:data:`TOLERANCES`) allow for a different order of floating-point summation (an
all-reduce adds the ranks' partial sums in an order a single device does not); ``atol=rtol=0`` asks for
bit-exact equality where the math allows it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .launcher import launch
from .recipe import Recipe, RunResult, default_loss, gpt_recipe, mlp_recipe

__all__ = ["Recipe", "RunResult", "Comparison", "TOLERANCES", "one_thread", "train_reference", "train_steps",
           "compare", "check_equivalence", "gpt_recipe", "mlp_recipe", "default_loss"]

# (atol, rtol) per dtype, for a few optimizer steps of the reference models.
TOLERANCES = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


@dataclass
class Comparison:
    matches: bool
    max_abs_diff: float
    max_rel_diff: float
    worst: str                                      # where the largest difference is
    loss_diffs: list                                # |Δloss| per step (max over reporting ranks)
    atol: float
    rtol: float
    problems: list = field(default_factory=list)    # human-readable reasons for a mismatch

    def __str__(self) -> str:
        """The line a chapter prints: "= one device" with the largest difference and the tolerance it met,
        |Δ| ≤ atol + rtol·|ref| (:data:`TOLERANCES`), or "bit for bit"; on a mismatch, where, and each problem.
        :meth:`details` adds the relative error."""
        if not self.matches:
            return (f"DOES NOT MATCH one device: max |Δ| {self.max_abs_diff:.3g} at {self.worst} (allowed "
                    f"{self.atol:g} + {self.rtol:g}·|ref|)" + "".join(f"\n  - {p}" for p in self.problems))
        if self.atol == 0 and self.rtol == 0:
            return "= one device, bit for bit"
        return f"= one device (max |Δ| {self.max_abs_diff:.0e} ≤ {self.atol:g} + {self.rtol:g}·|ref|)"

    def details(self) -> str:
        """Everything, for a failing test: the largest absolute and relative differences, where, the tolerance."""
        verdict = "matches" if self.matches else "DOES NOT MATCH"
        text = (f"{verdict} single-device training: max |Δ| = {self.max_abs_diff:.3g} "
                f"(max rel {self.max_rel_diff:.3g} where |ref| > atol) at {self.worst}; "
                f"tolerance atol={self.atol:g}, rtol={self.rtol:g}")
        return text + "".join(f"\n  - {p}" for p in self.problems)

    def assert_ok(self) -> "Comparison":
        if not self.matches:
            raise AssertionError(self.details())
        return self


@contextlib.contextmanager
def one_thread():
    """One intra-op thread for the block, as every rank runs (:func:`minipar.launcher.launch`): kernels split
    their sums differently over a different number of threads, which would rule out bit-exact checks; and the
    course's tiny GEMMs gain nothing from a second thread on a shared two-core machine, where it waits for a
    core far longer than it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_reference(recipe: Recipe) -> RunResult:
    """Train ``recipe`` on one device for ``recipe.steps`` optimizer steps, with :func:`one_thread`."""
    with one_thread():
        return _train_reference(recipe)


def _train_reference(recipe: Recipe) -> RunResult:
    model = recipe.model().to(recipe.dtype)
    return train_steps(recipe, model, recipe.optimizer(model.parameters()), recipe.batches)


def train_steps(recipe: Recipe, model, optimizer, batches, after_step=None) -> RunResult:
    """One optimizer step of ``model`` per batch with ``recipe.loss`` (a resumed run: a model and optimizer
    loaded from a checkpoint, the batches after it); its losses and final parameters. ``after_step(model)``
    (optional) runs after each optimizer step: what a strategy does beside the step (a routing bias moved)."""
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = recipe.loss(model, inputs, targets)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(model)
        losses.append(loss.item())
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def _diff(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0):
    """|got − want| and the relative error |got − want| / |want|, the latter only where |want| > ``floor``
    (0 elsewhere): where the reference is ~0 — a gradient that is zero analytically, such as attention's
    key bias — a relative error is rounding noise divided by nothing, and says nothing."""
    got, want = got.detach().double(), want.detach().double()
    abs_diff = (got - want).abs()
    rel = torch.where(want.abs() > floor, abs_diff / want.abs().clamp_min(1e-300), torch.zeros_like(abs_diff))
    return abs_diff, rel


def compare(reference: RunResult, results: list, atol: float | None = None, rtol: float | None = None,
            dtype: torch.dtype = torch.float32, require_all_params: bool = True) -> Comparison:
    """Compare per-rank ``results`` (a list of :class:`RunResult`) with the ``reference`` run."""
    d_atol, d_rtol = TOLERANCES[dtype]
    atol, rtol = (d_atol if atol is None else atol), (d_rtol if rtol is None else rtol)
    problems, max_abs, max_rel, worst = [], 0.0, 0.0, "-"
    steps = len(reference.losses)
    loss_diffs = [0.0] * steps
    reported_losses = reported_params = False
    seen: set = set()

    def account(abs_diff, rel, want, where):
        nonlocal max_abs, max_rel, worst
        a = float(abs_diff.max()) if abs_diff.numel() else 0.0
        if a >= max_abs:
            max_abs, worst = a, where
        max_rel = max(max_rel, float(rel.max()) if rel.numel() else 0.0)
        bad = abs_diff > atol + rtol * want.double().abs()
        if bool(bad.any()) or not math.isfinite(a):
            problems.append(f"{where}: max |Δ| {a:.3g} exceeds atol={atol:g} + rtol={rtol:g}·|ref|")

    for rank, res in enumerate(results):
        if not isinstance(res, RunResult):
            problems.append(f"rank {rank} returned {type(res).__name__}, not a RunResult")
            continue
        if res.losses is not None:
            reported_losses = True
            if len(res.losses) != steps:
                problems.append(f"rank {rank} reported {len(res.losses)} losses for {steps} steps")
                continue
            for s, (got, want) in enumerate(zip(res.losses, reference.losses)):
                a, r = _diff(torch.tensor(got), torch.tensor(want), atol)
                loss_diffs[s] = max(loss_diffs[s], float(a))
                account(a, r, torch.tensor(want), f"loss at step {s} on rank {rank}")
        for name, got in res.params.items():
            reported_params = True
            if name not in reference.params:
                problems.append(f"rank {rank} reported an unknown parameter {name!r}")
                continue
            want = reference.params[name]
            if tuple(got.shape) != tuple(want.shape):
                problems.append(f"{name} on rank {rank}: shape {tuple(got.shape)}, reference {tuple(want.shape)}")
                continue
            seen.add(name)
            a, r = _diff(got, want, atol)
            account(a, r, want, f"{name} on rank {rank}")
    if not reported_losses:
        problems.append("no rank reported its losses")
    if not reported_params:
        problems.append("no rank reported any parameter")
    missing = sorted(set(reference.params) - seen)
    if require_all_params and missing:
        problems.append(f"no rank reported {missing[:5]}{' …' if len(missing) > 5 else ''}")
    return Comparison(not problems, max_abs, max_rel, worst, loss_diffs, atol, rtol, problems)


def check_equivalence(parallel_train: Callable, world_size: int, recipe: Recipe, *args,
                      atol: float | None = None, rtol: float | None = None, launch_kwargs: dict | None = None,
                      **kwargs) -> Comparison:
    """Train ``recipe`` on one device and with ``parallel_train`` on ``world_size`` ranks; compare.

    ``parallel_train(rank, world_size, recipe, *args, **kwargs)`` must return a :class:`RunResult`.
    Returns the :class:`Comparison`; call ``.assert_ok()`` on it in a test.
    """
    reference = train_reference(recipe)
    results = launch(parallel_train, world_size, recipe, *args, **(launch_kwargs or {}), **kwargs)
    return compare(reference, results, atol, rtol, recipe.dtype)
