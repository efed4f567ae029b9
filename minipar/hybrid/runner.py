"""The 3D/5D trainer's loop and launch: :func:`parallel_train` (one rank: :class:`~.parallel3d.Trainer3D` over the
recipe's batches, plus what it measured, bytes per kind from the group-tagged logs) and :func:`run` (validate,
then launch). It imports :mod:`minipar.hybrid.parallel3d`, not the other way round: import them from here."""
from __future__ import annotations

import functools

import time
from dataclasses import dataclass, field

import torch

from ..recipe import Recipe, RunResult
from .. import launcher
from ..layout import Layout
from ..memory import LiveTensorTracker
from .parallel3d import DEFAULTS, Trainer3D, validate

__all__ = ["HybridRun", "parallel_train", "run"]


@dataclass
class HybridRun(RunResult):
    """A rank's :class:`RunResult` plus its measurements: ``bytes_by_kind`` {"dp", "pp", "tp" (+ "cp"; an MoE
    model: + "ep", "edp", "balance"): model bytes per step, mean over steps}, ``observed`` {"dp", "pp+tp", "total": bytes the sockets took, per step},
    ``calls_by_kind``, ``step_seconds``, ``peak_bytes`` (model states + live tensors during a step), the
    pipeline ``timeline`` and ``model_state_bytes`` at the end; ``coords``: the mesh coordinates by name."""
    coords: dict = field(default_factory=dict)
    bytes_by_kind: dict = field(default_factory=dict)
    calls_by_kind: dict = field(default_factory=dict)
    observed: dict = field(default_factory=dict)
    step_seconds: list = field(default_factory=list)
    peak_bytes: int = 0
    timeline: list = field(default_factory=list)
    model_state_bytes: int = 0


def _resized(tracker, nbytes: int) -> None:
    """ZeRO's report of storage it resized by hand (gathered or freed parameters, gradient buffers)."""
    tracker.current += nbytes
    tracker.peak = max(tracker.peak, tracker.current)


def parallel_train(rank: int, world_size: int, recipe: Recipe, *, layout: Layout | None = None,
                   track_memory: bool = False, device="cpu", invariant: bool = False, **dims) -> HybridRun:
    """Train ``recipe`` on this rank of a dp × pp × tp mesh (``layout``, or its fields as keywords; on
    ``device``); return its losses (last stage only, floats), its stages' full parameters (CPU tensors) and
    what it measured. ``invariant``: in the invariant mode (:mod:`minipar.invariant_mode`)."""
    t = Trainer3D(rank, world_size, recipe, layout=layout, device=device, invariant=invariant, **dims)
    losses, seconds, peak = [], [], 0
    for i, (inputs, targets) in enumerate(recipe.batches):
        start = time.perf_counter()
        if track_memory and i == len(recipe.batches) - 1:        # the last step: states exist already
            base = t.measured_state_bytes_total()
            with LiveTensorTracker() as tracker:
                if t.zero is not None:            # storage ZeRO resizes by hand is invisible to the dispatcher
                    t.zero.on_alloc = functools.partial(_resized, tracker)
                try:
                    loss = t.step(inputs, targets, i)
                finally:
                    if t.zero is not None:
                        t.zero.on_alloc = None
            peak = base + tracker.peak
        else:
            loss = t.step(inputs, targets, i)
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
    steps = len(recipe.batches)
    kinds = {"dp": (t.logs["dp"], t.mesh.mesh.key(("dp", "cp"))),       # kind: its log, the dims its group spans
             **{k: (t.logs["pp+tp"], (k,)) for k in ("pp", "tp", "cp") if k != "cp" or t.layout.cp > 1}}
    if t.experts:                      # MoE: the folded groups' records carry their tag (minipar.hybrid.experts.Tag)
        kinds |= {"ep": (t.logs["pp+tp"], ("ep",)), "balance": (t.logs["pp+tp"], ("balance",)),
                  "edp": (t.logs["dp"], ("edp",))}
    by_kind = {k: (log.bytes_by_dims().get(dims, 0) if dims else 0) / steps for k, (log, dims) in kinds.items()}
    calls = {k: sum(bool(dims) and r.dims == dims and r.op != "recv" for r in log.records) / steps
             for k, (log, dims) in kinds.items()}
    observed = {k: (log.observed_bytes_sent or 0) / steps for k, log in t.logs.items()}
    return HybridRun(losses if losses[0] is not None else None, t.full_params(), t.coords, by_kind, calls,
                     observed, seconds, peak, t.pipeline.timeline, t.measured_state_bytes_total())


def run(recipe: Recipe, *, world_size: int | None = None, layout: Layout | None = None, track_memory: bool = False,
        device="cpu", quiet: bool = True, timeout: float = 120.0, invariant: bool = False, **dims) -> list:
    """Validate the layout (a :class:`~minipar.layout.Layout` or its fields as keywords), then train on
    ``world_size`` ranks (default: the layout's); return the per-rank :class:`HybridRun`.
    ``device="cpu"``: gloo; ``"cuda"``: NCCL, rank r on GPU r (the launcher makes it the rank's current one)."""
    layout = Layout.of(layout, DEFAULTS, **dims)
    world_size = layout.world_size if world_size is None else world_size
    validate(recipe, world_size=world_size, layout=layout, invariant=invariant)
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    return launcher.launch(parallel_train, world_size, recipe, layout=layout, track_memory=track_memory, device=device,
                           backend=backend, quiet=quiet, timeout=timeout, invariant=invariant)
