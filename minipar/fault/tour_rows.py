"""The tour's rows for fault-tolerant replica groups (chapter 15, "When a device dies").

The library never imports the course, so :func:`fault_tour_rows` returns ``[(name, run)]`` where ``run()`` gives
the fields of :class:`minipar.course.tour.TourRow` as a dict; the chapter's ``tour.py`` wraps them::

    STRATEGIES = [(name, lambda run=run: TourRow(**run())) for name, run in fault_tour_rows()]

Both rows come from one run (float64, 4 replicas of 1 rank, 4 steps): replica 1 is SIGKILLed inside step 1,
after its gradient entered the others' all-reduce and before its vote, and restarted once. Bytes per rank per
step: the model of the cross-replica ring all-reduce, 2(n−1)/n · b · Ψ for a quorum of n (from the payloads the
commit gates reduced, aborted rounds included: the lost work), beside the formula for a full quorum, 2(R−1)/R ·
b · Ψ. The quorum's group is built without ``new_group`` (torchft's way), which minipar's communication log does
not see, so no observed bytes. Healing: the state one rank streams (parameters + Adam's two moments + step
counts: about 3 · b · Ψ) beside 3 · b · Ψ.
"""
from __future__ import annotations

import functools
import time

import torch

from ..recipe import gpt_recipe
from . import replicas
from .quorum import FaultPlan

__all__ = ["fault_tour_rows", "REPLICAS", "STEPS"]

REPLICAS, STEPS = 4, 4


def _recipe():
    recipe = gpt_recipe(steps=STEPS, batch_size=8)
    recipe.dtype = torch.float64
    return recipe


@functools.lru_cache(maxsize=1)
def _killed_run():
    """(recipe, the run, its seconds, max |run − one device over the committed rows|, whether the replicas
    ended identical): one run for both rows."""
    recipe, t0 = _recipe(), time.perf_counter()
    result = replicas.run(recipe, replicas=REPLICAS, micro_batches=1, plan=FaultPlan(replica=1, rank=0, step=1))
    seconds = time.perf_counter() - t0
    reference = replicas.committed_reference(recipe, REPLICAS, result.committed)
    diff = max((p[n] - reference.params[n]).abs().max().item() for p in result.params.values() for n in p)
    first = result.params[0]
    identical = all(torch.equal(first[n], p[n]) for p in result.params.values() for n in first)
    return recipe, result, seconds, diff, identical


def _psi_bytes(recipe) -> int:
    return sum(p.numel() for p in recipe.model().parameters()) * 8          # float64


def _replicated_row() -> dict:
    recipe, result, seconds, diff, identical = _killed_run()
    ring = [2 * (n - 1) / n * payload for stats in result.stats.values() for s in stats.values()
            for n, payload in s["reduced"]]
    sent = sum(ring) / len(result.stats) / STEPS
    lives = [n for _, _, n in result.losses]
    aborted = sum(r.outcome == "abort" for r in result.rounds)
    note = (f"{REPLICAS} replicas of 1 rank, replica 1 SIGKILLed inside step 1 (after its all-reduce, before its "
            f"vote): {aborted} round aborted, nothing of it applied; live replicas per committed step {lives}; "
            f"equals one device over the committed rows; bytes: the ring's model per rank per step (aborted "
            f"rounds included), beside a full quorum's 2(R−1)/R·b·Ψ; the quorum's group is outside the comm log")
    return dict(strategy="fault-tolerant DP (replica killed)", world_size=REPLICAS,
                matches=diff <= 1e-12 and identical, max_abs_diff=diff, bytes_sent_per_rank=sent,
                bytes_formula=2 * (REPLICAS - 1) / REPLICAS * _psi_bytes(recipe), peak_bytes_per_rank=None,
                note=note, seconds=seconds)


def _healing_row() -> dict:
    recipe, result, seconds, diff, identical = _killed_run()
    healed = [e for e in result.events if e["kind"] == "heal_end"]
    received = result.stats[1][0]["healed_bytes"]
    note = (f"the restarted replica 1 received its state from replica {healed[0]['source'] if healed else '?'} over "
            f"the quorum's gloo group in {healed[0]['seconds'] if healed else float('nan'):.3f} s (no disk), joined "
            f"at a committed step and ended bit-identical to the others; bytes: the torch.save stream of parameters "
            f"+ Adam moments + step counts, beside 3·b·Ψ")
    return dict(strategy="healing from a live peer", world_size=REPLICAS, matches=identical and bool(healed),
                max_abs_diff=diff, bytes_sent_per_rank=received, bytes_formula=3 * _psi_bytes(recipe),
                peak_bytes_per_rank=None, note=note, seconds=0.0)


def fault_tour_rows() -> list:
    """[(name, run)]: ``run()`` -> the fields of a ``TourRow`` (module docstring)."""
    return [("fault-tolerant DP (replica killed)", _replicated_row), ("healing from a live peer", _healing_row)]
