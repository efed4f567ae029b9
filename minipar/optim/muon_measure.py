"""What a distributed Muon run sent and held, measured from outside the strategy: bytes per step from the comm
log (:func:`minipar.comm.recording`), the optimizer state from its tensors, and the peak of the tensors the
optimizer step creates (:class:`minipar.memory.LiveTensorTracker`: gathered matrices and Newton–Schulz's
iterates). :mod:`.muon_sharded` and :mod:`.muon_tp` state the formulas these are checked against.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .. import comm
from ..memory import LiveTensorTracker, tensor_bytes
from ..recipe import Recipe, RunResult
from .muon_sharded import ShardedMuon
from .muon_tp import TensorParallelMuon

__all__ = ["MeasuredMuon", "measured_sharded", "measured_tp"]


@dataclass
class MeasuredMuon(RunResult):
    bytes_sent: list = field(default_factory=list)          # per step: the log's bytes (the whole step)
    step_bytes_sent: list = field(default_factory=list)     # per step: the optimizer step's alone
    step_peak: list = field(default_factory=list)           # per step: peak bytes the optimizer step created
    state_bytes: int = 0                                    # Muon momenta + AdamW moments on this rank
    observed: list = field(default_factory=list)            # per step: bytes the sockets carried (None: unknown)


def _measured(cls):
    class Measured(cls):
        def optimizer_step(self):
            with comm.recording() as log, LiveTensorTracker() as tracker:
                super().optimizer_step()
            self.step_logs.append(log.bytes_sent)
            self.step_peaks.append(tracker.peak)
    Measured.__name__ = f"Measured{cls.__name__}"
    return Measured


def _train(trainer, recipe: Recipe) -> MeasuredMuon:
    trainer.step_logs, trainer.step_peaks = [], []
    losses, sent, observed = [], [], []
    for batch in recipe.batches:
        with comm.recording() as log:
            losses.append(trainer.train_step(recipe, batch))
        sent.append(log.bytes_sent)
        observed.append(log.observed_bytes_sent)
    state = tensor_bytes(trainer.state_tensors()) if hasattr(trainer, "state_tensors") else 0
    return MeasuredMuon(losses, trainer.full_params(), sent, trainer.step_logs, trainer.step_peaks, state,
                       observed)


def measured_sharded(rank, world_size, recipe: Recipe, *, sharding: str, method: str, group=None) -> MeasuredMuon:
    """:func:`.muon_sharded.parallel_train`, measured."""
    group = group if group is not None else dist.group.WORLD
    model = recipe.model().to(recipe.dtype)
    return _train(_measured(ShardedMuon)(model, recipe.optimizer, group, sharding, method), recipe)


def measured_tp(rank, world_size, recipe: Recipe, *, method: str, group=None) -> MeasuredMuon:
    """:func:`.muon_tp.parallel_train`, measured."""
    group = group if group is not None else dist.group.WORLD
    model = recipe.model().to(recipe.dtype)
    return _train(_measured(TensorParallelMuon)(model, recipe.optimizer, group, method), recipe)
