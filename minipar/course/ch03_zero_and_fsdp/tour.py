"""Chapter 03 in the tour: ZeRO-1/2/3 and FSDP on 4 ranks, Adam on the tiny GPT.

Each row trains the recipe with one stage, checks it against single-device Adam (default FP32 tolerance of
:mod:`minipar.check`), reads the bytes each rank sent per step from its communication log (mean over ranks
and steps) next to :func:`minipar.data.zero_memory.bytes_sent_per_step`, and the peak live bytes per rank
(model states at the start of a step plus the peak of what the step allocated, gathered parameters
included). The note gives the measured model-state bytes next to the ZeRO paper's formula.
"""
from __future__ import annotations

import functools
import statistics

from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import fsdp, zero, zero_memory
from minipar.launcher import launch
from minipar.course.tour import WORLD_SIZE, TourRow

__all__ = ["STRATEGIES"]


def _recipe():
    return gpt_recipe(steps=3, batch_size=8, seq_len=16, optimizer="adam")


def _row(name, stage, train_fn=None, **kwargs) -> TourRow:
    recipe = _recipe()
    zero.validate(recipe, WORLD_SIZE, stage)
    if train_fn is None:
        results = launch(zero.parallel_train, WORLD_SIZE, recipe, stage, measure=True, quiet=True, **kwargs)
    else:
        results = launch(train_fn, WORLD_SIZE, recipe, measure=True, quiet=True, **kwargs)
    c = compare(train_reference(recipe), results)
    sent = statistics.mean(b for r in results for b in r.bytes_sent)
    psi = results[0].padded_numel
    formula = zero_memory.bytes_sent_per_step(psi, WORLD_SIZE, stage, "fp32")
    states = max(sum(r.memory[k] for k in ("params", "grads", "optimizer")) for r in results)
    want = zero_memory.model_state_bytes(psi, WORLD_SIZE, stage, "fp32")["total"]
    note = f"model states {states} B/rank, formula {want:.0f} B (Ψ={results[0].numel}, padded {psi})"
    return TourRow(name, WORLD_SIZE, c.matches, c.max_abs_diff, sent, formula,
                   max(r.memory["peak"] for r in results), note)


STRATEGIES = [
    ("ZeRO-1", functools.partial(_row, "ZeRO-1 (optimizer states sharded)", 1)),
    ("ZeRO-2", functools.partial(_row, "ZeRO-2 (+ gradients, reduce-scatter)", 2)),
    ("ZeRO-3", functools.partial(_row, "ZeRO-3 (+ parameters, gather/free, prefetch)", 3)),
    ("FSDP", functools.partial(_row, "FSDP units = blocks + root (minipar)", 3, fsdp.parallel_train,
                               units=fsdp.block_units)),
]
