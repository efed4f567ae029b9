"""Chapter 04's sentences under its measured runs, written from their numbers: the paced table's verdict (which
way each schedule missed its simulation, and why; or that a disturbed run is not evidence) and the reading of
the ladder's last step (its explanation chosen by the sign of measured − replay)."""
from __future__ import annotations

import os

__all__ = ["NAMES", "paced_verdict", "paced_sign", "ladder_reading"]

NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved"}


def paced_verdict(idle) -> str:
    """The sentence under the paced table, written from its numbers: how close each schedule came to its
    simulation when no run was disturbed; that this run is not evidence when one was (too many slots ran long,
    or the machine was loaded: overrunning spans count as busy, so the idle can even fall below the bound)."""
    if idle.disturbed:
        which = ("every schedule" if len(idle.disturbed) == len(idle.rows)
                 else ", ".join(NAMES.get(n, n) for n in idle.disturbed))
        return (f"This run is not evidence: other load took the cores ({which}; the line above says how), so its "
                f"idle fractions say nothing about the schedules, and the prediction is not revealed.")
    off = {n: paced - sim for n, (sim, paced, _, _) in idle.rows.items()}
    worst = max(abs(d) for d in off.values())
    parts = [f"{NAMES.get(n, n)} {100 * d:+.1f}" for n, d in off.items()]
    out = (f"Held to their slots, every schedule idles within {100 * worst:.1f} points of its simulation "
           f"({', '.join(parts)} points)")
    paced = {n: r[1] for n, r in idle.rows.items()}
    if {"gpipe", "1f1b"} <= set(paced):
        out += f"; GPipe and 1F1B lie {100 * abs(paced['gpipe'] - paced['1f1b']):.1f} points apart"
    if "interleaved" in paced and min(paced, key=paced.get) == "interleaved":
        out += "; interleaving idles least"
    return out + ": the bubbles of §2, §3 and §5 hold on real ranks." + paced_sign(off)


def paced_sign(off: dict) -> str:
    """Which way the paced run missed its simulation, and why, from the signs of ``off`` (paced − simulated)."""
    if all(d <= 0 for d in off.values()) and any(d < 0 for d in off.values()):
        return (" All sit slightly below: a sleep that wakes late lengthens its action's span, which counts as busy,"
                " while the next slots keep to the schedule's clock, so the step hardly grows.")
    if all(d >= 0 for d in off.values()) and any(d > 0 for d in off.values()):
        return (" All sit slightly above: a late wake-up in the step's last action stretches the step itself, idle"
                " time on every other rank.")
    if any(off.values()):
        return (" Two small errors pull opposite ways: a sleep that wakes late lengthens its action's span (busy:"
                " less idle); one in the step's last action stretches the step (idle on the other ranks: more).")
    return ""


def ladder_reading(idle: dict, cores: int | None = None) -> str:
    """What the replay with shared cores leaves over the measured run, its explanation chosen by the sign of
    (measured - replay) in the whole points the ladder prints: above it, waits no row models (a rank whose message
    has arrived waiting for a core); below it, the replay counting some waiting twice; level, nothing left."""
    cores = cores or os.cpu_count() or 1
    rest = round(100 * idle["measured"]) - round(100 * idle["cores"])
    pts = f"{abs(rest)} point{'s' * (abs(rest) != 1)}"
    if rest > 0:
        return (f"The measured run idles {pts} more than the last replay. That rest we did not measure; our guess is "
                f"wake-up delay, which the replay does not model: it starts a rank the instant its message lands, "
                f"while here a rank whose message has arrived may wait for one of the {cores} cores.")
    if rest < 0:
        return (f"The measured run idles {pts} less than the last replay, so the replay counts some waiting twice "
                f"(our reading; we did not measure it): a segment's wall time already holds the waits for a core "
                f"that stretched it where it ran, and replayed, that stretch can land where the run had a core free.")
    return "The measured run idles as the last replay does, to the point: no term is left over."
