"""What chapter 12's cells show: each function takes the numbers a cell computed, checks what the chapter's text
says about them (raising ``AssertionError`` when a sentence no longer holds) and returns a small table as
:class:`Shown` text, so that a cell is one call."""
from __future__ import annotations

from minipar.machine.device import FITTED
from minipar.plan import GPT3_175B, Layout, estimate, parameters
from minipar.plan.published import TOLERANCE, table_text

__all__ = ["Shown", "published", "hand_layouts"]

GB = 1e9


class Shown(str):
    """Text a notebook shows as it is: a cell ending in a call that returns it prints it, without quotes."""

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def published(pub: list, tolerance: float = TOLERANCE) -> Shown:
    """Section 2: :func:`minipar.plan.published.table` as text (its last line counts the check rows within
    ±``tolerance``), each card's one fitted number and the row it was fitted to, and the farthest check."""
    checks = [r for r in pub if r["role"] == "check"]
    worst = max(checks, key=lambda r: abs(r["ratio"] - 1))
    return Shown("\n".join([table_text(pub, tolerance)] + [f"{card}: {what}" for card, what in FITTED.items()]
                           + [f"the farthest check: {worst['run']}, model x{worst['ratio']:.2f}"]))


HAND_LAYOUTS = {"TP 8 · PP 16 · DP 8, 1F1B": Layout(dp=8, tp=8, pp=16, micro_batches=192),
                "ZeRO-3 · TP 2 · DP 512": Layout(dp=512, tp=2, zero=3, recompute="full", micro_batch=1,
                                                 micro_batches=3)}
_RECOMPUTED = {"none": "recomputes nothing: 6 FLOPs per parameter per token",
               "selective": "recomputes the attention core (selective): 6 FLOPs per parameter per token and a little",
               "full": "recomputes every layer (full): 8 FLOPs per parameter per token"}


def hand_layouts(best, cluster) -> tuple:
    """Section 3: (the planner's best beside :data:`HAND_LAYOUTS` as {label: Estimate}, their table, GPT-3's
    300 B tokens in days at the best's step time beside Narayanan et al.'s 8TP/(nX) (their Eq. 4, X = 140
    TFLOP/s per GPU) — as text)."""
    ests = {"planner's best": best, **{k: estimate(GPT3_175B, cluster, l) for k, l in HAND_LAYOUTS.items()}}
    lines = [f"{k:<28} {e.memory['total'] / GB:6.1f} GB  {e.step_seconds:6.2f} s/step  MFU {e.mfu:.1%}  {e.layout}"
             for k, e in ests.items()]
    days = 300e9 / (1536 * 2048) * best.step_seconds / 86400
    narayanan = 8 * 300e9 * parameters(GPT3_175B) / (1024 * 140e12) / 86400
    lines += [f"GPT-3's 300 B tokens at {best.step_seconds:.1f} s per 1536 × 2048 tokens: {days:.0f} days",
              f"Narayanan et al.'s estimate 8TP/(nX): {narayanan:.0f} days",
              f"the planner's layout ({best.layout}) {_RECOMPUTED[best.layout.recompute]}"]
    assert best.step_seconds <= min(e.step_seconds for e in ests.values() if e.fits) + 1e-9
    assert 15 < days < 40 and round(narayanan) == 34
    return ests, Shown("\n".join(lines))
