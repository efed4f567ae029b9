"""Chapter 05's displays: each prints (or draws) what one cell ran and holds it to the chapter's claims
(:mod:`.claims`), printing nothing more when they hold — so a cell reads ``result = run(...)``, ``show(result)``."""
from __future__ import annotations


import matplotlib.pyplot as plt

from minipar.check import compare, gpt_recipe, train_reference
from minipar.machine.device import H100_SXM

from . import claims
from . import measure
from .figures import column_gelu_shards, draw_column_gelu, draw_tp_throughput
from .throughput import CARDS, gpt3_shaped, narrow_matmuls, weight_state_gb
from .timing import one_step, tp_runs, tp_table

__all__ = ["column_split", "show_row_split", "show_mlp", "show_attention", "show_loss", "gpt_vs_one_device", "show_gpt", "show_layer_bytes",
           "layer_bytes", "show_memory", "memory_per_rank", "show_tp_throughput", "tiny_gpt_replays", "show_replays",
           "show_pytorch"]


def column_split(world_size: int = 2):
    """Y = GeLU(XA) on ``world_size`` live ranks: draws it and returns (X, A)."""
    x, a, shards = column_gelu_shards(world_size)
    draw_column_gelu(world_size)
    plt.show()
    claims.check_y_gelu_xa_with_split(shards, x, a)
    return x, a


def show_row_split(sums_add_up: bool, gelus_add_up: bool) -> None:
    print(f"row split: X1A1 + X2A2 = XA? {sums_add_up}.  GeLU(X1A1) + GeLU(X2A2) = GeLU(XA)? {gelus_add_up}: "
          "the row split must all-reduce before GeLU; the column split needs no communication there")
    claims.check_gelu_does_not_add_up(sums_add_up, gelus_add_up)


def show_mlp(per_rank: list) -> None:
    for rank, r in enumerate(per_rank):
        print(f"rank {rank}: shards A {r['shard of A']}, B {r['shard of B']}; max |y − y_ref| {r['max |y - y_ref|']:.1e}, "
              f"max |dX − dX_ref| {r['max |dX - dX_ref|']:.1e}; all-reduces (calls, bytes) forward "
              f"{r['forward']['all_reduce']}, backward {r['backward']['all_reduce']}")
        claims.check_mlp_column_parallel_then_row(r)


def show_attention(per_rank: list) -> None:
    for rank, (heads, qkv_shape, diff) in enumerate(per_rank):
        print(f"rank {rank}: {heads} of 8 heads, QKV shard {qkv_shape} (of (96, 32)), max |Δ| vs one device {diff:.1e}")
        claims.check_attention_heads_split_across_ranks(heads, qkv_shape, diff)


def show_loss(by_vocab: dict, world_size: int = 4) -> None:
    """{V: rank 0's (loss, F.cross_entropy's, all-reduces, bytes sent)}."""
    from minipar.tensor.vocab import padded_vocab_size
    for vocab_size, (got, want, calls, sent, _) in by_vocab.items():
        print(f"V={vocab_size:>6} (padded to {padded_vocab_size(vocab_size, world_size)}): loss {got:.10f}, "
              f"F.cross_entropy {want:.10f}; {calls} all-reduces, {sent} bytes sent by rank 0")
        # bytes: max and target logit, b·s = 32 float64 each; Σexp and Σz (label smoothing) 2 × 32 — whatever V is
        claims.check_vocabulary_split_embedding_cross_entropy(got, want, calls, sent)
    gaps = {vocab_size: r[4] for vocab_size, r in by_vocab.items()}
    print("the vocabulary-parallel embedding against nn.Embedding, max |difference|: "
          + ", ".join(f"V={v}: {gap}" for v, gap in gaps.items()))
    claims.check_vocabulary_parallel_embedding(gaps)


def gpt_vs_one_device(recipe, world_size: int = 4, label_smoothing: float = 0.1) -> None:
    """The whole GPT trained tensor-parallel (:func:`minipar.tensor.gpt.compare_to_one_device`) against one device,
    and a model whose 6 heads do not split 4 ways refused before any process starts; shown by :func:`show_gpt`."""
    from minipar.tensor.gpt import compare_to_one_device
    comparison = compare_to_one_device(recipe, world_size=world_size, label_smoothing=label_smoothing,
                                       launch_kwargs={"quiet": True})
    try:
        compare_to_one_device(gpt_recipe(steps=1, n_head=6, n_embd=48), world_size=world_size)
        refused = None
    except ValueError as err:
        refused = err
    show_gpt(comparison, refused)


def show_gpt(comparison, refused) -> None:
    print(f"t = 4: {comparison}")          # (minipar's tests check t = 1, 2, 4)
    print("a model with 6 heads on 4 ranks — ValueError before any process started:", refused)
    comparison.assert_ok()
    claims.check_whole_gpt_tensor_parallel_against(refused)


def show_layer_bytes(layer: dict) -> None:
    """{t: (the log's {"bytes_sent", "by_op"}, bytes observed on the wire, formula)} of one layer."""
    for t, (sent, observed, formula) in layer.items():
        calls = sent["by_op"]["all_reduce"][0]
        print(f"t={t}: {calls} all-reduces, {sent['bytes_sent']:,} B sent = formula 4 × 2(t-1)/t × b·s·h·4 B")
    claims.check_bytes_per_layer(layer)     # also bounds what the sockets carried beyond the formula (gloo's framing)


def show_memory(mem: dict, bsh: int = 4 * 16 * 32) -> float:
    """Prints the per-rank table of :func:`.measure.memory_per_degree`, then the t = 4 activation formula cut into
    what stays whole on every rank and what is split (the formula is W + S/t: W and S from t = 1 and 2); returns
    t = 4's activation fraction."""
    one = mem[1]
    print(f"{'t':>2} {'parameters':>11} {'formula':>8} {'of t=1':>7}   {'activations':>11} {'formula':>8} {'of t=1':>7}")
    for t, r in mem.items():
        print(f"{t:>2} {r['param_bytes']:>9} B {r['param_formula']:>8.0f} {r['param_bytes'] / one['param_bytes']:>7.3f}   "
              f"{r['activation_bytes']:>9} B {r['activation_formula']:>8.0f} "
              f"{r['activation_bytes'] / one['activation_bytes']:>7.3f}")
    fraction = mem[4]["activation_bytes"] / one["activation_bytes"]
    claims.check_memory_per_rank_measured(mem, fraction)
    split = 2 * (one["activation_formula"] - mem[2]["activation_formula"])     # S: divided by t
    whole = one["activation_formula"] - split                                 # W: the same on every rank
    claims.check_whole_plus_split(whole, split, mem[4]["activation_formula"], 4 * bsh * 4)
    print(f"t = 4, the formula's {mem[4]['activation_formula']:.0f} B per rank: {whole:.0f} B whole on every rank "
          f"(the two LayerNorms' inputs and outputs, 4·b·s·h values = {4 * bsh * 4} B, their statistics, the causal "
          f"mask) + {split / 4:.0f} B split (Q, K, V, the scores, the projection's input, the 4h MLP activations: "
          f"{split:.0f} B / 4)")
    return fraction


def layer_bytes(degrees=(2, 4), b: int = 4, s: int = 16, h: int = 32, a: int = 4) -> int:
    """One layer's forward and backward at each t (:func:`.measure.layer_bytes`), shown by
    :func:`show_layer_bytes`; returns the all-reduces rank 0 ran at the largest t, counted in its log."""
    layer = measure.layer_bytes(degrees=degrees, b=b, s=s, h=h, a=a)
    show_layer_bytes(layer)
    return layer[max(degrees)][0]["by_op"]["all_reduce"][0]


def memory_per_rank(degrees=(1, 2, 4), b: int = 4, s: int = 16, h: int = 32, a: int = 4) -> tuple:
    """One layer's bytes per rank at each t (:func:`.measure.memory_per_degree`), shown by :func:`show_memory`;
    returns (t = 4's measured activation fraction of t = 1's, the formula's)."""
    mem = {r["t"]: r for r in measure.memory_per_degree(degrees=degrees, b=b, s=s, h=h, a=a)}
    fraction = show_memory(mem, b * s * h)
    return fraction, mem[4]["activation_formula"] / mem[1]["activation_formula"]


def show_tp_throughput(rows: list) -> dict:
    """The planner's GPT-3-shaped rows (:func:`.throughput.tp_throughput`): why t = 1 does not fit (above the
    figure), the figure, one headline line (TP's
    share of the step at t = 8 and 16), then the tokens/s kept, a narrow-matmul sensitivity, the table, the
    cards' prices and the memory per GPU in a collapsed block; the checks; returns the H100 8-GPU-node rows by t."""
    series = {}
    for r in rows:
        series.setdefault((r["card"], r["placement"]), {})[r["t"]] = r
    degrees = sorted({r["t"] for r in rows})
    for card in {c for c, _ in series}:
        inside, across = series[(card, "8-GPU nodes")], series[(card, "2-GPU nodes (what-if)")]
        claims.check_inside_node_small_tax(inside, across)
        for by_t in (inside, across):
            claims.check_why_tp_stays_inside_node(by_t)
    state = {t: weight_state_gb(t) for t in degrees}
    card_gb = min(card.memory_bytes for card, _, _ in CARDS.values()) / 1e9     # both cards: 80 GB
    claims.check_t1_does_not_fit(state, card_gb)
    model = gpt3_shaped()
    params = 12 * model.hidden ** 2                      # one layer's weight matrices, as weight_state_gb counts
    claims.check_weight_state_product(state[1], model.layers, params)
    print(f"Weights, gradients and Adam state at t = 1: {model.layers} layers × {params / 1e9:.1f} B parameters × 16 B "
          f"= {state[1]:.0f} GB, over an {card_gb:.0f} GB card (t = 1 shaded); {state[2]:.0f} GB at t = 2")
    draw_tp_throughput(rows)
    plt.show()
    h100 = series[("H100 (NVLink 4, IB NDR)", "8-GPU nodes")]
    keep = {t: h100[t]["tokens_per_gpu"] / h100[2]["tokens_per_gpu"] for t in h100}   # t = 2: the smallest that fits
    print(f"H100, 8-GPU nodes: TP's all-reduces take {h100[8]['tp_share']:.0%} of the step at t = 8 (inside one node), "
          f"{h100[16]['tp_share']:.0%} at t = 16 (across two); on 2-GPU nodes (what-if) t = 8 crosses nodes: "
          f"{series[('H100 (NVLink 4, IB NDR)', '2-GPU nodes (what-if)')][8]['tp_share']:.0%}")
    print(f"H100, 8-GPU nodes: t = 8 keeps {keep[8]:.0%} of t = 2's tokens/s per GPU (t = 2: the smallest t that "
          f"fits an 80 GB card), a step {h100[2]['step'] / h100[8]['step']:.1f}× shorter; t = 16 across two nodes "
          f"keeps {keep[16]:.0%}")
    claims.check_planner_numbers_quoted(h100, keep)
    claims.check_crossing_costs_with_narrow_matmuls(narrow_matmuls(0.6))   # holds with slower narrow matmuls too
    return h100


def tiny_gpt_replays(degrees=(1, 2, 4, 8)) -> dict:
    """The tiny GPT (2 blocks, h = 64, 16 heads, b = 4, s = 16, SGD — Adam's first steps would magnify float32
    rounding into the weights) trained at each t here, compared with one device, one step replayed inside one
    H100 node and across two (:func:`.timing.tp_table`)."""
    recipe = gpt_recipe(steps=6, batch_size=4, seq_len=16, n_layer=2, n_embd=64, n_head=16, vocab_size=64,
                        optimizer="sgd")
    reference = train_reference(recipe)
    tables, equal = {}, {}
    for t in degrees:
        run = tp_runs(recipe, t)      # one launch: a timed run of 6 steps, then a counted run of the first 2
        equal[t] = [compare(reference, run.results), compare(train_reference(run.counted_recipe), run.counted_results)]
        tables[t] = tp_table(one_step(run.timed), one_step(run.counted), t)
    return {"tables": tables, "equal": equal}


def show_replays(replays: dict) -> None:
    tables, equal = replays["tables"], replays["equal"]
    us = lambda s: s * 1e6  # noqa: E731
    print("equal to one device (losses and parameters, float32 tolerance), timed and counted runs: "
          + ", ".join(f"t = {t}: max |Δ| {max(c.max_abs_diff for c in cs):.1e}" for t, cs in equal.items()))
    claims.check_every_run_trains_as_one_device(equal)
    inside = {t: tab["inside"] for t, tab in tables.items() if tab["inside"]}
    gemm, floor = ({t: row["terms"][k] for t, row in inside.items()} for k in ("gemm", "floor"))
    compute = {t: row["compute"] for t, row in inside.items()}
    flops = {t: row["terms"]["gemm_flops"] for t, row in inside.items()}
    claims.check_matmuls_flops_fall_as_1_t(flops, inside, gemm, floor, compute)
    for t in (t for t in tables if t > 1):
        claims.check_across_nodes_more_than_twice_inside(tables, t)
    top = max(inside)
    at_hbm = {t: row["terms"]["gemm_bytes"] for t, row in inside.items()}
    claims.check_matmuls_memory_bound(gemm, at_hbm, flops, top)
    print(f"A layer this small gains nothing from TP: from t = 1 to t = {top} the busiest rank's compute saves "
          f"{us(compute[1] - compute[top]):.1f} µs and the all-reduces add far more (model, µs, one H100 node; "
          f"last column: the same all-reduces across two nodes, t/2 ranks in each):")
    print(f"  {'t':>2} | {'compute':>8} | {'all-reduces':>11} | {'step':>7} | {'all-reduces, two nodes':>22}")
    for t, row in inside.items():
        across = tables[t]["across"]
        two_nodes = f"{us(across['comm']):.0f}" if across else "—"
        print(f"  {t:>2} | {us(row['compute']):>8.1f} | {us(row['comm']):>11.0f} | {us(row['step']):>7.0f} "
              f"| {two_nodes:>22}")
    print(f"Why compute barely shrinks: {floor[1] / compute[1]:.1%} of it is kernel launch floors "
          f"({inside[1]['terms']['kernels']:.0f} kernels × {H100_SXM.launch_floor * 1e6:.0f} µs at every t), and the "
          f"matmuls are memory-bound: their FLOPs fall {flops[1] / flops[top]:.0f}-fold, their time "
          f"{gemm[1] / gemm[top]:.1f}-fold.")


def show_pytorch(per_rank: list) -> None:
    for rank, (dy, dw, kind) in enumerate(per_rank):
        print(f"rank {rank}: PyTorch's weights are {kind}s; max |Δy| {dy:.1e}, max |ΔdW| {dw:.1e}")
        claims.check_pytorchs_own_tp_api_side(dy, dw)
