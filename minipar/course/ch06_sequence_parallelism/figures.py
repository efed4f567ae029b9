"""Chapter 06 pictures, from live runs.

* ``06_tp_sp_memory.png`` — activation bytes per transformer layer measured for TP and TP+SP at t = 1, 2, 4,
  beside Korthikanti et al.'s count scaled to float32 (plus what it leaves out).

:func:`draw_backward_overlap` is a schematic (no run): the order of a column-parallel layer's backward under
SP, one op after another as :class:`minipar.tensor.sequence.GatheredInputLinear` runs it, and on two streams
as Megatron overlaps it (Korthikanti et al. 2022).
"""
from __future__ import annotations

from minipar.course.plotting import RANK_COLOURS, save_figure
from minipar.launcher import launch

__all__ = ["layer_costs", "plot_layer_memory", "draw_backward_overlap", "sp_mlp_shapes", "draw_sp_layer", "FIGURES"]


def _measure_both(rank, world_size, cfg, b, s):
    from minipar.tensor.measure import measure_layer
    return {sp: measure_layer(rank, world_size, cfg, b, s, sp) for sp in (False, True)}


def layer_costs(b: int = 4, s: int = 16, h: int = 32, a: int = 4, degrees=(1, 2, 4)) -> list:
    """[{"t", "sp", "activation_bytes", "formula_bytes", "bytes_sent", "bytes_formula"}] for one layer on
    rank 0 (float32, no dropout), TP and TP+SP for each degree (one launch per degree). The activation
    formula is Korthikanti et al.'s count scaled to float32 + LayerNorm statistics + causal mask."""
    from minipar.models import GPTConfig
    from minipar.activations import activation_bytes_formula
    from minipar.tensor.sequence import sp_bytes_per_layer, tp_bytes_per_layer, uncounted_bytes

    rows = []
    for t in degrees:
        measured = launch(_measure_both, t, GPTConfig(n_embd=h, n_head=a), b, s, quiet=True)[0]
        for sp in (False, True):
            formula = activation_bytes_formula(s, b, h, a, t=t, sequence_parallel=sp, value_bytes=4, dropout=False)
            rows.append({"t": t, "sp": sp, "activation_bytes": measured[sp]["activation_bytes"],
                         "formula_bytes": formula + uncounted_bytes(s, b, t, sp),
                         "bytes_sent": measured[sp]["bytes_sent"],
                         "bytes_formula": (sp_bytes_per_layer if sp else tp_bytes_per_layer)(s, b, h, t)})
    return rows


def plot_layer_memory(rows):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    degrees = sorted({r["t"] for r in rows})
    for k, sp in enumerate((False, True)):
        xs = [i + (k - 0.5) * 0.38 for i in range(len(degrees))]
        mine = [r for r in rows if r["sp"] == sp]
        ax.bar(xs, [r["activation_bytes"] / 1024 for r in mine], width=0.36, color=RANK_COLOURS[k],
               label=f"{'TP + SP' if sp else 'TP'} measured")
        ax.plot(xs, [r["formula_bytes"] / 1024 for r in mine], "k_", markersize=22, mew=2)
    ax.plot([], [], "k_", markersize=12, mew=2, label="formula (Korthikanti, float32) + LN stats + mask")
    ax.set_xticks(range(len(degrees)), [f"t = {t}" for t in degrees])
    ax.set_ylabel("activation KiB per layer")
    ax.set_title("One layer (b=4, s=16, h=32, 4 heads): SP divides what TP leaves whole", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def _sp_shapes(rank, world_size, h, s):
    import torch
    from minipar.mesh import Mesh
    from minipar.models import MLP
    from minipar.tensor.layers import TensorParallelMLP

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    ref = MLP((h, 4 * h, h), seed=0)
    mlp = TensorParallelMLP(ref.layers[0], ref.layers[1], group, sequence_parallel=True)
    x = torch.randn(1, s, h, generator=torch.Generator().manual_seed(0)).chunk(world_size, dim=1)[rank]
    hidden = mlp.fc(x)                                  # all-gather along the sequence inside
    out = mlp.proj(torch.nn.functional.gelu(hidden))    # reduce-scatter along the sequence inside
    return [tuple(x.shape), tuple(hidden.shape), tuple(out.shape)]


def sp_mlp_shapes(world_size: int = 2, h: int = 8, s: int = 8) -> list:
    """Rank 0's (b, s, features) shapes in a live sequence-parallel MLP: [its input shard, the column-parallel
    layer's output (the whole sequence, 4h/t features), the row-parallel layer's output (its shard again)]."""
    return launch(_sp_shapes, world_size, h, s, quiet=True)[0]


def draw_sp_layer(world_size: int = 2, h: int = 8, s: int = 8):
    """Korthikanti et al. 2022's fig. 5 for the MLP, from the shapes a live rank held (:func:`sp_mlp_shapes`):
    LayerNorm on a sequence shard → g (all-gather) → column-parallel → GeLU → row-parallel → ḡ (reduce-scatter)
    → dropout on a sequence shard. Box height: tokens; width: features."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    shard, hidden, out = sp_mlp_shapes(world_size, h, s)
    steps = [("LayerNorm output\n(its shard)", shard, 0), ("g: all-gather", None, 1),
             ("X, gathered\n(into column-parallel A_i)", (1, s, h), 0), ("GeLU(X A_i)", hidden, 0),
             ("Y_i B_i: row-parallel,\npartial sums", (1, s, out[2]), 0), ("ḡ: reduce-scatter", None, 1),
             ("summed, its shard\n(dropout)", out, 0)]
    fig, ax = plt.subplots(figsize=(10, 2.6))
    x0, unit = 0.0, 0.12
    for label, shape, is_comm in steps:
        if is_comm:
            ax.annotate("", xy=(x0 + 1.0, s * unit / 2), xytext=(x0, s * unit / 2),
                        arrowprops=dict(arrowstyle="->", color=RANK_COLOURS[1], lw=2))
            ax.text(x0 + 0.5, s * unit / 2 + 0.15, label, ha="center", fontsize=8, color=RANK_COLOURS[1])
            x0 += 1.2
            continue
        w, hgt = shape[2] * unit / 2, shape[1] * unit
        ax.add_patch(Rectangle((x0, 0), w, hgt, color=RANK_COLOURS[0], alpha=0.35 if shape[1] < s else 0.8))
        ax.text(x0 + w / 2, -0.25, f"{label}\n{shape[1]}×{shape[2]}", ha="center", va="top", fontsize=7)
        x0 += w + 0.4
    ax.set_xlim(-0.2, x0), ax.set_ylim(-1.1, s * unit + 0.5), ax.axis("off")
    ax.set_title(f"One MLP under TP + SP, rank 0 of {world_size} (live shapes, tokens × features; pale: a sequence "
                 f"shard of {s // world_size} of the {s} tokens)", fontsize=9)
    return fig


def draw_backward_overlap():
    """A schematic timeline (equal made-up durations, no measurement) of one column-parallel layer's backward
    under SP: re-gather X, the input-gradient GEMM dX = dY·W, the reduce-scatter of dX, the weight-gradient
    GEMM dW = dYᵀ·X. One after another (top: what minipar runs) and on two streams (below: Megatron's order —
    the re-gather under dX, which does not need X; the reduce-scatter under dW, which needs the gathered X)."""
    import matplotlib.pyplot as plt

    compute, comm = RANK_COLOURS[0], RANK_COLOURS[1]
    blocking = [("all-gather X", comm), ("dX = dY·W", compute), ("reduce-scatter dX", comm), ("dW = dYᵀ·X", compute)]
    overlapped = {1: [(0, "dX = dY·W", compute), (1, "dW = dYᵀ·X", compute)],
                  0: [(0, "all-gather X", comm), (1, "reduce-scatter dX", comm)]}
    fig, ax = plt.subplots(figsize=(7.5, 2.4))
    for k, (label, colour) in enumerate(blocking):
        ax.barh(3, 1, left=k, color=colour, edgecolor="k"), ax.text(k + 0.5, 3, label, ha="center", va="center", fontsize=7)
    for row, ops in overlapped.items():
        for start, label, colour in ops:
            ax.barh(row, 1, left=start, color=colour, edgecolor="k")
            ax.text(start + 0.5, row, label, ha="center", va="center", fontsize=7)
    ax.set_yticks([3, 1, 0], ["one after another", "Megatron: compute", "Megatron: communication"], fontsize=8)
    ax.set_xticks([]), ax.set_xlabel("time (schematic: equal made-up durations)", fontsize=8)
    ax.set_title("Backward of a column-parallel layer under SP: the re-gather and the reduce-scatter hide "
                 "under the two GEMMs", fontsize=9)
    return fig


def _make_memory(path):
    save_figure(plot_layer_memory(layer_costs()), path, dpi=110, bbox_inches="tight")


FIGURES = {"06_tp_sp_memory.png": _make_memory}
