"""Chapter 04b's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

from minipar.observe.busy import disturbed
from minipar.pipeline import make_schedule
from minipar.pipeline import simulate


def check_zero_bubble_split_backward_into(P, M) -> None:
    """Zero bubble: split the backward into B and W"""
    assert simulate(make_schedule("zb-h1", P, M)).makespan - 3 * M == (P - 1) * (1 + 1 - 1)
    assert simulate(make_schedule("zb-h1", P, M)).peak_in_flight == [4, 4, 4, 4] and simulate(make_schedule("1f1b", P, M)).peak_in_flight == [4, 3, 2, 1]


def check_split_moves_work_not_messages(sent, P, M, A) -> None:
    """Zero bubble: split the backward into B and W: the split moves work, not messages"""
    assert sent["zb-h1"] == sent["1f1b"] == 2 * (P - 1) * M * A / P


def check_why_runtime_cannot_deadlock_schedule(messages, M, P) -> None:
    """Why the runtime cannot deadlock, and a schedule that does"""
    assert messages == {"gpipe": 2 * M * (P - 1), "1f1b": 2 * M * (P - 1), "interleaved": 2 * M * (2 * P - 1), "zb-h1": 2 * M * (P - 1)}


def check_v_zb_v_dualpipev(zbv, P, v_sims) -> None:
    """The V: ZB-V and DualPipeV"""
    assert [zbv.stages_of(r) for r in range(P)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert v_sims["zb-v"].bubble_fraction < v_sims["zb-h1"].bubble_fraction < v_sims["1f1b"].bubble_fraction
    assert v_sims["zb-v"].p2p_messages == v_sims["dualpipev"].p2p_messages == 2 * v_sims["1f1b"].p2p_messages
    assert v_sims["zb-v"].peak_activations == [4.0] * P and v_sims["dualpipev"].peak_activations == [4.5] * P


def check_v_schedules_bytes_sent(sent, P, M, A, runs) -> None:
    """The V: ZB-V and DualPipeV"""
    assert all(sent[n] == 2 * (2 * P - 2) * M * A / P for n in ("zb-v", "dualpipev"))
    assert all(runs[n][0].losses is not None and all(r.losses is None for r in runs[n][1:]) for n in ("zb-v", "dualpipev"))


def check_paced_zb_v_idles_less_than_1f1b(paced) -> None:
    """Simulated and measured, paced: ZB-V idles less than 1F1B and steps faster, outside the run-to-run spread;
    every paced run equals one device and idles as the simulator says, within 5 points. Where ZB-V's or
    1F1B's run was disturbed (more than 5 % of its actions overran their slots, or other processes had the cores
    while it ran: :func:`minipar.observe.busy.disturbed`) and the spreads overlap, it says so instead of failing:
    the load, not the schedule, decided that run."""
    assert all(r.matches for r in paced.rows.values()), paced          # every paced run equals one device
    assert paced.agrees(within=0.05), paced                             # undisturbed runs: as simulated
    if not paced.apart("zb-v", "1f1b"):
        assert {"zb-v", "1f1b"} & set(paced.disturbed), paced           # undisturbed, the lesson must show
        machine = disturbed(0, 1, paced.load, other=paced.other)       # the machine, not the slots, disturbed it
        why = ("overran more than 5 % of their slots" if not machine else
               f"ran while other processes used {paced.other:.1f} cores" if paced.other is not None else
               "ran with more than twice as many runnable processes as cores")
        print(f"not shown this time: {', '.join(paced.disturbed)} {why} at load average {paced.load:.0f}; "
              "run the cell again on a quieter machine")


def check_every_row_simulated_v_half_included(zb_rows, slack) -> None:
    """Two published tables, reproduced: every row simulated, V-Half included"""
    assert all(sim is not None for _, _, sim in zb_rows)     # every row simulated, V-Half included
    assert all(abs(sim[0] - pub[0]) <= 0.25 and sim[2] == pub[2] and pub[1] <= sim[1] <= pub[1] + slack.get(n, 0) for n, pub, sim in zb_rows)


def check_two_published_tables_reproduced(zb, dp_rows, apart, P) -> None:
    """Two published tables, reproduced"""
    assert zb["ZB-V"][0] < zb["ZB1P"][0] < zb["V-Half"][0] < zb["V-Min"][0] < zb["1F1B"][0]
    assert zb["V-Min"][1] < zb["V-Half"][1] < zb["ZB-V"][1] == zb["1F1B"][1]
    assert all(sim == pub for _, pub, sim in dp_rows) and apart.idle(0) == P - 1


def check_lifespans_within_published_range(P, lifespans, reordered, alone, b_1f1b) -> None:
    """Two published tables, reproduced"""
    assert all(6 * P <= sum(x) <= 6 * P + 14 for x in lifespans)
    assert reordered.bubble_fraction < alone.bubble_fraction - 0.15 * b_1f1b and max(reordered.peak_in_flight) <= max(alone.peak_in_flight) <= P + 3


def check_pytorchs_zb_v_dualpipev_beside(beside) -> None:
    """PyTorch's ZB-V and DualPipeV beside minipar's"""
    assert all(beside[n].executed_equal and beside[n].order_equal for n in ("zb-v", "dualpipev"))
