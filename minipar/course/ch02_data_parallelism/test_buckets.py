"""Chapter 02's bucket U-curve (buckets.py), checked by hand: rebucket groups a per-parameter trace's
all-reduces as the library's bucket packing groups the parameters, and the sweep of a hand-built trace on a
hand-built cluster gives the step times worked out below — a U."""
import math

import pytest
import torch

from minipar.course.ch02_data_parallelism import buckets
from minipar.data.buckets import assign_buckets
from minipar.machine.cluster import LinkCard, comm_seconds, gpu_cluster
from minipar.machine.device import DeviceCard
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace, Wait

# a card whose only cost is its launch floor (1 µs a kernel), and a link of 10 µs per step and 1 GB/s
CARD = DeviceCard("hand", 1e12, 1e12, 1e9, 1e-6, gemm_efficiency=1.0, attention_efficiency=1.0,
                  memory_efficiency=1.0)
LINK = LinkCard("hand", 1e9, 10e-6, 1.0)
TINY = gpu_cluster(CARD, 2, LINK, LINK, devices_per_node=1)


def _kernels(n):
    """A compute segment of ``n`` empty kernels: n µs on :data:`CARD`."""
    return Compute(0.0, ops=[{"name": "k", "kind": "memory", "count": n, "flops": 0, "bytes": 0}])


def _per_parameter_step(grad_bytes, kernels_per_grad=20):
    """One DDP step with one parameter per bucket, as DDP's trace has it: forward, then per gradient its
    backward segment and its async all-reduce; at the end of backward a Wait for each, in launch order."""
    events = [Mark("step"), _kernels(5)]
    calls = []
    for size in grad_bytes:
        events.append(_kernels(kernels_per_grad))
        calls.append(len(events))
        events.append(Comm("all_reduce", (0, 1), size, async_=True))
    for i in calls:
        events[i] = Comm("all_reduce", (0, 1), events[i].bytes, async_=True, waited_at=len(events))
        events.append(Wait(i))
    return events


def _trace(grad_bytes, steps=2):
    events = []
    for _ in range(steps):
        offset = len(events)
        for e in _per_parameter_step(grad_bytes):
            if isinstance(e, Comm) and e.waited_at is not None:
                e = Comm(e.op, e.ranks, e.bytes, True, e.waited_at + offset)
            elif isinstance(e, Wait):
                e = Wait(e.comm + offset)
            events.append(e)
    events.append(Mark("step"))
    return Trace([RankTrace(r, list(events)) for r in (0, 1)], {})


def _step_calls(events):
    marks = [i for i, e in enumerate(events) if isinstance(e, Mark)]
    return [e for e in events[marks[-2]:marks[-1]] if isinstance(e, Comm)]


@pytest.mark.parametrize("capacity", [1, 500, 1000, 1200, 10 ** 6])
def test_rebucket_groups_as_the_library_packs_parameters(capacity):
    sizes = [400, 100, 300, 800, 200, 4]                      # bytes of each gradient, in launch order
    params = [torch.zeros(s // 4) for s in sizes]            # float32: 4 bytes an element
    want = [sum(p.numel() * 4 for p in group) for group in assign_buckets(params, capacity)]
    by_hand = {1: sizes, 500: [500, 1100, 204], 1000: [1600, 204], 1200: [1600, 204], 10 ** 6: [1804]}
    assert want == by_hand[capacity]
    merged = buckets.rebucket(_trace(sizes), capacity)
    for rank in merged.ranks:
        calls = _step_calls(rank.events)
        assert [c.bytes for c in calls] == want
        for c in calls:                                       # every merged call is waited for, exactly once
            assert isinstance(rank.events[c.waited_at], Wait)
        waits = [i for i, e in enumerate(rank.events) if isinstance(e, Wait)]
        assert sorted(rank.events[w].comm for w in waits) == sorted(
            i for i, e in enumerate(rank.events) if isinstance(e, Comm))
        assert all(rank.events[rank.events[w].comm].waited_at == w for w in waits)


def test_rebucket_issues_a_bucket_after_its_last_gradient():
    merged = buckets.rebucket(_trace([400, 400, 400, 400]), 800).ranks[0].events
    marks = [i for i, e in enumerate(merged) if isinstance(e, Mark)]
    step = merged[marks[-2]:marks[-1]]
    kinds = ["C" if isinstance(e, Compute) else "A" if isinstance(e, Comm) else "W" if isinstance(e, Wait) else "M"
             for e in step]
    assert "".join(kinds) == "MCCCACCAWW"                    # forward, 2 gradients, bucket, 2 gradients, bucket, waits
    with pytest.raises(ValueError, match="positive"):
        buckets.rebucket(_trace([4]), 0)


def test_sweep_of_a_hand_trace_is_a_u():
    # 4 gradients of 5000 B, 20 µs of backward before each; an all-reduce of S bytes on 2 ranks costs
    # 2(N-1)·α + 2(N-1)/N·S/β = 20 µs + S / 1 GB/s: one gradient 25 µs, two 30 µs, four 40 µs.
    assert math.isclose(comm_seconds("all_reduce", (0, 1), 5000, TINY), 25e-6)
    # Forward 5 µs; backward ends at 5 + 80 = 85 µs; calls wait for the link (one at a time):
    #   one per gradient: launched at 25, 45, 65, 85, each 25 µs, back to back: done at 25 + 4·25 = 125 µs
    #   two buckets:      launched at 45, 85, each 30 µs: done at 75 and 115 µs
    #   one bucket:       launched at 85, 40 µs: done at 125 µs
    rows = buckets.sweep(_trace([5000] * 4), [1, 10000, 20000], cluster=TINY)
    assert [r["buckets"] for r in rows] == [4, 2, 1]
    for row, want in zip(rows, (125e-6, 115e-6, 125e-6)):
        assert math.isclose(row["step"], want, rel_tol=1e-9)
        assert math.isclose(row["compute"], 85e-6, rel_tol=1e-9)
        assert math.isclose(row["exposed"], want - 85e-6, rel_tol=1e-9, abs_tol=1e-12)


def test_draw_sweep_draws_each_row():
    import matplotlib
    matplotlib.use("Agg")
    rows = buckets.sweep(_trace([5000] * 4), [1, 10000, 20000], cluster=TINY)
    ax = buckets.draw_sweep(rows).axes[0]
    step_line = ax.get_lines()[0]
    assert list(step_line.get_ydata()) == pytest.approx([125, 115, 125]) and "Model" in ax.get_title()
