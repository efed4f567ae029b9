"""Traces: data without processes (save, load, summary, the tracer's hooks), then one real traced DDP run."""
import pytest

from minipar import comm
from minipar.check import mlp_recipe
from minipar.data import ddp
from minipar.launcher import launch
from minipar.machine.cluster import this_machine
from minipar.observe.launch_trace import traced_launch
from minipar.machine.replay import replay
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace, Wait, load
from minipar.observe.tracer import _Tracer, tracing


def hand_trace():
    return Trace([RankTrace(0, [Compute(0.5, 0.6), Comm("all_reduce", (0, 1), 1024, async_=True, waited_at=3),
                                Compute(0.25, 0.3, flops=1e6), Wait(1)]),
                  RankTrace(1, [Compute(0.75, 0.8), Comm("send", [0, 1], 64)])], {"flops_per_second": 2e9})


def test_save_load_round_trip(tmp_path):
    trace = hand_trace()
    trace.save(tmp_path / "t.json")
    back = load(tmp_path / "t.json")
    assert back == trace
    assert back.ranks[1].events[1].ranks == (0, 1) and isinstance(back.ranks[0].events[3], Wait)
    assert back.meta == {"flops_per_second": 2e9}


def test_summary():
    text = hand_trace().summary()
    assert text.splitlines() == ["rank 0: 4 events, compute 750.00 ms CPU; all_reduce 1x 0.00102 MB",
                                 "rank 1: 2 events, compute 750.00 ms CPU; send 1x 6.4e-05 MB"]


class FakeWork:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1
        return True

    def is_completed(self):
        return True


def test_tracer_hooks_without_processes():
    """What minipar.comm tells a tracer: before a call, each record (with its async work), and a wait."""
    tracer = _Tracer(rank=0)
    sum(i * i for i in range(200_000))                          # some compute on this thread
    tracer.before_call()
    rec = comm.CommRecord("all_reduce", 2, 4096, 4096, 4096, 0.0, "ring", ranks=(0, 1))
    work = tracer.on_record(rec, FakeWork())
    tracer.before_call()
    assert tracer.on_record(comm.CommRecord("broadcast", 2, 8, 8, 0, 0.0, "direct", ranks=(0, 1)), None) is None
    work.wait()
    work.wait()                                                 # a second wait adds nothing
    tracer.mark("step")
    assert work.is_completed() and work._work.waits == 2
    events = tracer.finish().events
    assert [type(e).__name__ for e in events] == ["Compute", "Comm", "Compute", "Comm", "Compute", "Wait",
                                                  "Compute", "Mark", "Compute"]
    assert events[0].seconds_cpu > 0 and events[1].async_ and not events[3].async_
    assert all(e.seconds_other_threads >= 0 for e in events if isinstance(e, Compute))
    assert events[1].waited_at == 5 and events[5].comm == 1 and events[1].bytes == 4096
    assert events[7] == Mark("step")


def _traced_ddp(rank, world_size, recipe):
    with comm.recording() as log, tracing() as rank_trace:
        ddp.parallel_train(rank, world_size, recipe, bucket_bytes=2 ** 13)
    return rank_trace, [(r.op, r.ranks, r.payload_bytes) for r in log.records]


def test_traced_ddp_on_two_ranks():
    recipe = mlp_recipe(steps=2)
    params = sum(p.numel() for p in recipe.model().parameters())
    for rank_trace, logged in launch(_traced_ddp, 2, recipe, quiet=True):
        comms = rank_trace.comms()
        assert [(c.op, c.ranks, c.bytes) for c in comms] == logged             # every call, same bytes
        buckets = [c for c in comms if c.op == "all_reduce" and c.async_]
        assert sum(c.bytes for c in buckets) == 2 * 4 * params                  # 2 steps, every gradient
        assert all(c.waited_at is not None for c in buckets)                    # DDP waits for each bucket
        computes = [e for e in rank_trace.events if isinstance(e, Compute)]
        assert len(computes) == len(comms) + sum(c.async_ for c in comms) + 1   # between calls and waits
        assert all(e.seconds_cpu > 0 for e in computes) and rank_trace.compute_cpu_seconds > 0
    results, trace = traced_launch(ddp.parallel_train, 2, recipe, quiet=True, meta={"flops_per_second": 1e9})
    assert trace.world_size == 2 and results[0].losses == results[1].losses
    played = replay(trace, this_machine(1e-4, 1e9, 1e9, devices=2))
    assert played.step_seconds >= max(r.compute_cpu_seconds for r in trace.ranks)
    assert played.step_seconds == pytest.approx(max(played.compute(r) + played.exposed(r) + played.idle(r)
                                                    for r in range(2)))


def _traced_strategy(rank, world_size, name):
    from minipar.check import gpt_recipe
    from minipar.data import zero
    from minipar.pipeline import runtime
    from minipar.tensor import gpt
    recipe = gpt_recipe(steps=2, batch_size=8, seq_len=16, n_layer=2)
    train = {"zero3": lambda: zero.parallel_train(rank, world_size, recipe, stage=3),
             "1f1b": lambda: runtime.parallel_train(rank, world_size, recipe, schedule="1f1b", m=4),
             "tp+sp": lambda: gpt.parallel_train(rank, world_size, recipe, sequence_parallel=True)}[name]
    with comm.recording() as log, tracing(ops=True) as rank_trace:
        train()
    return rank_trace, [(r.op, r.ranks, r.payload_bytes) for r in log.records]


@pytest.mark.parametrize("name", ["zero3", "1f1b", "tp+sp"])
def test_other_strategies_traced_and_replayed(name):
    """No tracing code in the strategies: the comm hooks see every call, and the traces replay (every
    collective matched, every message received) on this machine and on a DGX-A100 node (the A100 card
    prices each segment's counted operators)."""
    from minipar.machine.cluster import a100_cluster
    from minipar.machine.device import ops_of, ops_seconds
    out = launch(_traced_strategy, 2, name, quiet=True)
    for rank_trace, logged in out:
        assert [(c.op, c.ranks, c.bytes) for c in rank_trace.comms()] == logged and logged
    trace = Trace([t for t, _ in out])
    here = replay(trace, this_machine(5e-5, 5e9, 2e10, devices=2), compute_scale=1.0)
    there = replay(trace, a100_cluster(1))
    assert len(here.calls) == len(there.calls) > 0
    # there, each segment lasts its operators on the card (a tiny model: mostly launch floors, 5 µs a kernel)
    card = a100_cluster(1).device
    for r, rank_trace in enumerate(trace.ranks):
        priced = sum(ops_seconds(ops_of(e.ops), card) for e in rank_trace.events if isinstance(e, Compute))
        assert there.table()[r]["compute"] == pytest.approx(priced, rel=1e-9) and priced > 0


def test_flops_counted_per_segment_without_processes():
    """tracing(flops=True): each segment carries the matmul FLOPs counted inside it (2·m·n·k per matmul);
    without it, None."""
    import torch
    from minipar.observe.tracer import mark
    a, b, c = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 4)
    with tracing(0, flops=True) as counted:
        y = a @ b                                   # 2·8·16·32
        mark("half")
        y @ c                                       # 2·8·32·4
        y.relu()                                    # no matmul: no FLOPs counted
    computes = [e for e in counted.events if isinstance(e, Compute)]
    assert [e.flops for e in computes] == [2 * 8 * 16 * 32, 2 * 8 * 32 * 4]
    with tracing(0) as plain:
        a @ b
    assert [e.flops for e in plain.events] == [None]
