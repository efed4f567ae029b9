"""Chapter 09b in the tour: the 5D layout on 16 ranks (dp 2 × pp 2 × cp 2 × tp 2, ring-zigzag attention), its
bytes by mesh dimension (dp × cp, pp, cp, tp) beside the formulas; and the MoE GPT on 8 ranks with ep folded
over a stage's dp × tp ranks, its bytes by kind beside the formula. Both against one device (float64).
"""
from __future__ import annotations

from minipar.course.hybrid_runs import measure_layout
from minipar.course.tour import TourRow

WORLD = 8
LAYOUT_16 = dict(dp=2, pp=2, cp=2, tp=2, cp_method="ring-zigzag")     # 16 ranks


def _kib(x):
    return f"{x / 1024:.1f} KiB"


def _observed_by_dimension(r: dict) -> str:
    """Observed bytes per step by mesh dimension: dp × cp is its own window (the gradient reduction); in the
    forward/backward window each blocking call's bytes are its dimension's, and what is left of the window
    belongs to the asynchronous sends together (pipeline messages, ring attention's K/V blocks)."""
    window, dims = r["observed"]["pp+tp"], r["observed_by_dims"]
    dims = {d: o for d, o in dims.items() if d != ("dp", "cp")}
    known = {d: o for d, o in dims.items() if o is not None}
    rest = [" + ".join(d) for d, o in dims.items() if o is None]
    parts = [f"dp×cp {_kib(r['observed']['dp'])} (its window)"]
    parts += [f"{'×'.join(d)} {_kib(o)} (during its blocking calls)" for d, o in known.items()]
    return "; ".join(parts + [f"{' + '.join(rest)} {_kib(window - sum(known.values()))} (the rest of the window: "
                              f"asynchronous sends)"])


def _run_5d(steps: int = 3) -> TourRow:
    """dp 2 × pp 2 × cp 2 × tp 2 (ring-zigzag attention, 1F1B, m = 4) on 16 ranks, ``steps`` Adam steps."""
    return row_5d(measure_layout(LAYOUT_16, steps=steps))


def row_5d(r: dict) -> TourRow:
    """The 5d row of one :func:`~minipar.course.hybrid_runs.measure_layout` of :data:`LAYOUT_16` (its test also
    reads ``r["runs"]``, the per-rank results, from the same launch)."""
    b, f = r["bytes"], r["formula"]
    names = {"dp": "dp×cp", "pp": "pp", "cp": "cp", "tp": "tp"}
    model = ", ".join(f"{names[k]} {_kib(b[k])} ({_kib(f[k])})" for k in ("dp", "pp", "cp", "tp"))
    note = (f"16 ranks, per step, model (formula): {model}; observed {_observed_by_dimension(r)}; observed > "
            f"model: gloo's headers and the vocabulary loss's tiny messages; model states ≤ "
            f"{_kib(r['model_state_bytes'])} per rank (Ψ/(pp·tp) each: cp shards no parameter); bubble "
            f"{r['bubble']:.2f} measured, {r['bubble_formula']:.2f} formula")
    return TourRow(strategy="5d", world_size=16, matches=r["matches"], max_abs_diff=r["max_abs_diff"],
                   bytes_sent_per_rank=sum(b.values()), bytes_formula=sum(f.values()),
                   peak_bytes_per_rank=r["peak_bytes"], note=note,
                   bytes_observed_per_rank=r["observed"]["dp"] + r["observed"]["pp+tp"],
                   calls_per_rank=sum(r["calls"].values()))


def moe_5d(steps: int = 3) -> TourRow:
    """dp 2 × pp 2 × tp 2 with ep 2 folded over a stage's dp × tp ranks: the MoE GPT (4 experts, top-2, cf 1: tokens are dropped; the
    reference routes in the same groups), ``steps`` Adam steps (3), float64, against one device; bytes per kind beside
    :func:`~minipar.hybrid.parallel3d.bytes_formula` (``moe=``), mean over the 8 ranks."""
    from minipar.check import compare, train_reference
    from minipar.hybrid.experts import hybrid_moe_recipe
    from minipar.hybrid.parallel3d import bytes_formula
    from minipar.hybrid.runner import run
    from minipar.layout import Layout
    layout = Layout(dp=2, pp=2, tp=2, ep=2, micro_batches=4)
    recipe = hybrid_moe_recipe(layout, steps=steps, batch_size=16, seq_len=8, experts=4, k=2, capacity_factor=1.0,
                               n_layer=4)
    runs = run(recipe, layout=layout)
    comparison = compare(train_reference(recipe), runs, dtype=recipe.dtype)
    model = recipe.model()
    formulas = [bytes_formula(model.cfg, batch=16, seq=8, layout=layout, pp_rank=r.coords["pp"], moe=model.moe)
                for r in runs]
    kinds = list(formulas[0])
    mean = {k: sum(r.bytes_by_kind[k] for r in runs) / WORLD for k in kinds}
    want = {k: sum(f[k] for f in formulas) / WORLD for k in kinds}
    assert all(abs(mean[k] - want[k]) <= 1e-6 * max(1.0, want[k]) for k in kinds), (mean, want)
    observed = sum(r.observed["dp"] + r.observed["pp+tp"] for r in runs) / WORLD
    note = ("per step, model (formula) by kind: " + ", ".join(f"{k} {_kib(mean[k])} ({_kib(want[k])})" for k in kinds)
            + "; ep = dispatch + combine all-to-alls (forward and backward) over the folded ep groups (each a TP "
              "pair: every rank holds 2 distinct experts and routes half its TP group's rows), edp = expert gradients "
              "over expert-DP (÷ dp·cp), balance = the f counts over dp × cp × tp; tp includes the MoE rows' "
              "all-gathers and the routers' gradient sum; observed > model: gloo frames each message")
    return TourRow(strategy="5d-moe", world_size=WORLD, matches=comparison.matches,
                   max_abs_diff=comparison.max_abs_diff, bytes_sent_per_rank=sum(mean.values()),
                   bytes_formula=sum(want.values()), peak_bytes_per_rank=None, note=note,
                   bytes_observed_per_rank=observed)


STRATEGIES = [("5d", _run_5d), ("5d-moe", moe_5d)]
