"""Chapter 14's plumbing: every method trained on one token budget, the tables and the figures.

The methods are the library's (:mod:`minipar.data.ddp`, :mod:`~minipar.data.powersgd`,
:mod:`~minipar.data.diloco`), trained as :func:`.compression_study.loss_vs_bytes` (beside this file) trains them —
the same recipe, the same global batches, scored on the same held-out batches — but all inside one launch
of ``WORLD`` processes (one start-up instead of seven), keeping each step's loss and bytes for the figures.
``test_chapter.py`` checks that both give the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import torch

from minipar import comm
from minipar.check import Recipe
from minipar.data import ddp, diloco, powersgd, zeropp
from minipar.launcher import launch
from minipar.models import GPTConfig
from minipar.machine.cluster import comm_seconds
from minipar.course.ch14_shrinking_communication.compression_study import held_out_loss, study_recipe

__all__ = ["WORLD", "STEPS", "RANKS", "HS", "FRAGMENTS", "TUNED_LR", "MethodRun", "Study", "train_every_method",
           "with_learning_rate", "points", "beside_torch_hook", "print_points", "bytes_per_step_rows",
           "print_bytes_rows",
           "draw_loss_vs_bytes", "draw_losses", "draw_bytes_per_step", "gpt_shapes", "collectives_per_step",
           "step_seconds", "compute_seconds", "draw_step_seconds", "print_step_seconds", "print_reading",
           "print_hook_comparison"]

WORLD = 2              # ranks (replicas)
STEPS = 50             # the token budget: STEPS global batches of 8 sequences × 16 tokens (a multiple of each H)
TUNED_LR = 1e-2        # DDP once more at this AdamW learning rate (the recipe's is 3e-3)
RANKS = (1, 2, 4)      # PowerSGD ranks r
HS = (10, 50)          # DiLoCo inner steps per outer step
FRAGMENTS = 2          # streaming DiLoCo's fragments (at the largest H)
MARKERS = {"DDP": "o", "ZeRO-3": "s", "ZeRO++": "X", "PowerSGD": "^", "DiLoCo": "D", "Streaming": "P"}
COLOURS = {"DDP": "black", "ZeRO-3": "grey", "ZeRO++": "tab:green", "PowerSGD": "tab:blue", "DiLoCo": "tab:orange",
           "Streaming": "tab:red"}


@dataclass
class MethodRun:
    """One method on the budget: training loss per step (mean over ranks), the bytes rank 0 sent after each
    step (:mod:`minipar.comm`'s model), and the held-out loss of its final parameters."""
    name: str
    losses: list
    bytes_per_step: list
    held_out: float = float("nan")

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes_per_step))


@dataclass
class Study:
    recipe: Recipe
    held_out_batches: list
    runs: dict = field(default_factory=dict)            # {name: MethodRun}, in training order
    initial_loss: float = float("nan")                  # the untrained model on the held-out batches

    @property
    def shapes(self) -> list:
        return [p.shape for p in self.recipe.model().parameters()]


def _ddp(rank, world, recipe):
    log = comm.CommLog()
    result = ddp.parallel_train(rank, world, recipe, step_log=log)
    return result.losses, [log.bytes_sent / len(recipe.batches)] * len(recipe.batches), result.params


def _every_method(rank, world, recipe, ranks, Hs, fragments, tuned_lr, with_zeropp):
    """On each rank: DDP (and DDP at ``tuned_lr``), ZeRO++ (every rank its own node), PowerSGD at each r,
    DiLoCo at each H and streaming DiLoCo, one after the other."""
    out = {"DDP": _ddp(rank, world, recipe)}
    if tuned_lr:
        out[f"DDP lr {tuned_lr:g}"] = _ddp(rank, world, with_learning_rate(recipe, tuned_lr))
    if with_zeropp:
        res = zeropp.parallel_train(rank, world, recipe, per_node=1)
        out["ZeRO++"] = (res.losses, res.sent, res.params)
    for r in ranks:
        res = powersgd.parallel_train(rank, world, recipe, rank_r=r)
        out[f"PowerSGD r={r}"] = (res.losses, res.bytes_sent, res.params)
    jobs = [(f"DiLoCo H={H}", H, 1) for H in Hs] + ([(f"Streaming H={max(Hs)} F={fragments}", max(Hs), fragments)]
                                                  if fragments > 1 else [])
    for name, H, f in jobs:
        res = diloco.parallel_train(rank, world, recipe, H=H, fragments=f)
        out[name] = (res.losses, res.bytes_sent, res.params)
    return out


def train_every_method(steps: int = STEPS, world: int = WORLD, ranks=RANKS, Hs=HS, fragments: int = FRAGMENTS,
                       tuned_lr: float | None = TUNED_LR, with_zeropp: bool = True, recipe=None) -> Study:
    """Train every method on ``steps`` global batches in one launch; score each on the held-out batches."""
    base, held = study_recipe(steps)
    recipe = recipe or base
    study = Study(recipe, held, initial_loss=held_out_loss(recipe, recipe.model().state_dict(), held))
    for name, (losses, sent, params) in launch(_every_method, world, recipe, ranks, Hs, fragments,
                                               tuned_lr, with_zeropp, quiet=True)[0].items():
        study.runs[name] = MethodRun(name, losses, list(sent), held_out_loss(recipe, params, held))
    return study


def with_learning_rate(recipe: Recipe, lr: float) -> Recipe:
    """The same recipe with AdamW at learning rate ``lr``."""
    return Recipe(recipe.model, recipe.batches, lambda ps: torch.optim.AdamW(ps, lr=lr), recipe.loss,
                  name=f"{recipe.name}, lr {lr:g}")


def _family(name: str) -> str:
    return next(k for k in MARKERS if name.startswith(k))


def points(study: Study) -> list:
    """[(name, bytes per rank over the run, held-out loss, measured?)]: every run, and ZeRO-3 from its
    formula — 1.5× DDP's bytes (all-gather forward, all-gather backward, reduce-scatter), DDP's loss
    (it is exact: the same update as one device, so as DDP)."""
    rows = [(name, run.total_bytes, run.held_out, True) for name, run in study.runs.items()]
    ddp_run = study.runs["DDP"]
    return rows[:1] + [("ZeRO-3", 1.5 * ddp_run.total_bytes, ddp_run.held_out, False)] + rows[1:]


def print_points(rows: list, initial: float) -> None:
    ddp_bytes, ddp_loss = rows[0][1], rows[0][2]
    print(f"held-out loss of the untrained model: {initial:.4f}")
    print(f"{'method':<24}{'bytes per rank':>16}{'÷ DDP':>9}{'held-out loss':>15}{'vs DDP':>9}")
    for name, sent, loss, measured in rows:
        note = "" if measured else "   (formula; DDP's loss)"
        print(f"{name:<24}{sent:>16,.0f}{ddp_bytes / sent:>9.1f}{loss:>15.4f}{loss - ddp_loss:>+9.4f}{note}")


def beside_torch_hook(recipe: Recipe, rank_r: int, steps: int = 12, start_step: int = 2) -> tuple:
    """(rank 0 of minipar's PowerSGD, PyTorch's DDP + ``powerSGD_hook``) on the first ``steps`` batches of
    ``recipe``, both all-reducing plainly for the first ``start_step`` steps (PyTorch's minimum with error
    feedback)."""
    recipe = Recipe(recipe.model, recipe.batches[:steps], recipe.optimizer, recipe.loss, name=recipe.name)
    ours = powersgd.run(recipe, world_size=WORLD, rank_r=rank_r, start_step=start_step)[0]
    return ours, powersgd.torch_hook_run(recipe, WORLD, rank_r, start_step=start_step)


def print_hook_comparison(ours, theirs, start_step: int = 2) -> float:
    """Print the two runs side by side; return the largest loss gap."""
    same = ours.losses[:start_step] == theirs.losses[:start_step]
    gap = max(abs(a - b) for a, b in zip(ours.losses, theirs.losses))
    print(f"first {start_step} steps (both all-reduce plainly): losses {'identical' if same else 'DIFFERENT'}; "
          f"largest loss gap over {len(ours.losses)} steps: {gap:.4f}")
    if None not in ours.wire_bytes + theirs.wire_bytes:
        print(f"bytes on the wire per compressed step (rank 0): minipar {ours.wire_bytes[-1]:,}, PyTorch's hook "
              f"{theirs.wire_bytes[-1]:,}; modelled {ours.bytes_sent[-1]:,.0f} (the difference: what gloo adds around each message)")
    return gap


def print_reading(rows: list) -> None:
    """Sentences about the plot, generated from its numbers."""
    loss = {name: value for name, _, value, _ in rows}
    ddp_loss = loss["DDP"]
    psgd = [n for n in loss if n.startswith("PowerSGD")]
    trend = ("the higher the rank, the lower the loss" if sorted(psgd, key=loss.get, reverse=True) == psgd
             else "the loss does not fall with the rank in order")
    above = sum(loss[n] > ddp_loss for n in psgd)
    print(f"PowerSGD: {trend} ({', '.join(f'{n[9:]}: {loss[n]:.3f}' for n in psgd)}); "
          f"{above} of {len(psgd)} end above DDP's {ddp_loss:.3f}")
    for name in [n for n in loss if n.startswith(("DiLoCo", "Streaming"))]:
        side = "below" if loss[name] < ddp_loss else "above"
        print(f"{name}: {loss[name]:.3f}, {side} DDP's {ddp_loss:.3f} at the same learning rate")
    if "ZeRO++" in loss:
        sent = {name: value for name, value, _, _ in rows}
        print(f"ZeRO++: {sent['ZeRO-3'] / sent['ZeRO++']:.1f}× fewer bytes than ZeRO-3's formula, loss "
              f"{loss['ZeRO++']:.3f} against DDP's {ddp_loss:.3f} (quantized weights and gradients: not exact)")
    for name in [n for n in loss if " lr " in n]:
        beaten = [n for n in loss if loss[n] < loss[name]]
        verdict = ("below every other point: on this budget a larger step, not fewer bytes, is what lowers the "
                   "loss" if not beaten else f"above {', '.join(beaten)}")
        print(f"{name}: {loss[name]:.3f}, {verdict}")


def bytes_per_step_rows(study: Study) -> list:
    """[(r, measured bytes per step, formula)] for PowerSGD, and DDP's as r = None."""
    n, b = WORLD, study.recipe.dtype.itemsize
    rows = [(None, study.runs["DDP"].bytes_per_step[0], comm.predicted_bytes_sent(
        "all_reduce", b * sum(s.numel() for s in study.shapes), n))]
    for name, run in study.runs.items():
        if name.startswith("PowerSGD"):
            r = int(name.split("=")[1])
            rows.append((r, max(run.bytes_per_step), powersgd.powersgd_bytes(study.shapes, r, n, b)))
    return rows


def print_bytes_rows(rows: list) -> None:
    ddp_bytes = rows[0][1]
    print(f"{'':<14}{'measured B/step':>16}{'formula':>10}{'÷ DDP':>8}")
    for r, seen, formula in rows:
        print(f"{'DDP' if r is None else f'PowerSGD r={r}':<14}{seen:>16,.0f}{formula:>10,.0f}{ddp_bytes / seen:>8.1f}")


def _style(name: str, measured: bool) -> tuple:
    colour, marker = COLOURS[_family(name)], MARKERS[_family(name)]
    if not measured:
        return dict(marker=marker, color="none", edgecolors=colour), " (formula bytes, DDP's loss)"
    if " lr " in name:
        return dict(marker="*", color="none", edgecolors=colour), " (same DDP, larger learning rate)"
    return dict(marker=marker, color=colour, edgecolors=colour), ""


def draw_loss_vs_bytes(rows: list, initial: float, ax=None, title: str = ""):
    """The chapter's plot: held-out loss (y) against bytes per rank over the run (x, log)."""
    ax = ax or plt.subplots(figsize=(7.5, 4.5))[1]
    for name, sent, loss, measured in rows:
        style, note = _style(name, measured)
        ax.scatter(sent, loss, s=80, linewidths=1.5, label=name + note, **style)
        ax.annotate(name.split(" ", 1)[-1] if " " in name else name, (sent, loss), fontsize=7,
                    xytext=(6, 4), textcoords="offset points")
    ax.axhline(initial, color="grey", ls=":", lw=1, label="untrained model")
    ax.margins(x=0.12)
    ax.set(xscale="log", xlabel="bytes sent per rank over the whole run (log scale)",
           ylabel="held-out loss after the budget", title=title or "Loss against bytes, one token budget")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3, which="both")
    return ax


def draw_losses(curves: dict, ax=None, title: str = "Training loss per step", ylabel: str = "training loss"):
    """{label: losses per step} as lines."""
    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, lw=1.2)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def draw_bytes_per_step(study: Study, names, ax=None):
    """Bytes rank 0 sent after each step, for the runs ``names``."""
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    for i, name in enumerate(names):
        sent = study.runs[name].bytes_per_step
        ax.bar([s + 1 + 0.28 * (i - 1) for s in range(len(sent))], sent, width=0.28, label=name,
               color=("tab:orange", "tab:brown", "tab:red", "tab:purple")[i % 4])
    ax.axhline(study.runs["DDP"].bytes_per_step[0], color=COLOURS["DDP"], lw=1, ls="--", label="DDP (every step)")
    ax.set(xlabel="step", ylabel="bytes sent after the step", title="When each method talks")
    ax.legend(fontsize=8)
    return ax


# ------------------------------------------------------------------------------------------------------
# One step on a declared cluster: bytes × link = seconds (a model)
# ------------------------------------------------------------------------------------------------------

def gpt_shapes(cfg: GPTConfig) -> list:
    """The parameter shapes of :class:`minipar.models.TinyGPT` with ``cfg`` (biases on, untied), without
    building it: a 1.3B model's list costs nothing."""
    h, f = cfg.n_embd, cfg.ffn_hidden
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (f, h), (f,), (h, f), (h,)]
    return ([(cfg.vocab_size, h), (cfg.block_size, h)] + block * cfg.n_layer
            + [(h,), (h,), (cfg.vocab_size, h)])


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


def collectives_per_step(shapes, elem_bytes: int, ranks=RANKS, Hs=HS) -> dict:
    """{method: [(collective, payload bytes, calls per step)]} of one training step of each method."""
    psi = elem_bytes * sum(_numel(s) for s in shapes)
    out = {"DDP": [("all_reduce", psi, 1)], "ZeRO-3": [("all_gather", psi, 2), ("reduce_scatter", psi, 1)]}
    for r in ranks:
        kept = [s for s in shapes if powersgd.compressible(s, r)]
        ps = sum(s[0] * min(s[0], _numel(s[1:]), r) for s in kept)
        qs = sum(_numel(s[1:]) * min(s[0], _numel(s[1:]), r) for s in kept)
        rest = sum(_numel(s) for s in shapes if not powersgd.compressible(s, r))
        out[f"PowerSGD r={r}"] = [("all_reduce", elem_bytes * k, 1) for k in (ps, qs, rest)]
    for H in Hs:
        out[f"DiLoCo H={H}"] = [("all_reduce", psi, 1 / H)]
    return out


def step_seconds(collectives: dict, cluster, world: int) -> dict:
    """{method: seconds of communication per step}: each collective over ranks 0 … world−1 of ``cluster``,
    on the slowest link it crosses (α-β, :func:`minipar.machine.cluster.comm_seconds`)."""
    ranks = list(range(world))
    return {m: sum(calls * comm_seconds(op, ranks, payload, cluster) for op, payload, calls in cs)
            for m, cs in collectives.items()}


def compute_seconds(params: float, tokens_per_device: int, card) -> float:
    """6·Ψ·tokens FLOPs of forward + backward at the card's peak × its large-GEMM efficiency."""
    return 6 * params * tokens_per_device / (card.peak_flops * card.gemm_efficiency)


def print_step_seconds(by_cluster: dict, compute: float) -> None:
    for label, seconds in by_cluster.items():
        print(label)
        for m, t in seconds.items():
            print(f"  {m:<14}{t * 1e3:>9.1f} ms   {t / compute:>6.1%} of the step's compute")


def draw_step_seconds(by_cluster: dict, compute: float, ax=None):
    """{cluster label: {method: seconds}} as grouped horizontal bars, with the step's compute as a line."""
    ax = ax or plt.subplots(figsize=(8, 4))[1]
    methods = list(next(iter(by_cluster.values())))
    height = 0.8 / len(by_cluster)
    for i, (label, seconds) in enumerate(by_cluster.items()):
        ax.barh([m + height * (i - (len(by_cluster) - 1) / 2) for m in range(len(methods))],
                [seconds[m] for m in methods], height=height, label=label)
    ax.axvline(compute, color="black", ls="--", lw=1, label=f"compute of one step ({compute:.2f} s)")
    ax.set_yticks(range(len(methods)), methods)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="seconds of communication per step (log scale)",
           title="One data-parallel step on a declared cluster (a model: α-β on datasheet links)")
    ax.legend(fontsize=8, loc="lower right")
    return ax
