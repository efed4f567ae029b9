"""Chapter 12 pictures: the source articles' decision guide as a flow chart, a stacked memory bar per device and the
memory-and-time calculator that draws it (:func:`calculate`, :func:`draw_calculator`,
:func:`calculator_controls`: every knob, cp and ep included), memory per device over the sequence length, the cost model beside what the
tour's runs measured (bytes per rank and memory), and predicted against measured step times."""
from __future__ import annotations

from minipar.course.plotting import save_figure
from dataclasses import replace

from minipar.machine.cluster import a100_cluster, h100_cluster
from minipar.plan import GPT3_175B, Layout, MoETransformer, Transformer, estimate
from minipar.plan.operators import MEGATRON_2022

__all__ = ["draw_decision_guide", "draw_memory_bars", "CALCULATOR_MODELS", "CALCULATOR_CLUSTERS", "calculate",
           "estimate_table", "draw_calculator",
           "calculator_controls", "sweep_sequence", "draw_sequence_sweep", "draw_published", "MEMORY_COLOURS",
           "FIGURES"]

MEMORY_COLOURS = {"params": "#4C72B0", "grads": "#55A868", "optimizer": "#8172B2", "activations": "#C44E52",
                  "buffers": "#CCB974"}

# (x, y, text, kind) — kind: q = question, a = answer (a family of layouts)
_NODES = {
    "start": (0.50, 0.95, "how many devices?", "q"),
    "one": (0.13, 0.78, "one device:\nfits?", "q"),
    "node": (0.50, 0.78, "one node:\nfits one device?", "q"),
    "many": (0.86, 0.78, "many nodes:\nfits one device?", "q"),
    "one_yes": (0.05, 0.56, "train as is", "a"),
    "one_no": (0.21, 0.56, "largest layer\nfits?", "q"),
    "one_no_yes": (0.13, 0.34, "ZeRO + offload\n(CPU, NVMe)", "a"),
    "one_no_no": (0.29, 0.34, "ZeRO + offload\n+ memory-centric\ntiling", "a"),
    "node_yes": (0.40, 0.56, "DDP or ZeRO", "a"),
    "node_no": (0.56, 0.56, "largest layer\nfits?", "q"),
    "node_no_yes": (0.47, 0.34, "PP, ZeRO or TP\n(PP if no NVLink)", "a"),
    "node_no_no": (0.63, 0.34, "TP (or ZeRO)", "a"),
    "many_yes": (0.76, 0.56, "DDP or ZeRO", "a"),
    "many_no": (0.92, 0.60, "largest layer\nfits?", "q"),
    "many_no_layer": (0.92, 0.43, "fast links\nbetween nodes?", "q"),
    "many_no_layer_yes": (0.84, 0.26, "ZeRO-3, or\nPP + TP + DP", "a"),
    "many_no_layer_no": (0.97, 0.26, "DP + PP + TP\n+ ZeRO-1", "a"),
}
_EDGES = [("start", "one", "1"), ("start", "node", "one node"), ("start", "many", "> 1 node"),
          ("one", "one_yes", "yes"), ("one", "one_no", "no"), ("one_no", "one_no_yes", "yes"),
          ("one_no", "one_no_no", "no"), ("node", "node_yes", "yes"), ("node", "node_no", "no"),
          ("node_no", "node_no_yes", "yes"), ("node_no", "node_no_no", "no"), ("many", "many_yes", "yes"),
          ("many", "many_no", "no"), ("many_no", "many_no_layer", "yes"),
          ("many_no_layer", "many_no_layer_yes", "yes"), ("many_no_layer", "many_no_layer_no", "no")]


def draw_decision_guide(ax=None, highlight=()):
    """A decision guide after Hugging Face's, the course's additions marked, as boxes and arrows; ``highlight``:
    node names to colour (a path taken by :func:`minipar.plan.decide`). Returns the axes."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 5.5))
    for a, b, label in _EDGES:
        (x0, y0, *_), (x1, y1, *_) = _NODES[a], _NODES[b]
        colour = "#C44E52" if a in highlight and b in highlight else "0.5"
        ax.annotate("", (x1, y1 + 0.06), (x0, y0 - 0.06), arrowprops=dict(arrowstyle="->", color=colour))
        ax.text((x0 + x1) / 2, (y0 + y1) / 2, label, fontsize=8, ha="center", color=colour,
                bbox=dict(fc="white", ec="none", pad=0.5))
    for name, (x, y, text, kind) in _NODES.items():
        face = "#F2F2F2" if kind == "q" else "#DCE9F5"
        edge = "#C44E52" if name in highlight else "0.3"
        ax.text(x, y, text, ha="center", va="center", fontsize=8.5,
                bbox=dict(boxstyle="round,pad=0.4", fc=face, ec=edge, lw=2 if name in highlight else 1))
    ax.text(0.5, 0.16, "added by this course: \"fits one device?\" under many nodes; always TP inside a node "
                       "(tp ≤ devices per node)", ha="center", fontsize=8, style="italic", color="0.35")
    ax.text(0.5, 0.12, "and (chapter 08 §5): with PP, ZeRO-2 reduce-scatters gradients every micro-batch and "
                       "ZeRO-3 also re-gathers parameters: (m+1)/2× to 3m/2× ZeRO-1's DP bytes", ha="center", fontsize=8, style="italic", color="0.35")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0.08, 1.02)
    ax.axis("off")
    ax.set_title("Which parallelism? A decision guide after the Hugging Face guide")
    return ax


def draw_memory_bars(estimates: dict, limit: float | None = None, ax=None):
    """Stacked bars of memory per device (GB), one per labelled estimate; a dashed line at ``limit``."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    labels = list(estimates)
    bottoms = [0.0] * len(labels)
    for term, colour in MEMORY_COLOURS.items():
        heights = [estimates[k].memory[term] / 1e9 for k in labels]
        ax.bar(labels, heights, bottom=bottoms, color=colour, label=term)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if limit is not None:
        ax.axhline(limit / 1e9, color="k", ls="--", lw=1)
        ax.text(len(labels) - 0.5, limit / 1e9, f" {limit / 1e9:.0f} GB", va="bottom", ha="right", fontsize=8)
    ax.set_ylabel("GB per device")
    ax.legend(fontsize=8, loc="upper left")
    return ax


CALCULATOR_MODELS = {
    "GPT-3 175B": GPT3_175B, "GPT 13B": Transformer(40, 5120, 40, 51200, 2048),
    "GPT 1.3B": Transformer(24, 2048, 16, 51200, 2048),
    # GPT 1.3B with 8 experts in every other block (Switch/GLaM's placement), top-2, capacity factor 1.25
    "MoE 1.3B × 8 experts": MoETransformer(24, 2048, 16, 51200, 2048, experts=8, k=2, capacity_factor=1.25,
                                           every=2),
}


# nodes of 8 GPUs, operators priced on the device cards (the A100's matmul efficiency fitted on one published
# run, the H100's measured on one H100)
CALCULATOR_CLUSTERS = {"A100 card (device model)": a100_cluster, "H100 card (device model)": h100_cluster}


def calculate(model="GPT-3 175B", seq_len=2048, dp=8, zero=1, tp=8, sp=True, pp=16, schedule="1f1b", v=1,
              cp=1, cp_method="ring", ep=1, micro_batch=1, micro_batches=192, recompute="selective",
              overlap=False, cluster="A100 card (device model)"):
    """The estimate of one layout of a :data:`CALCULATOR_MODELS` model at ``seq_len`` on as many nodes of 8
    GPUs of a :data:`CALCULATOR_CLUSTERS` kind as the layout needs (world = dp·pp·cp·tp; ep borrows from
    dp·cp). ``v`` counts only for the interleaved schedule. Raises ValueError, with the reason, for a layout
    that cannot run."""
    layout = Layout(dp=dp, tp=tp, pp=pp, v=v if schedule == "interleaved" else 1, cp=cp, cp_method=cp_method,
                    ep=ep, zero=zero, sp=sp, recompute=recompute, micro_batch=micro_batch,
                    micro_batches=micro_batches, schedule=schedule)
    return estimate(replace(CALCULATOR_MODELS[model], seq_len=seq_len),
                    CALCULATOR_CLUSTERS[cluster](-(-layout.devices // 8)), layout, overlap=overlap)


def estimate_table(e) -> str:
    """An estimate as a small table: memory per device (GB) and step time (s) term by term, MFU, fits."""
    mem = [(k, f"{v / 1e9:.1f}") for k, v in e.memory.items() if k != "total"]
    tim = [(k, f"{v:.3g}") for k, v in e.time.items() if k != "total" and v]
    rows = [f"{'memory (GB/device)':<20}{'':>8}   {'step time (s)':<14}"]
    for i in range(max(len(mem), len(tim))):
        m, t = mem[i] if i < len(mem) else ("", ""), tim[i] if i < len(tim) else ("", "")
        rows.append(f"  {m[0]:<18}{m[1]:>8}     {t[0]:<12}{t[1]:>8}")
    rows.append(f"  {'total':<18}{e.memory['total'] / 1e9:>8.1f}     {'total':<12}{e.step_seconds:>8.3g}")
    fits = "fits" if e.fits else "DOES NOT FIT"
    rows.append(f"MFU {e.mfu:.1%}; {fits} in {e.memory_limit / 1e9:.0f} GB; layout {e.layout}")
    return "\n".join(rows)


def draw_calculator(**knobs):
    """:func:`calculate` drawn: the busiest device's memory bar against the card's memory, and the estimate
    as a small table (:func:`estimate_table`), or why the layout cannot run. Returns nothing (a widget would
    show the value)."""
    import matplotlib.pyplot as plt
    try:
        e = calculate(**knobs)
    except ValueError as exc:
        print("not a valid layout:", exc)
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    draw_memory_bars({"busiest device": e}, e.memory_limit, ax)
    nodes = -(-e.layout.devices // 8)
    ax.set_title(f"{knobs.get('model', 'GPT-3 175B')}, {e.layout.devices} GPUs on {nodes} nodes, "
                 f"global batch {e.layout.global_batch}", fontsize=9)
    plt.show()
    print(estimate_table(e))


def calculator_controls() -> dict:
    """The widgets for ``ipywidgets.interact(draw_calculator, **calculator_controls())``; v is enabled only
    for the interleaved schedule, the cp method only when cp > 1, ep only for the MoE model."""
    import ipywidgets as widgets
    controls = dict(model=widgets.Dropdown(options=list(CALCULATOR_MODELS)), seq_len=widgets.IntSlider(2048, 512, 131072, 512),
                    dp=widgets.IntSlider(8, 1, 1024), zero=widgets.Dropdown(options=[0, 1, 2, 3], value=1),
                    tp=widgets.Dropdown(options=[1, 2, 4, 8, 16], value=8), sp=True,
                    pp=widgets.Dropdown(options=[1, 2, 4, 8, 12, 16, 24, 32], value=16),
                    schedule=widgets.Dropdown(options=["1f1b", "gpipe", "interleaved", "zb-h1"]),
                    v=widgets.IntSlider(1, 1, 4, description="v", disabled=True),
                    cp=widgets.Dropdown(options=[1, 2, 4, 8, 16], value=1),
                    cp_method=widgets.Dropdown(options=["ring", "ring-zigzag", "ulysses", "rsa"], disabled=True),
                    ep=widgets.Dropdown(options=[1, 2, 4, 8], value=1, disabled=True),
                    micro_batch=widgets.IntSlider(1, 1, 16), micro_batches=widgets.IntSlider(192, 1, 1024),
                    recompute=["selective", "none", "full"],
                    overlap=widgets.Dropdown(options=[("no overlap", False), ("as minipar", "minipar"),
                                                      ("as DDP / DeepSpeed", True)], value=False),
                    cluster=widgets.Dropdown(options=list(CALCULATOR_CLUSTERS)))
    follow_from = {"v": ("schedule", lambda x: x == "interleaved"), "cp_method": ("cp", lambda x: x > 1),
                   "ep": ("model", lambda x: isinstance(CALCULATOR_MODELS[x], MoETransformer))}
    for target, (source, enabled) in follow_from.items():
        controls[source].observe(lambda change, t=target, f=enabled: setattr(controls[t], "disabled",
                                                                            not f(change["new"])), names="value")
    return controls


# A fused FlashAttention kernel (Dao 2023; the default in current stacks) never stores the s × s scores: with SP
# the s² terms are gone without recomputing anything. The other rows run Megatron-LM 2022's unfused attention.
FLASH = replace(MEGATRON_2022, name="Megatron-LM 2022 with flash attention", attention="flash")
_SWEEP = Layout(dp=8, tp=8, pp=16, zero=1, micro_batches=192)
SWEEP_LAYOUTS = {
    "TP 8": _SWEEP,
    "TP 8 + SP": replace(_SWEEP, sp=True),
    "TP 8 + SP + selective": replace(_SWEEP, sp=True, recompute="selective"),
    "TP 8 + full recompute": replace(_SWEEP, recompute="full"),
    "TP 8 + SP, flash": (replace(_SWEEP, sp=True), FLASH),
    "TP 8 + SP + full recompute, flash": (replace(_SWEEP, sp=True, recompute="full"), FLASH),
}


def sweep_sequence(model: Transformer, cluster, layouts: dict = SWEEP_LAYOUTS,
                   seq_lens=(1024, 2048, 4096, 8192, 16384, 32768)) -> dict:
    """{label: [(s, Estimate)]}: the same layouts as the sequence grows (batch in tokens grows with it). A
    layout is a :class:`Layout` (Megatron-LM 2022's kernels) or a (layout, kernels) pair."""
    out = {}
    for label, value in layouts.items():
        layout, kernels = value if isinstance(value, tuple) else (value, MEGATRON_2022)
        out[label] = [(s, estimate(replace(model, seq_len=s), cluster, layout, kernels=kernels)) for s in seq_lens]
    return out


def draw_sequence_sweep(sweep: dict, limit: float, ax=None):
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for label, points in sweep.items():
        ax.plot([s for s, _ in points], [e.memory["total"] / 1e9 for _, e in points], "o-", label=label)
    ax.axhline(limit / 1e9, color="k", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("GB per device (first stage)")
    ax.legend(fontsize=8)
    return ax


# Each published row's label, in points from its marker, placed so no two overlap; MT-NLG's three in a column at
# the right edge (axes fractions), with leader lines.
_LABEL_AT = {"22B SP + selective": (8, -4, "left"), "22B full recompute": (8, -4, "left"), "Llama-3.1-8B FSDP":
             (6, -10, "left"), "Llama 3 405B 8K GPUs 8K": (-8, -10, "right"), "Llama 3 405B 16K GPUs 128K":
             (8, -16, "left"), "175B full recompute": (-8, -2, "right"), "Llama-3.1-405B FSDP + TP": (-14, 18, "right"),
             **{run: (-8, 0, "right") for run in ("175B SP + selective", "530B SP + selective", "530B full recompute",
                                                  "1T SP + selective", "1T full recompute")},
             **{f"MT-NLG 530B, {n} nodes": (0.97, y, "right") for n, y in ((280, 0.66), (350, 0.615), (420, 0.57))}}
_KINDS = {"calibration": ("o", True, "#4C72B0", "calibration (η_F fitted to it)"),
          "weak": ("s", False, "#4C72B0", "weak check (source of a fitted row)"),
          "independent": ("D", False, "#C44E52", "independent check (source fitted to nothing)")}


def draw_published(rows: list, ax=None, tolerance: float = 0.15):
    """Log-log: published (x) against the planner's model (y) seconds per iteration, one point per row of
    :func:`minipar.plan.published.table` (filled circle: a card's calibration row, the run its one fitted number
    was fitted to; hollow square: a weak check, from a calibration row's source; hollow diamond: an independent
    check), the line y = x and the ±``tolerance`` band."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 5.5))
    xs, ys = [r["published"] for r in rows], [r["predicted"] for r in rows]
    lo, hi = min(xs + ys) / 1.5, max(xs + ys) * 1.5
    ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, label="model = published")
    ax.fill_between([lo, hi], [lo * (1 - tolerance), hi * (1 - tolerance)], [lo * (1 + tolerance), hi * (1 + tolerance)],
                    color="0.9", label=f"within ±{tolerance:.0%}")
    fitted = {r["source"].split(",")[0] for r in rows if r["role"] == "calibration"}
    kind = {r["run"]: r["role"] if r["role"] == "calibration" else     # weak: a calibration row's paper and code
            "weak" if r["source"].split(",")[0] in fitted else "independent" for r in rows}
    for k, (marker, filled, colour, label) in _KINDS.items():
        got = [r for r in rows if kind[r["run"]] == k]
        ax.scatter([r["published"] for r in got], [r["predicted"] for r in got], marker=marker, zorder=3,
                   facecolors=colour if filled else "none", edgecolors=colour, label=label)
    for r in rows:
        dx, dy, ha = _LABEL_AT.get(r["run"], (-5, 6, "right"))
        column = abs(dx) < 1            # an axes fraction, not points
        ax.annotate(f"{r['run']} ×{r['ratio']:.2f}", (r["published"], r["predicted"]),
                    textcoords="axes fraction" if column else "offset points", xytext=(dx, dy), ha=ha, va="center",
                    fontsize=7, arrowprops=dict(arrowstyle="-", color="0.6", lw=0.5) if column or abs(dy) > 16 else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published seconds per iteration")
    ax.set_ylabel("model seconds per iteration (planner, device cards)")
    ax.set_title("the model of time against published training runs", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def _save(fig, path):
    save_figure(fig, path, dpi=110, tight_layout=True)


def _guide(path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 5.5))
    draw_decision_guide(ax)
    _save(fig, path)


def _sweep(path):
    import matplotlib.pyplot as plt
    from minipar.plan import GPT3_175B
    cluster = a100_cluster(128)
    fig, ax = plt.subplots(figsize=(7, 4))
    draw_sequence_sweep(sweep_sequence(GPT3_175B, cluster), cluster.memory_bytes, ax)
    ax.set_title("GPT-3 175B, dp 8 (ZeRO-1) · tp 8 · pp 16, 1F1B, m = 192", fontsize=10)
    _save(fig, path)


def _published(path):
    import matplotlib.pyplot as plt
    from minipar.plan.published import table
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    draw_published(table(), ax)
    _save(fig, path)


FIGURES = {"12_decision_guide.png": _guide, "12_memory_vs_sequence.png": _sweep,
           "12_published_runs.png": _published}
