"""Chapter 03's Muon section: the four ways to run Muon under ZeRO-1 (:mod:`minipar.optim.muon_sharded`) in
one launch on N ranks, each beside one device's Muon (:mod:`minipar.optim.muon`), as a small table.

Per method: max |Δ| of the final parameters against one device (float64, Newton–Schulz in float64), bytes
sent per rank per step from the comm log (mean over ranks and steps) beside
:func:`~minipar.optim.muon_sharded.bytes_per_step`, and the optimizer state per rank (largest over ranks)
beside :func:`~minipar.optim.muon_sharded.state_bytes`. :func:`check` raises when a number is not what the
module's formulas and the maths say; it prints nothing when they are.
"""
from __future__ import annotations

import statistics

import torch

from minipar.check import compare, train_reference
from minipar.launcher import launch
from minipar.optim import muon_sharded
from minipar.optim.muon import muon_recipe
from minipar.optim.muon_measure import measured_sharded

__all__ = ["METHODS", "LABELS", "run", "table_text", "check"]

METHODS = ("per_shard", "gather", "owner", "whole")
LABELS = {"per_shard": "per-shard NS (wrong)", "gather": "gather-everywhere", "owner": "owner-compute",
          "whole": "whole-matrix"}


def _all_methods(rank, world_size, recipe):
    return {m: measured_sharded(rank, world_size, recipe, sharding="zero1", method=m) for m in METHODS}


def run(world_size: int = 4, steps: int = 2) -> dict:
    """One launch, every method: {method: {"diff", "matches", "sent", "formula", "state", "state_formula"}}."""
    recipe = muon_recipe(steps=steps)
    for method in METHODS:
        muon_sharded.validate(recipe, world_size=world_size, sharding="zero1", method=method)
    per_rank = launch(_all_methods, world_size, recipe, quiet=True)
    reference = train_reference(recipe)
    table = {}
    for method in METHODS:
        results = [r[method] for r in per_rank]
        c = compare(reference, results, dtype=torch.float64)
        formula = [muon_sharded.bytes_per_step(recipe, world_size=world_size, method=method, rank=r)
                   for r in range(world_size)]
        state_formula = [muon_sharded.state_bytes(recipe, world_size=world_size, method=method, rank=r)
                         for r in range(world_size)]
        table[method] = {"diff": c.max_abs_diff, "matches": c.matches,
                         "sent": statistics.mean(b for r in results for b in r.bytes_sent),
                         "formula": statistics.mean(formula),
                         "state": max(r.state_bytes for r in results), "state_formula": max(state_formula)}
    return table


def table_text(table: dict) -> str:
    lines = [f"{'method':22}{'max |Δ| vs 1 device':>21}{'sent/rank/step':>16}{'formula':>10}"
             f"{'opt. state/rank':>17}{'formula':>10}"]
    for method, row in table.items():
        lines.append(f"{LABELS[method]:22}{row['diff']:>21.2g}{row['sent'] / 1024:>15.1f}K"
                     f"{row['formula'] / 1024:>9.1f}K{row['state'] / 1024:>16.1f}K{row['state_formula'] / 1024:>9.1f}K")
    return "\n".join(lines)


def check(table: dict) -> None:
    """Raise if a right method differs from one device, per-shard does not, or a byte count misses its formula."""
    for method, row in table.items():
        if row["matches"] != (method != "per_shard"):
            raise AssertionError(f"{method}: matches one device = {row['matches']} (max |Δ| {row['diff']:.3g})")
        if abs(row["sent"] - row["formula"]) > 1e-6 * row["formula"]:
            raise AssertionError(f"{method}: {row['sent']} bytes per rank per step, formula {row['formula']}")
        if row["state"] != row["state_formula"]:
            raise AssertionError(f"{method}: optimizer state {row['state']} B, formula {row['state_formula']} B")
