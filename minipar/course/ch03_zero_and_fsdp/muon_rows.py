"""Chapter 03's Muon rows: Muon + AdamW (float64, Newton–Schulz in float64) on the MLP [16, 64, 96, 64, 8],
4 ranks, under ZeRO-1, per-parameter FSDP and tensor parallelism (:mod:`minipar.optim.muon_sharded`,
:mod:`minipar.optim.muon_tp`), each checked against one device's Muon (:mod:`minipar.optim.muon`, float64
tolerance). Every row's note gives how far per-shard Newton–Schulz — the wrong one — lands from one device in
the same launch, so the table shows why the optimizer is part of the parallel design.

Bytes per rank per step (mean over ranks and steps): the comm log's model beside the module's formula
(:func:`minipar.optim.muon_sharded.bytes_per_step`; TP: the optimizer step's own bytes,
:func:`minipar.optim.muon_tp.step_bytes`). Peak: the largest peak of tensors the optimizer step created,
over ranks (the gathered matrix and Newton–Schulz's iterates).

For chapter 03's ``STRATEGIES``: ``MUON_ROWS``.
"""
from __future__ import annotations

import functools
import statistics

import torch

from minipar.check import compare, train_reference
from minipar.course.tour import WORLD_SIZE, TourRow
from minipar.launcher import launch
from minipar.optim import muon_sharded, muon_tp
from minipar.optim.muon import muon_recipe
from minipar.optim.muon_measure import measured_sharded, measured_tp

__all__ = ["MUON_ROWS", "measure_muon"]

SHARDED = [("zero1", "owner"), ("zero1", "whole"), ("zero1", "gather"), ("fsdp", "owner"), ("fsdp", "whole"),
           ("zero1", "per_shard"), ("fsdp", "per_shard")]
TP = ("owner", "gather", "per_shard")
LABELS = {"owner": "owner-compute", "whole": "whole-matrix", "gather": "gather-everywhere", "zero1": "ZeRO-1",
          "fsdp": "FSDP", "per_shard": "per-shard"}


def _all_on_rank(rank, world_size, recipe):
    out = {key: measured_sharded(rank, world_size, recipe, sharding=key[0], method=key[1]) for key in SHARDED}
    out.update({("tp", m): measured_tp(rank, world_size, recipe, method=m) for m in TP})
    return out


@functools.lru_cache(maxsize=1)
def measure_muon() -> dict:
    """Every variant in one 4-rank launch: {(sharding or "tp", method): [per rank]}, and the reference."""
    recipe = muon_recipe(steps=3)
    for sharding, method in SHARDED:
        muon_sharded.validate(recipe, world_size=WORLD_SIZE, sharding=sharding, method=method)
    for method in TP:
        muon_tp.validate(recipe, world_size=WORLD_SIZE, method=method)
    per_rank = launch(_all_on_rank, WORLD_SIZE, recipe, quiet=True)
    runs = {key: [r[key] for r in per_rank] for key in per_rank[0]}
    return {"recipe": recipe, "reference": train_reference(recipe), "runs": runs}


def _row(sharding: str, method: str) -> TourRow:
    m = measure_muon()
    recipe, reference, runs = m["recipe"], m["reference"], m["runs"]
    results = runs[(sharding, method)]
    c = compare(reference, results, dtype=torch.float64)
    wrong = compare(reference, runs[(sharding, "per_shard")], dtype=torch.float64)
    tp = sharding == "tp"
    sent = statistics.mean(b for r in results for b in (r.step_bytes_sent if tp else r.bytes_sent))
    formula_of = muon_tp.step_bytes if tp else muon_sharded.bytes_per_step
    formula = statistics.mean(formula_of(recipe, world_size=WORLD_SIZE, method=method, rank=r)
                              for r in range(WORLD_SIZE))
    seen = [b for r in results for b in r.observed]
    observed = None if tp or None in seen else statistics.mean(seen)
    peaks = [max(r.step_peak) for r in results]
    note = (f"per-shard Newton–Schulz in the same launch differs from one device by {wrong.max_abs_diff:.2g} "
            f"(matches: {wrong.matches}); optimizer-step peak per rank {peaks} B")
    if tp:
        note += "; bytes: the optimizer step's alone (TP's activations' all-reduces are not Muon's)"
    else:
        state = [r.state_bytes for r in results]
        want = [muon_sharded.state_bytes(recipe, world_size=WORLD_SIZE, method=method, rank=r) for r in range(WORLD_SIZE)]
        wire = ("gloo's reduce and broadcast are its own algorithms, not the direct sends the formula counts"
                if method == "whole" else "gloo's reduce-scatter all-reduces (2x the ring's bytes)")
        note += f"; optimizer state per rank {state} B, formula {want} B; observed > formula: {wire}"
    name = f"Muon {LABELS[method]} {'TP' if tp else LABELS[sharding]}"
    return TourRow(name, WORLD_SIZE, c.matches, c.max_abs_diff, sent, formula, max(peaks), note,
                   bytes_observed_per_rank=observed)


MUON_ROWS = [
    ("Muon owner-compute ZeRO-1", functools.partial(_row, "zero1", "owner")),
    ("Muon whole-matrix ZeRO-1", functools.partial(_row, "zero1", "whole")),
    ("Muon gather-everywhere ZeRO-1", functools.partial(_row, "zero1", "gather")),
    ("Muon owner-compute FSDP", functools.partial(_row, "fsdp", "owner")),
    ("Muon whole-matrix FSDP", functools.partial(_row, "fsdp", "whole")),
    ("Muon owner-compute TP", functools.partial(_row, "tp", "owner")),
    ("Muon gather-everywhere TP", functools.partial(_row, "tp", "gather")),
]
