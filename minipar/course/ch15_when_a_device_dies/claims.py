"""Chapter 15's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import math


def check_failure_is_the_normal_case(mtbf_hours, tau_sync, tau_async, waste_sync, waste_async) -> None:
    """Failure is the normal case: how often to save"""
    assert 3.0 < mtbf_hours < 3.2
    assert math.isclose(tau_sync, math.sqrt(2 * 62 * mtbf_hours * 3600), rel_tol=1e-9)
    assert tau_async < tau_sync and waste_async < waste_sync


def check_async_save_trace(rows, overlapping, slow_at) -> None:
    """An asynchronous save: the next step starts before the file is closed"""
    row = next(r for r in rows if r["step"] == slow_at)
    assert slow_at in overlapping and row["snapshot"][1] <= row["next_step_start"] < row["write"][1]
    assert row["snapshot"][1] - row["snapshot"][0] < row["write"][1] - row["write"][0]


def check_kill_during_write(result) -> None:
    """A kill during the write"""
    assert result["error"] and "rank 1" in result["error"] and "SIGKILL" in result["error"]
    assert result["latest"] == "step-00000001" and result["partial"] == ["step-00000002.partial"]
    assert result["start"] == 1 and result["max_diff"] == 0.0


def check_bit_flip_caught(results, flip, replicas) -> None:
    """A flipped bit, caught before the optimizer step"""
    assert flip.rank in replicas and len(replicas) == 2
    for rank, (findings, diff) in enumerate(results):
        assert diff == 0.0
        named = [(f.step, f.rank, f.tensor) for f in findings]
        assert named == ([(flip.step, flip.rank, flip.tensor)] if rank in replicas else [])


def check_what_the_check_costs(cost) -> None:
    """What the check costs"""
    assert cost["check_bytes"] == 16 * cost["tensors"] + 8               # dp 2: the all-gather and the flag
    assert cost["check_bytes"] < 0.01 * cost["grad_bytes"]
    assert cost["check_wire_bytes"] is None or cost["check_wire_bytes"] >= cost["check_bytes"]   # headers only add


def check_a_run_that_loses_a_replica(ft, replicas=3) -> None:
    """A run that loses a replica and goes on"""
    result, events, kill = ft["result"], ft["events"], ft["kill_step"]
    steps = len(ft["uninterrupted_losses"])
    assert [s for s, _ in result.committed] == list(range(steps))               # every step committed once
    aborted = [(e["step"], e["members"]) for e in events if e["kind"] == "abort"]
    assert aborted == [(kill, list(range(replicas)))]                          # the half-done step: nothing applied
    quorums = dict(result.committed)
    assert quorums[kill] == [r for r in range(replicas) if r != 1] and quorums[steps - 1] == list(range(replicas))
    assert [n for _, _, n in result.losses] == [len(m) for _, m in result.committed]
    deaths = [e["replica"] for e in events if e["kind"] == "death"]
    heals = [(e["replica"], e["source"]) for e in events if e["kind"] == "heal_end"]
    assert deaths == [1] and len(heals) == 1 and heals[0][0] == 1 and heals[0][1] != 1
    assert ft["max_diff"] <= 1e-12 and ft["identical"]                         # = one device, committed rows
    assert all(math.isclose(a, b, rel_tol=1e-12) for (_, a, _), b in zip(result.losses, ft["committed_losses"]))
    assert ft["uninterrupted_losses"][kill] != result.losses[kill][1]            # a smaller batch, another loss
