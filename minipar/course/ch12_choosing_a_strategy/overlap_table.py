"""§5's table, one row per network and overlap setting: the pipeline's and ZeRO-3's picks, each with its step and
its memory per GPU (the planner's own estimates), the fastest layout's step and ZeRO-3's against it."""
from __future__ import annotations

from dataclasses import replace

from . import claims

GB = 1e9
HEADER = (f"{'links':9}{'overlap':8}{'pipeline s':>10}{'GB':>6}{'ZeRO-3 s':>13}{'GB':>6}"
          f"{'fastest s':>11}  ZeRO-3 ÷ fastest")


def short(layout) -> str:
    """A layout's degrees in a few words: "TP 4 · PP 16 (v 2) · ZeRO-1", "TP 2 · ZeRO-3"."""
    parts = [f"TP {layout.tp}"] + ([f"PP {layout.pp}" + (f" (v {layout.v})" if layout.v > 1 else "")]
                                   if layout.pp > 1 else [])
    return " · ".join(parts + ([f"ZeRO-{layout.zero}"] if layout.zero else []))


def sides(p):
    """The pipeline's and ZeRO-3's layouts by the pick rule (``Plan.pick_among``; ZeRO-3 at any TP)."""
    return p.pick_among(lambda fam: "PP" in fam), p.pick_among(lambda fam: fam.startswith("ZeRO-3"))


def row(links, overlap, p) -> str:
    """One line: the pipeline's and ZeRO-3's steps and GB per GPU; the fastest layout's step; ZeRO-3's step ÷
    the fastest's, against the band."""
    with_pp, zero3 = sides(p)
    to_fastest = zero3.step_seconds / p.fastest.step_seconds
    inside = "inside" if to_fastest <= 1 + p.tie else "outside"
    return (f"{links:9}{overlap:8}{with_pp.step_seconds:10.1f}"
            f"{with_pp.memory['total'] / GB:6.1f}{f'{zero3.step_seconds:.1f} (TP {zero3.layout.tp})':>13}"
            f"{zero3.memory['total'] / GB:6.1f}{p.fastest.step_seconds:11.1f}{to_fastest:9.2f}, {inside}")


def layouts(links, overlap, p) -> str:
    """One line: each side's layout in short, with its micro-batches (count × size), inside the band or not."""
    with_pp, zero3 = sides(p)
    band = (1 + p.tie) * p.fastest.step_seconds
    words = lambda e, lay: (f"{short(lay)}, {e.layout.micro_batches} × {e.layout.micro_batch} "  # noqa: E731
                            f"({'inside' if e.step_seconds <= band else 'outside'})")
    return (f"  {links:9}{overlap:5}pipeline: {words(with_pp, with_pp.layout):47}"
            f"ZeRO-3: {words(zero3, replace(zero3.layout, zero=0))}")


def fastest(plans) -> str:
    """The fastest layout of all, row by row, consecutive rows with the same layout grouped."""
    groups = []                                    # [short layout, first row, last row]
    for i, pl in enumerate(plans.values(), 1):
        words = short(pl.fastest.layout)
        if groups and groups[-1][0] == words:
            groups[-1][2] = i
        else:
            groups.append([words, i, i])
    return "the fastest layout of all:\n  " + "; ".join(
        (f"rows {a}-{b}: " if b > a else f"row {a}: ") + w for w, a, b in groups)


def table(plans) -> str:
    """The header, one row per plan, each side's layout and the fastest layout of all. The middle rows' memory
    (ZeRO-3 just outside the band, the pipeline's pick inside, with less than half its memory) is held by a claim."""
    close = [sides(pl) for pl in list(plans.values())[1:3]]
    ratios = [pp.memory["total"] / z.memory["total"] for pp, z in close]
    claims.check_pipeline_memory_ratio(close, ratios)
    return "\n".join([HEADER, *(row(links, overlap, pl) for (links, overlap), pl in plans.items()),
                      "\neach side's layout (micro-batches: count × size) and whether it is inside the band:",
                      *(layouts(links, overlap, pl) for (links, overlap), pl in plans.items()), fastest(plans)])
