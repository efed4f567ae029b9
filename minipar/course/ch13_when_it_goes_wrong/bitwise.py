"""Chapter 13, section 7 (equal to the last bit): one sum in several orders, the first tensor where each layout
leaves one device (:mod:`minipar.debug.first_diff`), the picture of how far each tensor moved, and the
invariant mode's run where the library has it."""
from __future__ import annotations


import numpy as np
import torch

from minipar.check import gpt_recipe
from minipar.debug.first_diff import capture, first_difference, ulp_distance

__all__ = ["sum_orders", "recipe", "LAYOUTS", "first_differences", "draw_profiles", "invariant_demo"]


def _left_to_right(x: np.ndarray) -> np.float32:
    return np.cumsum(x, dtype=np.float32)[-1]      # cumsum adds one by one, in float32


def sum_orders(n: int = 4096, seed: int = 0) -> dict:
    """The same ``n`` float32 numbers summed in float32 in four orders ({order: (sum, ULPs from left to right)}),
    and the exact sum (float64 of the float32 inputs, rounded to float32) beside them."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).numpy().astype(np.float32)
    sums = {"left to right (one device)": _left_to_right(x),
            "two halves, then added (2 ranks)": _left_to_right(x[: n // 2]) + _left_to_right(x[n // 2:]),
            "four quarters, then added (4 ranks)": _left_to_right(np.array([_left_to_right(q)
                                                                            for q in np.split(x, 4)])),
            "right to left": _left_to_right(x[::-1].copy()),
            "exact, rounded once": np.float32(x.astype(np.float64).sum())}
    first = torch.tensor(sums["left to right (one device)"])
    return {k: (float(v), int(ulp_distance(torch.tensor(np.float32(v)), first))) for k, v in sums.items()}


def recipe():
    """The smallest GPT that every layout below splits: 2 layers, 16 wide, 4 heads, 4 rows of 8 tokens, 1 step."""
    return gpt_recipe(steps=1, batch_size=4, seq_len=8, n_layer=2, n_embd=16, n_head=4)


# pp 2 on one micro-batch (first_diff's default): a real pipeline runs m >= p and parts where micro-batches do
LAYOUTS = {"pp 2, one micro-batch": dict(pp=2, schedule="gpipe"), "dp 2": dict(dp=2), "micro-batches 2": dict(micro_batches=2),
           "tp 2": dict(tp=2), "cp 2": dict(cp=2)}


def first_differences(layouts: dict = LAYOUTS):
    """One device and each layout, one step each, in the default mode: ({label: Difference}, {label: the max ULPs
    of every tensor in execution order}, the tensors' names)."""
    r = recipe()
    one = capture(r)
    diffs, profiles = {}, {}
    for label, dims in layouts.items():
        run = capture(r, **dims)
        diffs[label] = first_difference(one, run)
        profiles[label] = [int(ulp_distance(run.steps[0][n], t).max()) for n, t in one.steps[0].items()]
    return diffs, profiles, list(one.steps[0])


def draw_profiles(profiles: dict, names: list):
    """Max ULPs from one device of every tensor, in execution order (forward, backward, step), one line a layout."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for (label, ulps), marker in zip(profiles.items(), "o^sxD+"):     # dp 2 and micro-batches 2 coincide
        ax.plot(range(len(ulps)), [u + 1 for u in ulps], ls="none", marker=marker, ms=5, mfc="none", label=label)
    for phase in ("backward", "step"):
        at = next(i for i, n in enumerate(names) if n.startswith(phase))
        ax.axvline(at - 0.5, color="grey", lw=0.8)
        ax.text(at, 1.5, phase, color="grey")
    ax.text(0, 1.5, "forward", color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("tensor, in execution order (one step)")
    ax.set_ylabel("max ULPs from one device + 1")
    ax.legend(loc="upper left", fontsize=8, ncol=len(profiles))
    fig.tight_layout()
    return fig


def invariant_demo(layouts: dict | None = None):
    """The invariant mode (``minipar.invariant()``, :mod:`minipar.invariant_mode`): one device and each layout in
    the mode, their first difference (None: bitwise equal), and a tp 2 step's seconds in each mode (median, min, max
    over its steps after the first)."""
    from minipar.hybrid import runner
    layouts = layouts or {"dp 2": dict(dp=2), "tp 2": dict(tp=2), "cp 2": dict(cp=2),
                          "dp 2 x pp 2 x tp 2": dict(dp=2, pp=2, tp=2, micro_batches=2)}
    r = recipe()
    one = capture(r, invariant=True)
    diffs = {label: first_difference(one, capture(r, invariant=True, **dims)) for label, dims in layouts.items()}
    timed = gpt_recipe(steps=4, batch_size=8, seq_len=32, n_layer=2, n_embd=64, n_head=4)
    seconds = {}
    for mode in (False, True):
        ranks = runner.run(timed, tp=2, micro_batches=1, invariant=mode)
        steps = ranks[0].step_seconds[1:]
        seconds[mode] = (float(np.median(steps)), min(steps), max(steps))
    return diffs, {"default": seconds[False], "invariant": seconds[True]}
