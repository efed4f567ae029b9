"""How often to checkpoint, from first principles (Young 1974; Daly 2006).

A run saves every τ seconds of work; a save blocks training for C seconds; failures arrive at random with a mean
time between failures M (seconds of wall clock, for the whole job: a job on N devices fails N times as often as
one device). Per unit of useful work, two costs compete:

    saving:   C / τ                      (one save per interval)
    losing:   (τ / 2) / M                (a failure loses, on average, half an interval of work)

    waste(τ) = C/τ + τ/(2M),   d waste/dτ = 0   ⇒   τ* = √(2·C·M),   waste(τ*) = √(2C/M)

Young, "A first order approximation to the optimum checkpoint interval", Communications of the ACM 17(9), 1974;
Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future Generation Computer
Systems 22(3), 2006, whose higher-order estimate √(2CM)·[1 + ⅓√(C/2M) + (C/2M)/9] − C (for C < 2M) differs from
Young's by about C/τ* (a few per cent while C ≪ M). The restart time R (reload, re-warm) adds R/M to the waste and leaves τ* as it is.

Published failure rates (mean time between *job* interruptions):

- Llama 3 405B (Grattafiori et al., "The Llama 3 Herd of Models", 2024, §3.3.4 "Reliability and Operational
  Challenges"): 466 job interruptions in a 54-day snapshot of pre-training on 16,384 H100s, 419 of them
  unexpected (78 % of those confirmed or suspected hardware: GPUs 30.1 %, HBM3 17.2 %): one unexpected
  interruption every 54·24/419 ≈ 3.1 hours; over 90 % effective training time.
- OPT-175B (Zhang et al., "OPT: Open Pre-trained Transformer Language Models", 2022, §2.5, and its logbook):
  992 A100s, "at least 35 manual restarts" and over 100 hosts cycled out in about two months.

What asynchronous saving changes: the blocking cost C is the snapshot (copying the state to host memory), not the
write to storage, which overlaps training. With C shrunk, τ* = √(2CM) shrinks as √C and the waste √(2C/M) with
it; the write time W only bounds τ from below (a save cannot start before the previous one finished: τ ≥ W), and
the work lost on a failure grows by the write still in flight (the newest complete checkpoint is one interval
older while a write is under way): losing ≈ (τ/2 + W)/M.
"""
from __future__ import annotations

import math

__all__ = ["LLAMA3_405B", "young_daly_interval", "daly_interval", "wasted_fraction", "mtbf_seconds",
           "async_interval"]

# (unexpected interruptions, days, devices): Llama 3 paper §3.3.4
LLAMA3_405B = {"interruptions": 419, "days": 54, "gpus": 16_384}


def mtbf_seconds(interruptions: int, days: float) -> float:
    """Mean time between job interruptions, in seconds: ``days`` of wall clock over ``interruptions``."""
    if interruptions <= 0 or days <= 0:
        raise ValueError(f"need a positive count and duration, got {interruptions} interruptions in {days} days")
    return days * 86_400 / interruptions


def young_daly_interval(save_seconds: float, mtbf: float) -> float:
    """τ* = √(2·C·M): the seconds of training between checkpoints that minimise C/τ + τ/(2M) (Young 1974)."""
    if save_seconds < 0 or mtbf <= 0:
        raise ValueError(f"need C ≥ 0 and M > 0, got C={save_seconds}, M={mtbf}")
    return math.sqrt(2 * save_seconds * mtbf)


def daly_interval(save_seconds: float, mtbf: float) -> float:
    """Daly's (2006) higher-order estimate √(2CM)·[1 + ⅓√(C/2M) + (C/2M)/9] − C, for C < 2M (else M)."""
    c, m = save_seconds, mtbf
    if c >= 2 * m:
        return m
    r = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c


def wasted_fraction(interval: float, save_seconds: float, mtbf: float, *, restart_seconds: float = 0.0,
                    in_flight_seconds: float = 0.0) -> float:
    """The first-order fraction of wall clock not spent on new work: C/τ (saving) + (τ/2 + W)/M (work redone
    after a failure, W the write still in flight for an asynchronous save) + R/M (restart)."""
    if interval <= 0:
        raise ValueError(f"the interval must be positive, got {interval}")
    return save_seconds / interval + (interval / 2 + in_flight_seconds + restart_seconds) / mtbf


def async_interval(snapshot_seconds: float, write_seconds: float, mtbf: float) -> float:
    """The interval for an asynchronous save: Young/Daly with the blocking cost C = the snapshot, but never
    shorter than the background write (one save in flight at a time)."""
    return max(young_daly_interval(snapshot_seconds, mtbf), write_seconds)
