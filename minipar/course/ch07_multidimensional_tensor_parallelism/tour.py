"""Chapter 07 in the tour: 2D on 4 ranks, 2.5D (q=2, d=2) and 3D (q=2) on 8.

Each row trains the reference MLP [16, 64, 64, 8] (Adam, 3 steps, float64) with
:func:`minipar.tensor.multidim_mlp.run` and compares loss and every parameter with one device. Bytes: what
one rank sends for one forward + backward (+ gradient sums) of the bias-free MLP [32, 128, 32] on 32 tokens
in float32 — the communication log's model (mean over ranks), what the sockets saw (:mod:`minipar.wire`),
and the closed form (:func:`~minipar.tensor.multidim_measure.formula_bytes`). Observed exceeds the formula by a
header per message (measured here: 144 B per point-to-point message, 288 B per step of a gloo collective);
the note gives that overhead per message and the parameter and saved-activation bytes per rank.
"""
from __future__ import annotations

import functools

from minipar.check import compare, mlp_recipe, train_reference
from minipar.launcher import launch
from minipar.course.tour import TourRow
from minipar.tensor import multidim_measure as mmeasure
from minipar.tensor import multidim_mlp as mm

SIZES, TOKENS = (32, 128, 32), 32


def measured(layout: str, world_size: int, per_rank: list | None = None) -> dict:
    """Mean over ranks of :func:`minipar.tensor.multidim_measure.measure` (a live run, unless ``per_rank`` holds
    its results) + the formula."""
    per_rank = per_rank or mmeasure.measure_all(world_size, layout, sizes=SIZES, tokens=TOKENS)
    mean = lambda key: sum(r[key] for r in per_rank) / len(per_rank)  # noqa: E731
    return {"model": mean("bytes_model"), "observed": mean("bytes_observed"), "messages": mean("messages"), "calls": mean("calls"),
            "params": max(r["params"] for r in per_rank), "activations": max(r["activations"] for r in per_rank),
            "formula": mmeasure.formula_bytes(layout, world_size, SIZES, TOKENS)}


def _train_and_measure(rank, world_size, recipe, layout: str):
    return (mm.parallel_train(rank, world_size, recipe, layout=layout, depth=2),
            mmeasure.measure(rank, world_size, layout, sizes=SIZES, tokens=TOKENS))


def _run(layout: str, world_size: int) -> TourRow:
    """What ``mm.run`` and :func:`measured` give, from one launch: the training, then the measured step."""
    recipe = mm.in_dtype(mlp_recipe(steps=3, optimizer="adam"))
    mm.validate(recipe, world_size=world_size, layout=layout, depth=2)
    out = launch(_train_and_measure, world_size, recipe, layout, quiet=True)
    comparison = compare(train_reference(recipe), [o[0] for o in out], dtype=recipe.dtype)
    m = measured(layout, world_size, [o[1] for o in out])
    per_message = (m["observed"] - m["model"]) / max(m["messages"], 1)
    note = (f"bytes per fwd+bwd of MLP {list(SIZES)} on {TOKENS} tokens; observed − model = "
            f"{per_message:.0f} B per message ({m['messages']:.0f} messages: gloo's header); "
            f"params {m['params']} B, saved activations {m['activations']} B per rank")
    return TourRow(strategy=f"tp-{layout}", world_size=world_size,
                   matches=comparison.matches, max_abs_diff=comparison.max_abs_diff,
                   bytes_sent_per_rank=m["model"], bytes_formula=m["formula"], peak_bytes_per_rank=None,
                   note=note, bytes_observed_per_rank=m["observed"], calls_per_rank=m["calls"])


STRATEGIES = [("tp-2d", functools.partial(_run, "2d", 4)),
              ("tp-2.5d", functools.partial(_run, "2.5d", 8)),
              ("tp-3d", functools.partial(_run, "3d", 8))]
