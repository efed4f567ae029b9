"""Chapter 03 pictures, from real runs.

* ``03_la_lb_lc.png``: the Hugging Face guide's example run live on 3 ranks: three layers La, Lb, Lc with parameters
  a0..a2, b0..b2, c0..c2 under ZeRO-3 (one unit per layer). Left: what each rank holds between steps
  (rank r owns a_r, b_r, c_r). Right: the gather / free / reduce-scatter events of one step per unit.
* ``03_zero_memory.png``: model-state bytes per rank for DDP and ZeRO-1/2/3 on 4 ranks, measured from live
  tensors (bars) beside the ZeRO paper's formula (black ticks), and the bytes each rank sent per step. The
  chapter's version adds a bar of the activations autograd saved (:func:`measure_stages_with_activations`):
  ZeRO shards the model states and leaves the activations whole.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minipar.memory import saved_activation_bytes

__all__ = ["ThreeLayers", "la_lb_lc_recipe", "la_lb_lc_rank", "run_la_lb_lc", "draw_la_lb_lc", "memory_recipe",
           "run_memory", "measure_stages_with_activations", "rings_and_accumulation", "accumulation_recipe", "draw_memory",
           "FIGURES"]


class Layer(nn.Module):
    """y = p0·x + p1·tanh(x) + p2: a layer with exactly three scalar parameters, named like the guide's."""

    def __init__(self, letter: str, values):
        super().__init__()
        self.names = [f"{letter}{i}" for i in range(3)]
        for name, v in zip(self.names, values):
            setattr(self, name, nn.Parameter(torch.tensor([float(v)])))

    def forward(self, x):
        p0, p1, p2 = (getattr(self, n) for n in self.names)
        return p0 * x + p1 * torch.tanh(x) + p2


class ThreeLayers(nn.Module):
    """Seed 002's model: La, Lb, Lc, each with three parameters."""

    def __init__(self):
        super().__init__()
        self.La = Layer("a", (0.9, 0.5, 0.1))
        self.Lb = Layer("b", (1.1, -0.4, 0.0))
        self.Lc = Layer("c", (0.8, 0.3, -0.2))

    def forward(self, x):
        return self.Lc(self.Lb(self.La(x)))


def la_lb_lc_recipe(steps: int = 3):
    from minipar.check import Recipe
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        x = torch.randn(6, 1, generator=g)
        batches.append((x, torch.sin(x)))
    return Recipe(model=ThreeLayers, batches=batches, optimizer=lambda p: torch.optim.Adam(p, lr=0.05),
                  name="La/Lb/Lc")


def la_lb_lc_rank(rank, world_size, recipe):
    """ZeRO-3 with one unit per layer; returns what this rank holds, its events and the training result."""
    from minipar.check import RunResult
    from minipar.data.zero import ZeRO
    model = recipe.model()
    sharded = ZeRO(model, recipe.optimizer, 3, units=[model.La, model.Lb, model.Lc])
    held = {u.label: _owned(u) for u in sharded.units}
    losses = []
    for x, y in recipe.batches:
        per = len(x) // world_size
        sharded.zero_grad()
        loss = recipe.loss(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        sharded.step()
        losses.append(float(loss) / world_size)
    from minipar import comm
    total = comm.all_reduce(torch.tensor(losses))
    return {"held": held, "events": sharded.events,
            "result": RunResult(total.tolist(), sharded.full_parameters())}


def _owned(unit) -> list:
    """[(parameter name, value)] for the elements of the unit's flat buffer this rank owns."""
    names = [n for n, p in zip(unit.names, unit.params) for _ in range(p.numel())]
    names += ["(padding)"] * (unit.padded_numel - unit.numel)
    start = unit.owned().start
    return [(names[start + i].split(".")[-1], v) for i, v in enumerate(unit.master.detach().tolist())]


def run_la_lb_lc(steps: int = 3) -> list:
    from minipar.launcher import launch
    return launch(la_lb_lc_rank, 3, la_lb_lc_recipe(steps), quiet=True)


def draw_la_lb_lc(runs, fig=None, step: int = 1):
    import matplotlib.pyplot as plt
    fig = fig or plt.figure(figsize=(11, 3.6))
    left, right = fig.add_gridspec(1, 2, width_ratios=[1, 2.2]).subplots()
    left.set_title("held between steps (ZeRO-3)")
    for rank, run in enumerate(runs):
        for col, owned in enumerate(run["held"].values()):
            label = "\n".join(f"{name} = {value:.2f}" for name, value in owned)
            left.add_patch(plt.Rectangle((col, -rank - 1), 0.95, 0.9, color=f"C{col}", alpha=0.35))
            left.text(col + 0.47, -rank - 0.55, label, ha="center", va="center", fontsize=9)
    left.set_xlim(0, 3), left.set_ylim(-3.1, 0)
    left.set_xticks([0.47, 1.47, 2.47], ["La", "Lb", "Lc"]), left.set_yticks([-0.55, -1.55, -2.55],
                                                                             ["rank 0", "rank 1", "rank 2"])
    events = [(k, u) for s, k, u in runs[0]["events"] if s == step]
    rows = {"La": 0, "Lb": 1, "Lc": 2}
    colors = {"all-gather": "tab:blue", "free": "tab:gray", "reduce-scatter": "tab:red"}
    for i, (kind, unit) in enumerate(events):
        right.scatter(i, -rows[unit], s=120, color=colors[kind], marker="s")
    for kind, c in colors.items():
        right.scatter([], [], color=c, marker="s", label=kind)
    right.set_yticks([0, -1, -2], ["La", "Lb", "Lc"]), right.set_xlabel("event (in order, one step)")
    right.set_title("rank 0, one step: gather before use, free after, reduce-scatter the gradients")
    right.set_ylim(-2.5, 0.9)
    boundary = _backward_starts(events)   # the last unit's free closes the forward; its re-gather opens backward
    right.axvline(boundary - 0.5, color="black", lw=1, ls="--")
    right.text(boundary - 0.7, 0.45, "forward", ha="right", fontsize=9)
    right.text(boundary - 0.3, 0.45, "backward", ha="left", fontsize=9)
    right.legend(loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout()
    return fig


def _backward_starts(events) -> int:
    """Index of the backward's first event: the first all-gather after the last unit's forward free (each unit
    is gathered once in the forward, in order; the backward gathers them again, in reverse)."""
    units = list(dict.fromkeys(u for _, u in events))
    freed_last = events.index(("free", units[-1]))
    return next(i for i in range(freed_last + 1, len(events)) if events[i][0] == "all-gather")


def memory_recipe(batch_size: int = 8, n_layer: int = 8, steps: int = 2):
    """A tiny GPT whose parameters outweigh its activations, so the bars show the model states; 8 blocks, so
    that ZeRO-3's gathered units (two blocks and the root at a time) weigh less than ZeRO-2's whole parameters
    and its peak falls below ZeRO-2's, as on a large model (``n_layer``: fewer where that does not matter, as the
    FSDP loop's comparison with PyTorch's FSDP2). Every stage passes the default FP32 tolerance."""
    from minipar.check import gpt_recipe
    return gpt_recipe(steps=steps, batch_size=batch_size, seq_len=8, optimizer="adam", n_embd=32, n_layer=n_layer)


def accumulation_recipe(world_size: int = 4):
    """§4's accumulation runs: §3's model, one sample a micro-batch (:data:`ACCUM_STEPS` of them a rank), one step:
    the table reads a step's bytes, and one Adam step over the accumulated gradients is held to one device's (a second
    step took half of that launch's time and showed the same)."""
    return memory_recipe(batch_size=world_size * ACCUM_STEPS, steps=1)


def run_memory(world_size: int = 4) -> dict:
    """{stage: rank 0's ZeroRunResult} for stages 0-3 (0 = DDP), measured in one launch."""
    from minipar.data.zero_measure import measure_stages
    from minipar.launcher import launch
    return launch(measure_stages, world_size, memory_recipe(), quiet=True)[0]


def _counting_activations(loss, sink: list):
    """``loss`` that also appends to ``sink`` the bytes autograd saved for backward during its forward
    (:func:`minipar.memory.saved_activation_bytes`), the parameters left out: under ZeRO-3 they are the
    gathered views, so their storage is looked up at each save. The parameters themselves are listed once a
    forward: ZeRO gathers into them (``p.data = view``), it does not replace them, and walking the model's
    modules at every save was most of this cell's time."""
    def counted(model, x, y):
        params = list(model.parameters())
        out, saved = saved_activation_bytes(loss, model, x, y, exclude=lambda: params)
        sink.append(saved)
        return out
    return counted


def measure_stages_with_activations(rank, world_size, recipe, stages=(0, 1, 2, 3)) -> dict:
    """:func:`minipar.data.zero_measure.measure_stages` plus ``memory["activations"]``: the bytes autograd
    saved for backward in the last step's forward on this rank, measured (not a formula)."""
    import dataclasses
    from minipar.data.zero_measure import measured_train
    out = {}
    for stage in stages:
        sink: list = []
        res = measured_train(rank, world_size, dataclasses.replace(recipe, loss=_counting_activations(recipe.loss, sink)),
                             stage=stage)
        res.memory["activations"] = sink[-1]
        out[stage] = res
    return out


def rings_and_accumulation(rank, world_size, recipe) -> dict:
    """ZeRO-1 and ZeRO-3 on minipar's send/recv rings, then ZeRO-1 and ZeRO-2 on gloo's collectives accumulating
    ACCUM_STEPS micro-batches a step, one after the other in one launch: {("ring" | "accum", stage):
    ZeroRunResult} on this rank, bytes only. The same runs on gloo's collectives and DDP (stage 0, gloo's
    all-reduce) are §3's (:func:`measure_stages_with_activations`; counting activations sends nothing):
    :func:`.report.wire` reads them there rather than training them twice."""
    from minipar import comm
    from minipar.data.zero_measure import measured_train
    # peak=False: the wire table reads bytes only; the peak's tracker sees every operator and doubled these runs
    with comm.ring_algorithms():            # minipar's send/recv rings for all three collectives
        out = {("ring", s): measured_train(rank, world_size, recipe, stage=s, peak=False) for s in (1, 3)}
    larger = accumulation_recipe(world_size)     # the same model, one sample a micro-batch, one step
    out.update({("accum", s): measured_train(rank, world_size, larger, stage=s, accum_steps=ACCUM_STEPS, peak=False)
                for s in (1, 2)})
    return out


ACCUM_STEPS = 4     # micro-batches a step accumulates in rings_and_accumulation's last two runs (a pipeline's m)


def root_share() -> float:
    """The root unit's share of §3's model's parameters (embeddings, final norm, head: outside any block)."""
    named = list(memory_recipe().model().named_parameters())
    return sum(p.numel() for n, p in named if not n.startswith("blocks.")) / sum(p.numel() for _, p in named)


def draw_memory(runs: dict, world_size: int = 4, ax=None):
    import matplotlib.pyplot as plt
    from minipar.data import zero_memory
    ax = ax or plt.figure(figsize=(8, 4)).gca()
    kinds = [("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")]
    for x, (stage, res) in enumerate(runs.items()):
        bottom = 0
        want = zero_memory.model_state_bytes_formula(res.padded_numel, world_size, stage, "fp32")
        for kind, color in kinds:
            ax.bar(x, res.memory[kind] / 1024, bottom=bottom, color=color, label=kind if x == 0 else None)
            bottom += res.memory[kind] / 1024
        ax.hlines(want["total"] / 1024, x - 0.4, x + 0.4, color="black", label="formula" if x == 0 else None)
        if "activations" in res.memory:      # the activations, measured: the same whatever the stage
            ax.bar(x, res.memory["activations"] / 1024, bottom=bottom, color="white", edgecolor="tab:gray",
                   hatch="//", label="activations (not sharded)" if x == 0 else None)
            bottom += res.memory["activations"] / 1024
        if "peak" in res.memory:             # the peak during a step: model states + what the step allocates
            ax.scatter(x, res.memory["peak"] / 1024, marker="D", color="tab:red", zorder=3,
                       label="peak during a step" if x == 0 else None)
            bottom = max(bottom, res.memory["peak"] / 1024)
        ax.text(x, bottom * 1.02 + 10, f"ring: {res.bytes_sent[-1] / 1024:.0f} KiB/step", ha="center", fontsize=8)
    ax.set_xticks(range(len(runs)), [zero_memory.STAGE_NAMES[s] for s in runs])
    ax.set_ylabel("bytes per rank (KiB)" if "activations" in res.memory else "model states per rank (KiB)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.set_title(f"measured per rank (bars) vs formula (line), FP32 Adam, N = {world_size}" if "activations" not in res.memory
                 else f"measured per rank: model states (formula: line) + activations, FP32 Adam, N = {world_size}")
    ax.legend()
    return ax


def draw_prefetch_model(zero3_time, world_size: int = 4):
    """§14: the modelled ZeRO-3 steps with and without prefetch (GPT-2-sized, DGX-A100) on one time axis."""
    import matplotlib.pyplot as plt
    from minipar.course import replays
    from minipar.pipeline.gantt import REPLAY_KINDS, gantt_legend
    fig, axes = plt.subplots(2, 1, figsize=(11, 3.8), sharex=True)
    replays.draw_replays(axes, {"model: ZeRO-3 with prefetch, DGX-A100, GPT-2-sized": zero3_time.with_p,
                                "model: ZeRO-3 without prefetch, DGX-A100, GPT-2-sized": zero3_time.without},
                         world_size)
    gantt_legend(fig, REPLAY_KINDS)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def _make_la_lb_lc(path):
    draw_la_lb_lc(run_la_lb_lc()).savefig(path, dpi=110)


def _make_memory(path):
    ax = draw_memory(run_memory())
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=110)


FIGURES = {"03_la_lb_lc.png": _make_la_lb_lc, "03_zero_memory.png": _make_memory}
