"""Where *总结*'s "3D: least communication" starts to hold, by chapter 07's own formulas
(:func:`minipar.tensor.multidim_measure.formula_bytes`, checked against the wire at P = 4 and 8).

3D needs P = q³ ranks, 2D P = q², so the two are compared only at the P where both grids exist (64 = 8² = 4³,
729, ...); 1D runs on any P. Per rank and per MLP forward + backward, 3D sends 2(q−1)/q³·(|X|+|A|+|Y|) per
linear (Agarwal et al. 1995; Bian et al. 2021), 2D 3(q−1)(|X|+|A|)/q² (SUMMA), 1D 2(P−1)/P·|X or Y| per
all-reduce (Megatron).
"""
from __future__ import annotations

from minipar.tensor.multidim_measure import formula_bytes

__all__ = ["WORKLOADS", "first_p_below", "threshold_table", "threshold_text"]

# (name, MLP sizes, tokens, bytes per value): the MLP §7 measures, and §8's h = 8192 MLP in fp16
WORKLOADS = [("MLP [32, 128, 32], 32 tokens, fp32 (§7)", (32, 128, 32), 32, 4)] + [
    (f"h = 8192 MLP, {t} tokens, fp16 (§8)", (8192, 32768, 8192), t, 2) for t in (16384, 2048, 256)]


def _cubes(limit: int):
    return [q ** 3 for q in range(2, round(limit ** (1 / 3)) + 1)]


def _squares(limit: int):
    return {q ** 2 for q in range(2, int(limit ** 0.5) + 1)}


def first_p_below(other: str, sizes, tokens: int, value_bytes: int, limit: int = 2 ** 15):
    """(P, 3D bytes / other's bytes) at the smallest P where both grids exist and 3D sends fewer bytes per
    rank than ``other`` ("1d" or "2d"); ``(None, None)`` if none up to ``limit`` ranks."""
    for p in _cubes(limit):
        if other == "2d" and p not in _squares(limit):
            continue
        mine, theirs = (formula_bytes(layout, p, sizes, tokens, value_bytes=value_bytes) for layout in ("3d", other))
        if mine < theirs:
            return p, mine / theirs
    return None, None


def threshold_table(workloads=WORKLOADS) -> list:
    """[{workload, vs 2D: (P, ratio), vs 1D: (P, ratio), 3D/1D at P = 8}] — one row per workload."""
    rows = []
    for name, sizes, tokens, vb in workloads:
        at8 = (formula_bytes("3d", 8, sizes, tokens, value_bytes=vb)
               / formula_bytes("1d", 8, sizes, tokens, value_bytes=vb))
        rows.append({"workload": name, "vs_2d": first_p_below("2d", sizes, tokens, vb),
                     "vs_1d": first_p_below("1d", sizes, tokens, vb), "3d_over_1d_at_8": at8})
    return rows


def threshold_text(rows) -> str:
    """:func:`threshold_table` as a few aligned lines."""
    def first(p_ratio):
        p, ratio = p_ratio
        return "none ≤ 32768" if p is None else f"P = {p} ({ratio:.2f}×)"
    lines = [f"{'bytes per rank, by the formulas':44} {'3D/1D at P=8':>12}  {'3D < 2D from':>18}  {'3D < 1D from':>18}"]
    lines += [f"{r['workload']:44} {r['3d_over_1d_at_8']:>11.2f}×  {first(r['vs_2d']):>18}  {first(r['vs_1d']):>18}"
              for r in rows]
    return "\n".join(lines)
