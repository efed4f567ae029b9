"""Chapter 00 tour rows: every collective and hand-written ring on 4 ranks equals the one-process result,
and the bytes measured in the communication log equal the formula.

Tolerances: data movement (broadcast, scatter, gather, all-gather, all-to-all, send/recv, ring all-gather)
must be bit-identical (max |diff| == 0); sums may differ from the one-process sum by float32 rounding of
the different order of additions (max |diff| <= 1e-5 for four N(0,1) values). Bytes: the log's model equals
the formula exactly (the same model, so this only checks the bookkeeping); what the ranks really wrote to
their sockets (minipar.wire) is the measurement: within gloo's framing (tour.OVERHEAD_PER_CALL per call) of
the formula, except gloo's reduce-scatter (2x: it all-reduces) and reduce (1.25x), observed here too.
"""
import json

import pytest
import torch

from minipar import wire
from minipar.course import tour
from minipar.course.ch00_setup_and_collectives import tour as ch00

REQUIRED = ["broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather", "reduce_scatter",
            "all_to_all", "send/recv", "ring all_reduce", "ring all_gather", "ring reduce_scatter"]
KEYS = {"strategy", "world_size", "matches", "max_abs_diff", "bytes_sent_per_rank", "bytes_formula",
        "peak_bytes_per_rank"}


@pytest.fixture(scope="module")
def rows():
    return {name: run() for name, run in ch00.STRATEGIES}


def test_every_collective_has_a_row(rows):
    assert list(rows) == REQUIRED


def test_rows_match_one_process_and_bytes_equal_formula(rows):
    for name, row in rows.items():
        assert row.world_size == 4, name
        assert row.matches, (name, row.max_abs_diff)
        limit = 0.0 if ch00.COLLECTIVES[name].exact else ch00.SUM_ATOL
        assert row.max_abs_diff <= limit, (name, row.max_abs_diff)
        assert row.bytes_sent_per_rank == row.bytes_formula, (name, row.bytes_sent_per_rank, row.bytes_formula)
        assert row.bytes_sent_per_rank > 0, name  # every operation moves something on 4 ranks


@pytest.mark.skipif(not wire.available(), reason="no /proc/self/io")
def test_observed_bytes_on_the_wire(rows):
    """What the sockets carried, per rank, against the formula: gloo's framing only, except where gloo runs
    another algorithm than the log's (reduce-scatter all-reduces: 2x; reduce: 1.25x), which the note says."""
    for name, row in rows.items():
        assert row.kind == "collective" and row.calls_per_rank >= 1, name
        ratio = row.bytes_observed_per_rank / row.bytes_formula
        if name == "reduce_scatter":
            assert 1.99 < ratio < 2.02 and "all-reduces" in row.note, (name, ratio)
        elif name == "reduce":
            assert 1.24 < ratio < 1.27 and "1.25x" in row.note, (name, ratio)
        else:
            assert tour.observed_status(row) == "within", (name, ratio, row.bytes_observed_per_rank)
            assert row.bytes_observed_per_rank >= row.bytes_formula, name  # headers come on top, never less
    # the hand-written ring sends the textbook (N-1)/N·S, observed, where gloo's own sends twice that
    assert rows["ring reduce_scatter"].bytes_observed_per_rank < 0.51 * rows["reduce_scatter"].bytes_observed_per_rank


def test_ring_rows_against_closed_form(rows):
    s, n = ch00.PAYLOAD_BYTES, 4
    assert rows["ring all_reduce"].bytes_sent_per_rank == 2 * (n - 1) / n * s
    assert rows["ring all_gather"].bytes_sent_per_rank == (n - 1) / n * s
    assert rows["ring reduce_scatter"].bytes_sent_per_rank == (n - 1) / n * s


def test_comparison_rejects_wrong_results():
    """The check can fail: a rank holding another rank's piece, a missing result, a wrong shape."""
    numel = 16
    expected = ch00.expected_outputs("reduce_scatter", 4, numel)
    swapped = [expected[1], expected[0]] + expected[2:]
    assert ch00.compare_outputs(swapped, expected) > ch00.SUM_ATOL
    assert ch00.compare_outputs([None] + expected[1:], expected) == float("inf")
    total = ch00.expected_outputs("all_reduce", 4, numel)
    assert ch00.compare_outputs(total, expected) == float("inf")  # full sum where a shard is due
    # a "ring all-reduce" that stopped after its reduce-scatter half leaves zeros in the other chunks
    half = [torch.cat([c if i == r else torch.zeros_like(c) for i, c in enumerate(t.chunk(4))])
            for r, t in enumerate(total)]
    assert ch00.compare_outputs(half, total) > 1.0


def test_small_values_are_exact_and_readable():
    outcome = ch00.run_collectives(4, ["all_reduce", "gather", "all_to_all"], numel=8, values="small")
    assert outcome["all_reduce"][0]["before"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert outcome["all_reduce"][3]["after"].tolist() == [64 + 4 * i for i in range(8)]
    assert outcome["gather"][0]["after"].tolist() == [1, 2, 11, 12, 21, 22, 31, 32]
    assert outcome["gather"][1]["after"] is None
    assert outcome["all_to_all"][1]["after"].tolist() == [3, 4, 13, 14, 23, 24, 33, 34]


@pytest.mark.parametrize("n", [3, 4])
def test_ring_vs_root_traffic(n):
    numel = 1200
    s = numel * 4
    traffic = ch00.busiest_rank_traffic(n, numel)
    for pattern in ("ring", "root"):
        assert traffic[pattern]["max_abs_diff"] <= ch00.SUM_ATOL, pattern
    assert traffic["ring"]["sent"] == [2 * (n - 1) * s // n] * n
    assert traffic["ring"]["sends"] == [2 * (n - 1)] * n                # the ring's steps, counted message by message
    assert traffic["root"]["sent"] == [(n - 1) * s] + [s] * (n - 1)
    assert traffic["root"]["received"][0] == (n - 1) * s
    assert sum(traffic["ring"]["sent"]) == sum(traffic["root"]["sent"])  # same total, different peak
    assert traffic["small_ring_s"] > 0 and traffic["ring_s"] > 0         # both sizes were timed


def test_latency_fit_and_slowest_rank():
    from minipar.course.ch00_setup_and_collectives import latency
    assert latency.slowest_rank_fastest([[1.0, 5.0, 2.0], [3.0, 1.0, 2.0]]) == 2.0   # per repeat: max 3, 5, 2
    # exactly 2(N-1)·0.1 ms + 2(N-1)/N·S / (1 GB/s) on 2 ranks over the sweep's sizes: the fit gives them back
    exact = {s: 2 * 1e-4 + s / 1e9 for s in latency.RING_SIZES}
    assert latency.fit_ring(exact) == pytest.approx((1e-4, 1e9))
    # slower per byte from 1 MiB on (as on this machine): α from the small sizes, β from the large ones, so the
    # largest size sits on the model (one fit in relative error over all sizes missed it by 2.3×)
    two_regimes = {s: 2 * 1e-4 + s / (1e9 if s < 2 ** 20 else 0.2e9) for s in latency.RING_SIZES}
    assert latency.fit_ring(two_regimes) == pytest.approx((1e-4, 0.2e9), rel=0.01)
    # small sizes that do not grow with size (all steps, as in a real sweep here) still give α, and no error
    flat_small = {s: (3e-4 if s <= latency.SMALL_BYTES else 2 * 1e-4 + s / 1e9) for s in latency.RING_SIZES}
    assert latency.fit_ring(flat_small)[0] == pytest.approx(1.5e-4, rel=0.01)
    with pytest.raises(ValueError, match="two sizes"):
        latency.fit_ring({16: 1e-4, 2 ** 24: 1e-2})
    assert latency.crossover_bytes(2, 1e-4, 1e9) == pytest.approx(2e5)   # 2·α = S*/β at S* = N·α·β
    with pytest.raises(ValueError, match="whole float32 chunks"):
        latency.time_ring_sizes(2, sizes=(16, 18))
    # published links, priced by hand: InfiniBand at N = 1024, 1 MiB: 2·1023·14 µs + 2·1023/1024·2^20 B / 50 GB/s
    rows = {(link, n): by_size for link, n, by_size in latency.published_ring_rows()}
    ib = next(link for link in latency.PUBLISHED_LINKS if link.startswith("InfiniBand"))
    t, share = rows[ib, 1024][2 ** 20]
    assert t == pytest.approx(2 * 1023 * 14e-6 + 2 * 1023 / 1024 * 2 ** 20 / 50e9)
    assert share == pytest.approx(2 * 1023 * 14e-6 / t)
    assert not any(link.startswith("NVLink") and n > 8 for link, n in rows)   # NVLink: within one 8-GPU node


def test_later_links_print_the_later_chapters_link_cards_beside_nccl(capsys):
    """Chapter 00's published α (NCCL's tuning table) and the link cards chapters 02 to 13 price with differ:
    Appendix D's display prints both, each link on one line, so no learner meets two unexplained values."""
    from minipar.course.ch00_setup_and_collectives import report
    from minipar.machine.cluster import IB_NDR, NVLINK4
    report.show_later_links()
    lines = capsys.readouterr().out.splitlines()
    for link, card in [("NVLink 4", NVLINK4), ("InfiniBand NDR", IB_NDR)]:
        alpha_table = next(a for name, (a, _, _) in report.PUBLISHED_LINKS.items() if name.startswith(link))
        assert any(line.startswith(link) and f"{alpha_table * 1e6:.1f} µs" in line
                   and f"{card.latency * 1e6:.0f} µs" in line and f"{card.beta / 1e9:.0f} GB/s" in line
                   for line in lines), (link, lines)
    # NCCL's hwLat is by link type: NVLink 3 gets NVLink 4's 3.4 µs, InfiniBand HDR gets NDR's 14.0 µs, and
    # PCIe has its own row (5.7 µs), not "not quoted"; the header says so (the NCCL versions are in Sources)
    assert any("by link type" in line for line in lines), lines
    for link, alpha in [("NVLink 3", "3.4 µs"), ("InfiniBand HDR", "14.0 µs"), ("PCIe 3.0", "5.7 µs (any PCI)")]:
        assert any(line.startswith(link) and alpha in line for line in lines), (link, lines)


def test_bad_input_is_refused_before_launch():
    with pytest.raises(ValueError, match="divide evenly"):
        ch00.run_collectives(4, ["all_reduce"], numel=10)
    with pytest.raises(ValueError, match="unknown operations"):
        ch00.run_collectives(4, ["allreduce"], numel=8)
    with pytest.raises(ValueError, match="at most 9"):
        ch00.run_collectives(4, ["all_reduce"], numel=12, values="small")


def test_tour_json_for_ring_rows(capsys):
    """``python -m minipar tour --json -k "ring all"``, through the same entry point, in this process."""
    from minipar.__main__ import main
    # "ring all" picks exactly two rows; "ring " would also pick chapter 06's "... ring RS, tp=4" row
    code = main(["tour", "--json", "-k", "ring all"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = json.loads(out)
    assert [r["strategy"] for r in rows] == ["ring all_reduce", "ring all_gather"]
    for r in rows:
        assert KEYS <= set(r), r
        assert r["world_size"] == 4 and r["matches"] is True
        assert r["bytes_sent_per_rank"] == r["bytes_formula"]
        assert r["peak_bytes_per_rank"] is None
        assert r["kind"] == "collective" and r["observed_status"] == "within", r
        assert r["bytes_formula"] <= r["bytes_observed_per_rank"] <= r["bytes_formula"] + 2048 * r["calls_per_rank"]


def test_figures_are_drawn_from_the_run(tmp_path):
    """The chapter's diagrams come from the tensors the ranks returned (the sums 64..92 of the small inputs
    appear as cell labels), and the traffic plot from measured bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from minipar.course.ch00_setup_and_collectives import figures as fig00

    outcomes = ch00.run_collectives(4, fig00.DIAGRAM_OPS, numel=8, values="small")
    figure = fig00.collectives_figure(outcomes)
    labels = {t.get_text() for ax in figure.axes for t in ax.texts}
    assert {"64", "92", "38"} <= labels and "— (nothing defined)" in labels
    plt.close(figure)
    sweep = fig00.traffic_sweep((2, 3), numel=48)
    figure = fig00.plot_traffic(sweep, 48 * 4)
    measured_root = figure.axes[0].lines[0].get_ydata().tolist()
    assert measured_root == [1.0, 2.0]  # (N-1) S for N = 2, 3, read back from the plotted data
    timed = {n: {"small_ring_s": 2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * 4096 / 1e9,
                 "ring_s": 2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * 2**17 / 1e9} for n in (2, 4, 8)}
    sizes = {s: 2 * 1e-4 + s / 1e9 for s in (16, 2**12, 2**20, 2**24)}   # 2 ranks: α 0.1 ms, β 1 GB/s
    latency = fig00.plot_ring_time(sizes, timed, 2**17, 8)  # points: the timings; fit: α, β
    left, right = latency.axes
    assert left.lines[0].get_ydata().tolist() == [sizes[s] * 1e3 for s in sorted(sizes)]
    assert "α = 0.10 ms a step, β = 1 GB/s" in left.get_title()
    assert right.lines[0].get_ydata().tolist() == [timed[n]["small_ring_s"] * 1e3 for n in (2, 4, 8)]
    plt.close(latency)
    latency = fig00.plot_ring_time(sizes, timed, 2**17, 2)  # on 2 cores, N = 4 and 8 are not drawn as measured
    measured = [line.get_xdata().tolist() for line in latency.axes[1].lines if line.get_marker() == "s"]
    assert measured == [[2], [2]]
    plt.close(latency)
    figure.savefig(tmp_path / "traffic.png")
    plt.close(figure)


def test_table_shows_observed_bytes_and_notes_and_the_headline_counts_by_kind():
    """The runner itself (no launch): the observed column, a footnote per note, marks for the kinds, and a
    headline that counts training runs, collectives and update-rule rows apart."""
    rows = [tour.TourRow("train", 4, True, 0.0, 100.0, 100.0, None, "why A", bytes_observed_per_rank=150.0,
                         calls_per_rank=1),
            tour.TourRow("coll", 4, True, 0.0, 1e6, 1e6, None, "why B", bytes_observed_per_rank=2e6,
                         kind="collective", calls_per_rank=1),
            tour.TourRow("async", 4, True, 0.0, None, None, None, "own rule", kind="update rule"),
            tour.TourRow("threads", 4, False, 1.0, 10.0, 10.0, None, "")]
    table = tour.format_table(rows)
    assert "observed" in table and "[1] why A" in table and "[2] why B" in table and "[3] own rule" in table
    assert "150 B" in table and "2.00 !" in table and "‡" in table and "†" in table
    text = tour.headline(rows)
    assert "1 of 2 training runs equal one device" in text
    assert "1 of 1 collectives" in text and "1 of 1 asynchronous runs equal their own update rule" in text
    assert "2 of 3 rows that communicate: 1 within" in text and "not observed: threads" in text
    assert "NOT matching: threads" in text


def test_expected_ring_messages_follow_the_ring():
    """Worked out on one process: the reduce-scatter sends grow by one rank a step, the all-gather sends
    are finished sums, and each rank's last all-gather send is what its right neighbour still lacked."""
    for n in (2, 3, 4, 5):
        inputs = [10.0 * q + torch.arange(1, 2 * n + 1) for q in range(n)]
        total = sum(inputs).chunk(n)
        msgs = ch00.expected_ring_messages(n)
        assert len(msgs) == n and all(len(m) == 2 * (n - 1) for m in msgs)
        for r in range(n):
            assert msgs[r][0] == inputs[r].chunk(n)[(r - 1) % n].tolist()          # step 1: its own chunk
            assert msgs[r][n - 2] == (total[(r + 1) % n] - inputs[(r + 1) % n].chunk(n)[(r + 1) % n]).tolist()
            assert {tuple(m) for m in msgs[r][n - 1:]} == {tuple(total[c].tolist()) for c in range(n)
                                                          if c != (r + 1) % n}


def test_the_chapter_table_shows_each_collectives_busiest_rank():
    """The tour averages over ranks (broadcast: 768 KiB); the chapter shows the rank a collective waits for:
    the root of a broadcast sends (N-1)·S = 3 S, the others of a reduce S each (small payload: 4 KiB)."""
    S = 4096
    rows = {r["name"]: r for r in ch00.busiest_rank_rows(4, numel=S // 4)}
    assert set(rows) == set(ch00.COLLECTIVES) and all(r["matches"] for r in rows.values())
    assert (rows["broadcast"]["rank"], rows["broadcast"]["model"], rows["broadcast"]["formula"]) == (0, 3 * S, 3 * S)
    assert rows["reduce"]["rank"] != 0 and rows["reduce"]["model"] == rows["reduce"]["formula"] == S
    assert rows["ring all_reduce"]["model"] == rows["ring all_reduce"]["formula"] == 2 * 3 / 4 * S
    table = ch00.format_busiest(list(rows.values()))
    assert "busiest sender" in table and "gloo: a tree" in table and table.count("\n") == len(rows)
    assert "on the wire" in table and "log" not in table.splitlines()[0]   # the log's count is not shown as measured
    assert "wire - formula" not in table                                   # gloo's framing: one line under it
    assert {n for n, r in rows.items() if r["log_counts_sends"]} == {"send/recv", "ring all_reduce", "ring all_gather",
                                                                     "ring reduce_scatter"}


def test_learner_table_notes_only_where_the_wire_differs():
    from minipar.course.ch00_setup_and_collectives.tour import GLOO_SHORT, learner_table
    from minipar.course.tour import TourRow
    rows = [TourRow(name, 4, True, 0.0, 768 * 1024, 768 * 1024, None, "long note; S = 1048576 B; mean over ranks",
                    bytes_observed_per_rank=observed, kind="collective")
            for name, observed in (("all_gather", 768 * 1024 + 800), ("reduce_scatter", 2 * 768 * 1024))]
    text = learner_table(rows)
    assert "[1]" not in text and "long note" not in text                       # no footnotes
    assert GLOO_SHORT["reduce_scatter"] in text and text.count("gloo:") == 1   # the one row whose wire differs
    assert "2.00" in text and "1.00" in text
