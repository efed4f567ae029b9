"""The equality harness as a debugger: the first step and parameter where a parallel run leaves one device.

:func:`minipar.check.compare` says *whether* a strategy trains like one device, at the end. A wrong gradient
that produces no NaN and no error (a missing all-reduce in a backward, a wrong divisor, a dropped block of
ring attention) needs *where*: record the parameters after every optimizer step on one device
(:func:`reference_steps`) and on every rank of the parallel run (:class:`StepRecorder`, or any list of
``{name: full tensor}`` per step), then :func:`first_departure` walks the steps in order and, within a step, the
parameters in the model's order, and stops at the first one whose departure exceeds the tolerance.

The departure of one tensor is normwise: ``max |parallel − reference| / max |reference|``. A parallel run
adds the same numbers in another order, so even a correct one departs by rounding: a few units of the
dtype's epsilon per operation, growing with the steps (float32: ε = 1.2e-7; float64: 2.2e-16). The tolerance
must sit above that and far below a bug; measuring a correct run in both dtypes gives both numbers
(:func:`max_departure`). In float64 the gap between rounding and a bug is about ten orders of magnitude,
which is why the search runs there. At tolerance 0 it asks for bitwise equality, and a correct parallel run
departs at its first reordered sum: :mod:`minipar.debug.first_diff` names that tensor and the reduction.

Source: the practice of comparing a parallel run with a single-device one step by step at tight tolerance is
Megatron-LM's and torchtitan's answer to "loss differs between TP=1 and TP=2" (their issues ask what range
is acceptable); NVIDIA's Megatron-Core tests compare parallel runs to golden values of a reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..check import one_thread, train_steps
from ..recipe import Recipe

__all__ = ["reference_steps", "StepRecorder", "departure", "max_departure", "Departure", "DepartureSearch", "first_departure"]


def reference_steps(recipe: Recipe) -> list:
    """Train ``recipe`` on one device (one thread, as every rank); ``[{name: parameter after step s}]``."""
    steps = []
    with one_thread():
        model = recipe.model().to(recipe.dtype)
        train_steps(recipe, model, recipe.optimizer(model.parameters()), recipe.batches,
                    after_step=lambda m: steps.append({n: p.detach().clone() for n, p in m.named_parameters()}))
    return steps


class StepRecorder:
    """Keeps a rank's full parameters after each step: ``record(state)`` with ``{name: tensor}`` under the
    reference's names (a sharded model gathers first, e.g. ``TensorParallelGPT.full_state_dict()``)."""

    def __init__(self):
        self.steps = []

    def record(self, state: dict) -> None:
        self.steps.append({n: t.detach().clone() for n, t in state.items()})


def departure(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got − want| / max |want|`` in float64 (absolute when ``want`` is all zeros)."""
    got, want = got.detach().double(), want.detach().double()
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def max_departure(reference: list, ranks: list) -> float:
    """The largest :func:`departure` over every step, parameter and rank (a correct run: its rounding)."""
    return max(departure(steps[s][n], ref[n]) for steps in ranks for s, ref in enumerate(reference)
               for n in ref if n in steps[s])


@dataclass
class Departure:
    step: int
    name: str
    rank: int
    size: float                                   # the normwise departure
    tolerance: float

    def __str__(self) -> str:
        against = (f"{self.size / self.tolerance:.1e} x the tolerance {self.tolerance:.0e}" if self.tolerance
                   else "tolerance 0: not bitwise equal")
        return f"step {self.step}, {self.name} on rank {self.rank}: departs by {self.size:.2e} ({against})"


@dataclass
class DepartureSearch:
    """``first``: the first departure (None: the run stays within tolerance everywhere); ``wrong``: every
    parameter over the tolerance at that step, ``right`` those within it, both in model order. Backward
    visits the parameters roughly in reverse model order, so ``boundary`` — the last wrong one in model
    order — is where the backward first went wrong: the bug sits between it and the right ones after it."""
    first: Departure | None
    tolerance: float
    wrong: list = field(default_factory=list)
    right: list = field(default_factory=list)
    order: list = field(default_factory=list)

    @property
    def boundary(self) -> str | None:
        return self.wrong[-1] if self.wrong else None

    @property
    def reached_first(self) -> list:
        """The right parameters after the boundary in model order: those backward reached before the bug."""
        if not self.wrong:
            return []
        return [n for n in self.order[self.order.index(self.boundary) + 1:] if n in self.right]

    def __str__(self) -> str:
        if self.first is None:
            within = f"within {self.tolerance:.0e} of" if self.tolerance else "bitwise equal to"
            return f"{within} one device at every step and parameter"
        listed = f" ({_names(self.wrong, 6)})" if len(self.wrong) <= 6 else ""
        return (f"first departure: {self.first}\n  at step {self.first.step}: {len(self.wrong)} of "
                f"{len(self.order)} parameters depart{listed}; in backward order the first to depart is "
                f"{self.boundary}, after {_names(self.reached_first[::-1]) or 'none'} (right)")


def _names(names, most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" (+{len(names) - most})" if len(names) > most else "")


def first_departure(reference: list, ranks: list, tolerance: float) -> DepartureSearch:
    """The first (step, parameter in the reference's order, rank) whose departure exceeds ``tolerance``.
    ``reference``: :func:`reference_steps`; ``ranks``: each rank's steps (a rank may report some parameters).
    ``tolerance`` 0 asks for bitwise equality: the first tensor that differs in any bit (the departure of two
    float32 or float64 tensors is exact in float64, so it is 0 only when they are equal)."""
    if not tolerance >= 0:
        raise ValueError(f"the tolerance is a departure, 0 (bitwise) or more; got {tolerance}")
    if any(len(r) != len(reference) for r in ranks):
        raise ValueError(f"the reference has {len(reference)} steps, the ranks {[len(r) for r in ranks]}")
    for s, ref in enumerate(reference):
        worst = {}                                # name -> (departure, rank), in model order
        for name in ref:
            for rank, steps in enumerate(ranks):
                if name in steps[s]:
                    d = departure(steps[s][name], ref[name])
                    if d > worst.get(name, (-1.0, 0))[0]:
                        worst[name] = (d, rank)
        wrong = [n for n, (d, _) in worst.items() if d > tolerance]
        if wrong:
            d, rank = worst[wrong[0]]
            return DepartureSearch(Departure(s, wrong[0], rank, d, tolerance), tolerance, wrong,
                                   [n for n in worst if n not in wrong], list(worst))
    return DepartureSearch(None, tolerance)
