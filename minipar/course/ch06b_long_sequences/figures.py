"""Chapter 06b pictures, from the library's own data and from live runs on CPU ranks.

* ``06b_ring_schedule.png`` — the causal score matrix cut into chunks, each block coloured by the rank that
  computes it and labelled with the ring step, contiguous vs zig-zag (from :mod:`minipar.sequence.ring_attention`).
* ``06b_bytes.png`` — bytes one rank sends per layer (forward + backward), observed on the wire, for ring
  attention and Ulysses at N = 2 and 4, beside their formulas and Megatron SP's formula.
* ``06b_activation_memory.png`` — activation bytes per rank of one layer vs sequence length: one device,
  and ring attention, Ulysses, ring self-attention on 4 ranks.
* ``06b_load_balance.png`` — per-rank attention compute (CPU time, and chunk pairs counted) of causal ring
  attention without and with zig-zag, s = 2048 on 4 ranks, ÷ zig-zag's busiest rank, the counted ratio marked.
* ``06b_flash_tiling.png`` — FlashAttention-2's causal forward over a 6 × 6 grid of score tiles: the order
  the tiles are computed, and at chosen moments which tile exists (one), which are done (folded into the
  running max, sum and output, and freed) and which are skipped (above the diagonal), from
  :func:`minipar.sequence.flash.tiles`.
* ``06b_memory_three_bars.png`` — activation bytes of one layer at s = 512, measured: dense attention on one
  device → FlashAttention on one device (no s² scores) → ring attention per rank on 4 ranks (÷ N).
"""
from __future__ import annotations


import functools

import torch

from minipar.course.plotting import rank_colour, save_figure
from minipar.launcher import launch
from minipar.memory import saved_activation_bytes
from minipar.models import GPTConfig, TinyGPT, attention_core
from minipar.sequence import flash, ring_attention, ulysses
from minipar.sequence.measure import dense_layer, formula_bytes, layer_on_rank

__all__ = ["schedule", "bytes_vs_ranks", "memory_vs_sequence", "load_balance", "flash_layer", "memory_three_ways",
           "draw_schedule", "draw_bytes", "draw_memory", "counted_work", "draw_load_balance", "draw_tiling",
           "draw_three_bars", "FIGURES"]

CFG = GPTConfig(n_embd=32, n_head=4)


def schedule(world_size: int = 4, zigzag: bool = False) -> dict:
    """{(query chunk, key chunk): (rank, step)} for every block the causal ring computes."""
    n, out = world_size, {}
    for rank in range(n):
        mine = ring_attention.chunk_ids(rank, n, zigzag)
        for step in range(n):
            theirs = ring_attention.chunk_ids((rank - step) % n, n, zigzag)
            for i, j, _ in ring_attention.causal_pairs(mine, theirs):
                out[(mine[i], theirs[j])] = (rank, step)
    return out


def bytes_vs_ranks(ranks=(2, 4), methods=("ring", "ulysses"), b=4, s=16) -> list:
    """[{method, n, model, observed, formula, messages}] per rank mean, one layer forward + backward."""
    rows = []
    for n in ranks:
        for method in methods:
            per = launch(layer_on_rank, n, method, b, s, CFG, quiet=True)
            obs = [r["bytes_observed"] for r in per]
            rows.append({"method": method, "n": n, "model": sum(r["bytes_sent"] for r in per) / n,
                         "observed": None if None in obs else sum(obs) / n,
                         "formula": formula_bytes(method, b, s, CFG.n_embd, n),
                         "megatron_sp": 2 * ulysses.megatron_sp_forward_bytes(b, s, CFG.n_embd, n)})
    return rows


def _layers_on_rank(rank, world_size, runs, cfg):
    """Several :func:`layer_on_rank` measurements in one launch: ``runs`` = [(method, b, s)]."""
    return [layer_on_rank(rank, world_size, method, b, s, cfg) for method, b, s in runs]


def memory_vs_sequence(lengths=(64, 128, 256, 512), world_size=4, methods=("ring", "ulysses", "rsa"), b=1) -> dict:
    """{method: [activation bytes per rank (max over ranks) per length]}, with "one device" beside."""
    out = {"one device": [dense_layer(CFG, b, s)["activation_bytes"] for s in lengths]}
    runs = [(method, b, s) for method in methods for s in lengths]
    per_rank = launch(_layers_on_rank, world_size, runs, CFG, quiet=True)
    for i, (method, _, _) in enumerate(runs):
        out.setdefault(method, []).append(max(rank[i]["activation_bytes"] for rank in per_rank))
    return out


def flash_layer(cfg, b: int, s: int, block: int = 64, dtype=torch.float32) -> dict:
    """One device, the same block and input as :func:`~minipar.sequence.measure.dense_layer`, with
    FlashAttention (:func:`minipar.sequence.flash.flash_attention`, causal) as its attention core."""
    block_module = TinyGPT(cfg.with_(block_size=max(cfg.block_size, s), n_layer=1), seed=0).blocks[0].to(dtype)
    x = torch.randn(b, s, cfg.n_embd, generator=torch.Generator().manual_seed(1), dtype=dtype).requires_grad_(True)
    core = functools.partial(flash.flash_attention, is_causal=True, block_q=block, block_k=block)
    with attention_core(block_module.attn, core):
        _, act = saved_activation_bytes(block_module, x, exclude=list(block_module.parameters()) + [x])
    return {"activation_bytes": act}


def memory_three_ways(s: int = 512, world_size: int = 4, b: int = 1) -> dict:
    """Activation bytes of one layer of the tiny GPT at sequence length ``s``, measured: {"dense": one
    device, "flash": one device with FlashAttention, "ring": ring attention, max over ``world_size`` ranks}."""
    mem = memory_vs_sequence((s,), world_size, methods=("ring",), b=b)
    return {"dense": mem["one device"][0], "flash": flash_layer(CFG, b, s)["activation_bytes"], "ring": mem["ring"][0]}


def load_balance(s: int = 2048, world_size: int = 4, repeats: int = 3) -> dict:
    """{"ring"/"ring-zigzag": ([chunk pairs per rank], [median attention compute seconds per rank])}."""
    methods = ("ring", "ring-zigzag")
    runs = [(method, 1, s) for _ in range(repeats) for method in methods]
    per_rank = launch(_layers_on_rank, world_size, runs, GPTConfig(n_embd=64, n_head=4), quiet=True)
    out = {}
    for m, method in enumerate(methods):
        mine = [[rank[i] for i in range(m, len(runs), len(methods))] for rank in per_rank]
        times = [sorted(r["attention_compute_s"] for r in rank)[repeats // 2] for rank in mine]
        out[method] = ([rank[0]["attention_blocks"] for rank in mine], times)
    return out


def draw_schedule(world_size: int = 4):
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.4))
    for ax, zigzag in zip(axes, (False, True)):
        chunks = 2 * world_size                       # draw both on 2N chunks, so the areas compare
        blocks = schedule(world_size, zigzag)
        for qc in range(chunks):
            for kc in range(chunks):
                key = (qc, kc) if zigzag else (qc // 2, kc // 2)
                if key not in blocks or kc > qc:
                    continue
                rank, step = blocks[key]
                ax.add_patch(Rectangle((kc, qc), 1, 1, color=rank_colour(rank), alpha=0.5 if kc == qc else 0.9))
                ax.text(kc + 0.5, qc + 0.5, str(step), ha="center", va="center", fontsize=8, color="white")
        ax.set_xlim(0, chunks), ax.set_ylim(chunks, 0), ax.set_aspect("equal")
        ax.set_xlabel("key position (chunk)"), ax.set_ylabel("query position (chunk)")
        ax.set_title(("zig-zag: rank r holds chunks r and 2N−1−r" if zigzag else "contiguous: rank r holds s/N")
                     + "\ncolour = rank that computes, number = ring step", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=rank_colour(r)) for r in range(world_size)]
    fig.legend(handles, [f"rank {r}" for r in range(world_size)], loc="lower center", ncol=world_size, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def draw_bytes(rows):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{r['method']}\nN={r['n']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["observed"] or 0 for r in rows], 0.4, label="observed on the wire")
    ax.bar([i + 0.2 for i in x], [r["formula"] for r in rows], 0.4, label="formula")
    ax.plot(list(x), [r["megatron_sp"] for r in rows], "k_", markersize=25, label="Megatron SP, formula (fwd + bwd)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("bytes sent per rank per layer\n(forward + backward, b=4, s=16, h=32)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_memory(lengths, data):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, values in data.items():
        ax.plot(lengths, [v / 2**20 for v in values], "o-", label=name + ("" if name == "one device" else ", per rank (N=4)"))
    ax.set_xscale("log", base=2), ax.set_yscale("log")
    ax.set_xlabel("sequence length s"), ax.set_ylabel("activation MiB kept for backward (one layer)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def counted_work(data) -> dict:
    """{method: half-size chunk pairs each rank computes}: the work counted, not timed. Zig-zag's blocks are
    already half-size pairs (s/2N per side); a contiguous block (s/N per side) is (2N/N)² = 4 of them."""
    return {"ring": [4 * b for b in data["ring"][0]], "ring-zigzag": list(data["ring-zigzag"][0])}


def draw_load_balance(data):
    """Work per rank ÷ the busiest zig-zag rank's: measured CPU time (bars) and counted chunk pairs
    (markers), so zig-zag sits near 1 and the contiguous layout's busiest rank at the counted ratio."""
    import matplotlib.pyplot as plt
    from fractions import Fraction

    units = counted_work(data)
    counted_ratio = Fraction(max(units["ring"]), max(units["ring-zigzag"]))
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    n = len(data["ring"][1])
    zigzag_busiest_s, zigzag_busiest_units = max(data["ring-zigzag"][1]), max(units["ring-zigzag"])
    for k, (method, (_, times)) in enumerate(data.items()):
        xs = [r + (k - 0.5) * 0.4 for r in range(n)]
        label = "contiguous" if method == "ring" else "zig-zag"
        ax.bar(xs, [t / zigzag_busiest_s for t in times], 0.4, label=f"{label}: measured CPU time", alpha=0.8)
        ax.plot(xs, [u / zigzag_busiest_units for u in units[method]], "k_", markersize=24, mew=2.5,
                label="counted chunk pairs" if k == 0 else None)
    ax.axhline(float(counted_ratio), color="#C44E52", ls="--", lw=1,
               label=f"counted: busiest contiguous / zig-zag = {counted_ratio.numerator}/{counted_ratio.denominator}"
                     f" ≈ {float(counted_ratio):.2f}")
    ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylabel("work per rank ÷ zig-zag's busiest rank")
    ax.set_title(f"Causal ring attention on {n} ranks: contiguous vs zig-zag chunks, per rank\n"
                 "(bars: attention forward CPU time, live run; markers: chunk pairs counted)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def draw_tiling(tiles_per_side: int = 6, moments=(0, 7, 20)):
    """The causal score matrix as a grid of tiles: left, the order FlashAttention-2's forward computes them
    (query blocks outer, key blocks inner); then, at each of ``moments``, the one tile that exists."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    n = tiles_per_side
    order = [(rows.start, cols.start) for rows, cols in flash.tiles(n, n, 1, 1, is_causal=True)]
    fig, axes = plt.subplots(1, 1 + len(moments), figsize=(3.1 * (1 + len(moments)), 4.0))
    for ax, moment in zip(axes, (None, *moments)):
        for qb in range(n):
            for kb in range(n):
                if (qb, kb) not in order:
                    ax.add_patch(Rectangle((kb, qb), 1, 1, facecolor="#eeeeee", hatch="//", edgecolor="#bbbbbb"))
                    continue
                t = order.index((qb, kb))
                if moment is None:
                    ax.add_patch(Rectangle((kb, qb), 1, 1, facecolor=rank_colour(0), alpha=0.35, edgecolor="white"))
                    ax.text(kb + 0.5, qb + 0.5, str(t), ha="center", va="center", fontsize=8)
                elif t == moment:
                    ax.add_patch(Rectangle((kb, qb), 1, 1, facecolor=rank_colour(3), edgecolor="black"))
                elif t < moment:
                    ax.add_patch(Rectangle((kb, qb), 1, 1, facecolor=rank_colour(0), alpha=0.15, edgecolor="white"))
        ax.set_xlim(0, n), ax.set_ylim(n, 0), ax.set_aspect("equal")
        ax.set_xticks([]), ax.set_yticks([])
        ax.set_xlabel("key block j"), ax.set_ylabel("query block i")
        if moment is None:
            ax.set_title("order of the tiles\n(causal: upper triangle skipped)", fontsize=9)
        else:
            qb, kb = order[moment]
            ax.set_title(f"moment {moment}: only S[{qb},{kb}] exists\nrow block {qb} keeps m, ℓ, Õ", fontsize=9)
    fig.legend([Patch(facecolor=rank_colour(3), edgecolor="black"), Patch(facecolor=rank_colour(0), alpha=0.15),
                Patch(facecolor="#eeeeee", hatch="//", edgecolor="#bbbbbb")],
               ["the one tile alive", "done: folded into (m, ℓ, Õ), freed", "skipped: wholly masked"],
               loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig


def draw_three_bars(data: dict, s: int = 512, world_size: int = 4):
    """Three bars from :func:`memory_three_ways`, each step's factor written on the arrow between them."""
    import matplotlib.pyplot as plt

    labels = ["dense attention\none device", "FlashAttention\none device", f"ring attention\nper rank, N = {world_size}"]
    values = [data["dense"] / 2**10, data["flash"] / 2**10, data["ring"] / 2**10]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.bar(range(3), values, 0.55, color=[rank_colour(3), rank_colour(0), rank_colour(2)])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:,.0f} KiB", ha="center", va="bottom", fontsize=8)
    for i, why in ((0, "no s² scores kept"), (1, "s/N tokens per rank")):
        ax.annotate(f"÷ {values[i] / values[i + 1]:.1f}\n{why}", xy=(i + 0.72, max(values[i + 1], values[0] * 0.35)),
                    ha="center", fontsize=8)
    ax.set_xticks(range(3), labels, fontsize=8)
    ax.set_ylabel(f"activation KiB kept for backward\n(one layer, s = {s}, measured)")
    fig.tight_layout()
    return fig


def _save(fig, path):
    save_figure(fig, path, dpi=110)


def _memory_figure(path):
    lengths = (64, 128, 256, 512)
    _save(draw_memory(lengths, memory_vs_sequence(lengths)), path)


FIGURES = {
    "06b_ring_schedule.png": lambda path: _save(draw_schedule(), path),
    "06b_bytes.png": lambda path: _save(draw_bytes(bytes_vs_ranks()), path),
    "06b_activation_memory.png": _memory_figure,
    "06b_load_balance.png": lambda path: _save(draw_load_balance(load_balance()), path),
    "06b_flash_tiling.png": lambda path: _save(draw_tiling(), path),
    "06b_memory_three_bars.png": lambda path: _save(draw_three_bars(memory_three_ways()), path),
}
