"""Chapter 04's displays: each prints (or draws) what one cell ran and holds it to the chapter's claims
(:mod:`.claims`), printing nothing more when they hold — so a cell reads ``result = run(...)``, ``show(result)``."""
from __future__ import annotations

import matplotlib.pyplot as plt

from minipar.pipeline import make_schedule, simulate
from minipar.pipeline.runtime import measured_idle_fraction, typical_step

from . import claims
from .figures import draw_measured, draw_memory, paced_idle, peak_held

__all__ = ["show_refusal", "show_bubble_sweep", "show_held", "show_memory", "show_unpaced", "show_paced",
           "show_pytorch_order"]


def show_refusal(err) -> None:
    """The ValueError a tied model gets before any process starts."""
    print("ValueError:", err)
    claims.check_tied_model_refused(err)


def show_bubble_sweep(p: int, ms=(1, 2, 4, 8, 16, 32)) -> None:
    """GPipe simulated at each m: both bubble conventions beside their formulas."""
    sims = {m: simulate(make_schedule("gpipe", p, m)) for m in ms}
    for m, sim in sims.items():
        print(f"m={m:2d}: idle/total {sim.bubble_fraction:6.1%} (formula (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):6.1%})   "
              f"idle/ideal {sim.bubble_ratio:6.1%} (formula (p-1)/m = {(p - 1) / m:6.1%})")
    claims.check_gpipe_micro_batches_fill_pipe(p, sims)


def show_held(runs: dict, p: int, m: int) -> dict:
    """{schedule: micro-batches held at the peak, per rank}, counted from each rank's recorded actions."""
    held = {s: [peak_held(run) for run in runs[s]] for s in ("gpipe", "1f1b")}
    print("micro-batches held at the peak, per rank (measured: counted from each rank's recorded actions):")
    for s in ("gpipe", "1f1b"):
        print(f"  {s:5s}: {held[s]}   simulated {simulate(make_schedule(s, p, m)).peak_in_flight}")
    return held


def show_memory(memory: dict, held: dict, p: int, m: int) -> None:
    """Peak live KiB per rank of {(schedule, recompute): runs}, printed and drawn."""
    def peak_kib(rs, rank):
        return max(b for _, _, b in rs[rank].memory) / 1024

    for (s, rc), rs in memory.items():
        print(f"{s:5s}{' + recompute' if rc else '            '}: peak live KiB per rank",
              [round(peak_kib(rs, r)) for r in range(p)])
    draw_memory(memory)
    plt.show()
    claims.check_activations_held_per_stage(held, m, p, peak_kib, memory)


def show_unpaced(shown: dict, p: int) -> dict:
    """{(schedule, m, v): runs} → {schedule: measured idle fraction of its median step}, beside the formula."""
    unpaced = {n: measured_idle_fraction(rs, typical_step(rs)) for (n, m, v), rs in shown.items()}
    for (n, m, v) in shown:
        print(f"{n:11s}: formula (simulated) {simulate(make_schedule(n, p, m, v)).bubble_fraction:5.1%}   "
              f"measured unpaced {unpaced[n]:5.1%}")
    claims.check_every_schedule_simulated_measured_unpaced(unpaced)
    return unpaced


def show_paced(paced: dict, unpaced: dict, p: int):
    """The paced runs drawn and tabled beside the formula and the unpaced idle."""
    draw_measured(paced, p)
    plt.show()
    idle = paced_idle(paced, unpaced, p)
    print(idle)
    claims.check_schedules_bubble_within_5_points(idle)   # the schedule's bubble, within 5 points
    return idle


def show_pytorch_order(beside: dict, p: int, m: int) -> None:
    """Where PyTorch's own ``pipeline_order`` for 1F1B differs from what its stages ran."""
    for r, run in enumerate(beside["1f1b"].runs):
        if run.order != run.executed:
            print(f"1f1b rank {r}: pipeline_order says {' '.join(map(str, run.order[:4]))} ... "
                  f"{' '.join(map(str, run.order[-3:]))};  what ran: {' '.join(map(str, run.executed[:4]))} ... "
                  f"{' '.join(map(str, run.executed[-3:]))}")
    claims.check_last_stage_ran_m_forwards_m(beside, beside["1f1b"].runs[-1], m)
    claims.check_pytorch_order_off_by_one(beside, p)
