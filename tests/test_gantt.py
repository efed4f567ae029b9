"""One Gantt drawing, several sources: the pipeline simulator's rows and a replay's rows (no processes)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minipar.pipeline import gantt  # noqa: E402
from minipar.machine.cluster import Cluster  # noqa: E402
from minipar.machine.replay import replay  # noqa: E402
from minipar.machine.trace import Comm, Compute, RankTrace, Trace, Wait  # noqa: E402


def ddp_like():
    """Two ranks: backward 1.5 s, a bucket issued (0.8 s on the wire), 0.5 s more backward, the second
    bucket, both waited for, optimizer 0.3 s. Rank 1's first compute and its optimizer are 0.5 s longer, so
    rank 0 is done early: idle at the end."""
    def rank(r, first, last):
        ev = [Compute(first, first), Comm("all_reduce", (0, 1), 800, async_=True), Compute(0.5, 0.5),
              Comm("all_reduce", (0, 1), 800, async_=True), Wait(1), Wait(3), Compute(last, last)]
        ev[1].waited_at, ev[3].waited_at = 4, 5
        return RankTrace(r, ev)
    cluster = Cluster(2, 1, 1e9, 1.0, 1000.0, 1000.0, 0.0, 0.0)
    return replay(Trace([rank(0, 1.5, 0.3), rank(1, 2.0, 0.8)]), cluster, compute_scale=1.0)


def total(rows, rank, kind):
    return sum(e - s for r, k, _, _, s, e in rows if r == rank and k == kind)


def test_replay_rows_are_the_replays_compute_hidden_exposed_idle():
    res = ddp_like()
    rows = gantt.replay_rows(res)
    # by hand: bucket 1 runs 2.0..2.8 (rank 1 issues it at 2.0), bucket 2 2.8..3.6; rank 0's compute ended at
    # 2.0, so all its transfer time is exposed, and it is done at 3.9 (idle to 4.4); rank 1 computes 2.0..2.5
    # under bucket 1 (hidden 0.5), then waits for bucket 2 (exposed 2.5..3.6), then 0.8 s of optimizer
    want = {0: {"compute": 2.3, "comm hidden": 0.0, "comm exposed": 1.6, "idle": 0.5},
            1: {"compute": 3.3, "comm hidden": 0.5, "comm exposed": 1.1, "idle": 0.0}}
    for rank in (0, 1):
        assert {k: total(rows, rank, k) for k in gantt.REPLAY_KINDS} == pytest.approx(want[rank])
        assert res.totals(rank) == pytest.approx(want[rank])
        # the bars tile the step: compute and idle never overlap, nor hidden and exposed, and they add up
        for pair in (("compute", "idle"), ("comm hidden", "comm exposed")):
            bars = sorted((a, b) for r, k, _, _, a, b in rows if r == rank and k in pair)
            assert all(b <= c + 1e-12 for (_, b), (c, _) in zip(bars, bars[1:]))
        assert total(rows, rank, "compute") + total(rows, rank, "comm exposed") + total(rows, rank, "idle") \
            == pytest.approx(res.step_seconds) == pytest.approx(4.4)


def test_replay_rows_window_shifts_to_zero_and_clips():
    res = ddp_like()
    rows = gantt.replay_rows(res, start=1.0, end=2.2)
    assert min(s for *_, s, _ in rows) == pytest.approx(0.0) and max(e for *_, e in rows) == pytest.approx(1.2)
    assert total(rows, 1, "compute") == pytest.approx(1.2)       # rank 1 computes throughout 1.0..2.2


def test_one_drawing_for_simulator_and_replay():
    from minipar.pipeline.schedules import make_schedule
    from minipar.pipeline.simulate import simulate
    sim = simulate(make_schedule("1f1b", 2, 4))
    fig, (a, b) = plt.subplots(2)
    gantt.draw_gantt(a, gantt.sim_rows(sim), 2, "simulated")
    gantt.draw_gantt(b, gantt.replay_rows(ddp_like()), 2, "replayed", labels=False)
    colours = {tuple(round(x, 3) for x in c.get_facecolor()[0]) for c in b.collections}
    want = {tuple(round(x, 3) for x in matplotlib.colors.to_rgba(gantt.KIND_COLOURS[k])) for k in gantt.REPLAY_KINDS}
    assert colours == want                                        # every replay kind drawn in its colour
    assert len(a.collections) > 0 and not b.texts                 # no micro-batch labels on a replay
    gantt.gantt_legend(fig, gantt.REPLAY_KINDS)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(gantt.REPLAY_KINDS)
    plt.close(fig)
