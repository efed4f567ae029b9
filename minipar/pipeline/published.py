"""Two published comparison tables, reproduced by playing the schedules on the simulator's clock.

**Zero bubble README** (Qi et al. 2024, github.com/sail-sg/zero-bubble-pipeline-parallelism), T_F = T_B = T_W,
B = (p-1)/(m+p-1) the 1F1B bubble; bubble, activation memory per rank and pipeline p2p volume, each relative
to 1F1B (memory: the peak over ranks, in whole-stage activations; 1F1B's is p, on rank 0):

    1F1B  B, 1×, 1×     ZB1P  B/3, 1×, 1×     ZB-V  0, 1×, 2×     V-Half  B/2, ½×, 2×     V-Min  2B/3, ⅓×, 2×

The published bubbles are leading terms: what remains here is the start-up, the last rank waiting (p-1)
forwards of a chunk for its first input, ≈ B/6 for ZB-V and (m+p-1)/(3m+p-1)·B for ZB1P (ZB-H1 here). V-Min
(Qi et al. 2024, "Pipeline Parallelism with Controllable Memory") is built here as a repeating block
(:func:`~minipar.pipeline.vschedules.v_min`): its memory is ⅓× plus a few chunks (2p/3 + O(1) chunk
activations: 0.5× at p = 4 and 8, 0.375× at p = 16). V-Half (:func:`~minipar.pipeline.vhalf.v_half`) is a
longer block (lifespans 6p + O(1): ≈ p chunk activations) with its warm-up and cool-down reordered: bubble
≈ B/2 (0.53·B at p = 2 and 8, 0.54·B at p = 4, m = 4p), memory ½× plus a few chunks (1×, 0.75×, 0.69× at
p = 2, 4, 8; the paper's ⌊(p+2)/2⌋ stages is 1×, 0.75×, 0.625×). Stated tolerance: bubble within 0.25·B of
the published multiple of B; volume exactly; memory exactly, V-Min's and V-Half's within 3 chunk activations
(3/(2p) of 1F1B's peak).

**DualPipe README** (DeepSeek 2025, github.com/deepseek-ai/DualPipe), PP stages, F a forward chunk, B a full
backward chunk, W its weight part, F&B an overlapped forward + backward pair; idle time per device:

    1F1B      (PP-1)(F+B)          1× parameters, PP activations, PP devices
    ZB1P      (PP-1)(F+B-2W)       1×,            PP,             PP devices
    DualPipeV (PP/2-1)(F&B+B-3W)   2×,            PP+1,           PP/2 devices

With F = 1, B = 2, W = 1 and no credit for overlap (F&B = F + B = 3): 3(PP-1), PP-1 and 2(PP/2-1) — the
simulator gives them exactly (DualPipeV's F&B pairs played as one block, ``simulate(overlap=True)``).
"""
from __future__ import annotations

from .schedules import make_schedule
from .simulate import Costs, simulate

__all__ = ["ZERO_BUBBLE_README", "DUALPIPE_README", "zero_bubble_table", "dualpipe_table", "format_table"]

ZERO_BUBBLE_README = {      # name: (bubble in units of B, activation memory ×, p2p volume ×)
    "1F1B": (1.0, 1.0, 1.0), "ZB1P": (1 / 3, 1.0, 1.0), "ZB-V": (0.0, 1.0, 2.0),
    "V-Half": (0.5, 0.5, 2.0), "V-Min": (2 / 3, 1 / 3, 2.0)}
DUALPIPE_README = {         # name: (bubble formula, parameters per device ×, activations per device, devices)
    "1F1B": ("(PP-1)(F+B)", 1, "PP", "PP"), "ZB1P": ("(PP-1)(F+B-2W)", 1, "PP", "PP"),
    "DualPipeV": ("(PP/2-1)(F&B+B-3W)", 2, "PP+1", "PP/2")}
OURS = {"1F1B": ("1f1b", 1), "ZB1P": ("zb-h1", 1), "ZB-V": ("zb-v", 2), "V-Half": ("v-half", 2),
        "V-Min": ("v-min", 2), "DualPipeV": ("dualpipev", 2)}


def zero_bubble_table(p: int, m: int) -> list:
    """[(name, published (bubble/B, memory ×, volume ×), simulated or None)] on p ranks, m micro-batches."""
    base = simulate(make_schedule("1f1b", p, m))
    b = (p - 1) / (m + p - 1)
    rows = []
    for name, published in ZERO_BUBBLE_README.items():
        sim = None
        if name in OURS:
            res = simulate(make_schedule(OURS[name][0], p, m, OURS[name][1]))
            sim = (res.bubble_fraction / b, max(res.peak_activations) / max(base.peak_activations),
                   res.p2p_messages / base.p2p_messages)
        rows.append((name, published, sim))
    return rows


def dualpipe_table(p: int, m: int, F: float = 1.0, B: float = 2.0, W: float = 1.0) -> list:
    """[(name, published (idle per device, parameters ×, activations, devices), simulated)] for PP = 2p
    stages: 1F1B and ZB1P on PP devices, DualPipeV on p; times in units of a stage's (chunk's) F."""
    pp = 2 * p
    fb = F + B                                                # F&B with no overlap credit
    published = {"1F1B": (pp - 1) * (F + B), "ZB1P": (pp - 1) * (F + B - 2 * W),
                 "DualPipeV": (pp // 2 - 1) * (fb + B - 3 * W)}
    rows = []
    for name, (formula, params, acts, devices) in DUALPIPE_README.items():
        schedule, v = OURS[name]
        ranks = pp // v
        sched = make_schedule(schedule, ranks, m, v)
        res = simulate(sched, Costs(F=v * F, B=v * (B - W), W=v * W))     # per chunk: F, B - W, W
        sim = (max(res.idle(r) for r in range(ranks)), len(sched.stages_of(0)), max(res.peak_in_flight), ranks)
        count = {"PP": pp, "PP+1": pp + 1, "PP/2": pp // 2}
        rows.append((name, (published[name], params, count[acts], count[devices]), sim))
    return rows


def format_table(rows: list, columns: list) -> str:
    """The published values beside the simulated ones, one schedule a line."""
    fmt = lambda t: "not built here" if t is None else ", ".join(f"{x:.3g}" for x in t)   # noqa: E731
    head = f"{'':10s}  {'published (' + ', '.join(columns) + ')':44s}  simulated"
    return "\n".join([head] + [f"{n:10s}  {fmt(pub):44s}  {fmt(sim)}" for n, pub, sim in rows])
