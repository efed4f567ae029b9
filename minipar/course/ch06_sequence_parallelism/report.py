"""Chapter 06's runs and displays: each ``show_*`` prints (or draws) what one cell ran and holds it to the
chapter's claims (:mod:`.claims`), printing nothing more when they hold — so a cell reads ``r = run(...)``,
``show(r)``."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from minipar.check import gpt_recipe
from minipar.launcher import launch
from minipar.mesh import Mesh
from minipar.models import GPTConfig
from minipar.tensor import gpt, layers, sequence
from minipar.tensor.gpt import compare_to_one_device
from minipar.tensor.sequence import korthikanti_bytes, sp_bytes_per_layer, tp_bytes_per_layer

from . import claims
from .figures import draw_backward_overlap, draw_sp_layer, layer_costs, plot_layer_memory

__all__ = ["show_gpt3_layer", "show_fused_attention_memory", "draw_sp_layer", "layer_memory", "show_layer_memory",
           "three_ways", "show_three_ways",
           "draw_backward_overlap", "train_forgetting_the_sum", "show_forgotten_sum", "dropout_masks",
           "show_dropout_masks", "against_one_device", "show_against_one_device", "mine_vs_pytorch_sp",
           "show_pytorch_sp", "B", "S", "H", "A"]

B, S, H, A = 4, 16, 32, 4          # the measured layer: batch, sequence, hidden, heads (float32, no dropout)
WAYS = {"TP": (False, False), "TP+SP": (True, False), "TP+SP, inputs kept": (True, True)}


def show_gpt3_layer(s=2048, b=1, h=12288, a=96, with_sp=False, n_layer=96) -> None:
    """One GPT-3 layer, one sequence, the paper's 16-bit bytes at t = 2, 4 and 8: under TP, with the 10·sbh it
    leaves whole on every rank, and what splitting it frees at t = 8 over ``n_layer`` layers (§1);
    ``with_sp``: TP beside TP+SP, and the s² attention term's share of what is left (§3)."""
    whole = 10 * s * b * h
    scores = 5 * a * s * s * b / 8                      # 5as²b/t, the softmax, its dropout mask and output
    share = scores / korthikanti_bytes(s, b, h, a, 8, sequence_parallel=True)
    if with_sp:                                         # the cause first, then its effect on the longest s
        print(f"under TP+SP the s² attention term 5as²b/t is {share:.0%} of what a layer keeps, at every t")
    for t in (2, 4, 8):
        tp, tp_sp = korthikanti_bytes(s, b, h, a, t), korthikanti_bytes(s, b, h, a, t, sequence_parallel=True)
        if with_sp:
            print(f"t={t}: TP {tp / 2**30:5.2f} GiB per layer, TP+SP {tp_sp / 2**30:5.2f} GiB")
        else:
            print(f"t={t}: TP {tp / 2**30:5.2f} GiB per layer, of which 10·sbh = {whole / 2**30:.2f} GiB "
                  f"({whole / tp:.0%}) whole on every rank")
    freed = korthikanti_bytes(s, b, h, a, 8) - korthikanti_bytes(s, b, h, a, 8, sequence_parallel=True)
    if not with_sp:
        print(f"if that part were split t ways too (§2 shows how), at t=8 it would free {freed / 2**30:.2f} GiB per "
              f"layer, {n_layer * freed / 2**30:.1f} GiB over {n_layer} layers, per sequence")
    # the element count gives the paper's formula; with SP everything is divided by t
    claims.check_what_tensor_parallelism_leaves_whole(s, b, h, a)
    claims.check_sp_frees(freed, whole, n_layer)
    claims.check_scores_term_outgrows_what_sp_frees(scores, freed, s, b, h)
    if with_sp:
        claims.check_sp_divides_everything_by_t(s, b, h, a)
        claims.check_scores_dominate_after_sp(share, s, b, h, a)


def show_fused_attention_memory(s=2048, b=1, h=12288, a=96, t=8) -> None:
    """§3's GPT-3 layer with fused attention: no s² term, one float32 log-sum-exp per score row (4asb/t bytes),
    so a layer keeps sbh(10 + 24/t) + 4asb/t under TP and sbh·34/t + 4asb/t under TP+SP, both linear in s; and
    the longest sequence TP+SP fits in TP's memory, unfused (s² term kept) and fused."""
    fused = [s * b * h * whole_split + 4 * a * s * b / t for whole_split in (10 + 24 / t, 34 / t)]
    longest = longest_sequence_in(korthikanti_bytes(s, b, h, a, t), b, h, a, t=t, step=t)
    unrounded = longest_sequence_in(korthikanti_bytes(s, b, h, a, t), b, h, a, t=t, step=1)
    print(f"fused attention, t={t}: TP {fused[0] / 2**30:.2f} GiB, TP+SP {fused[1] / 2**30:.2f} GiB per layer")
    print(f"in the memory TP needs at s = {s:,}, t = {t}, TP+SP fits a sequence")
    print(f"  unfused attention (s² term kept)   {longest / s:.2f}× longer (s = {longest:,})¹")
    print(f"  fused attention (linear in s)      {fused[0] / fused[1]:.2f}× longer")
    print(f"¹ {unrounded:,}, rounded down to a multiple of t = {t}")
    claims.check_sp_lengthens_sequence_by_about_a_third(longest, s)
    claims.check_fused_attention_about_three_times(fused[0] / fused[1])


def longest_sequence_in(budget, b, h, a, t, step=8) -> int:
    """The longest s (a multiple of ``step``) whose TP+SP layer keeps at most ``budget`` bytes (Korthikanti's
    count, 16-bit values)."""
    s = step
    while korthikanti_bytes(s + step, b, h, a, t, sequence_parallel=True) <= budget:
        s += step
    return s


def layer_memory(degrees=(2, 4)) -> list:
    """Activation bytes one layer keeps on rank 0, TP and TP+SP, measured and by the formula."""
    return layer_costs(B, S, H, A, degrees=degrees)


def show_layer_memory(rows) -> None:
    print(f"{'one layer':10} {'measured':>9} {'formula':>9}   (activation bytes per rank)")
    for r in rows:
        print(f"t={r['t']} {'TP+SP' if r['sp'] else 'TP':5}  {r['activation_bytes']:>9} {r['formula_bytes']:>9.0f}")
    plot_layer_memory(rows)
    plt.show()
    claims.check_activations_measured(rows)


def three_ways(t: int = 4) -> dict:
    """One layer on ``t`` ranks, three ways: {name: {"formula", "log", "wire", "calls", "activations"}} per
    rank (averaged over the ranks): the formula's bytes, the communication log's, the bytes written to the
    sockets (with gloo's message headers), the calls logged and the activation bytes kept. SP's reduce-scatters
    run on minipar's send/recv ring (gloo has none)."""
    from minipar.course.tp_layer import measure_layer_on_wire
    cfg = GPTConfig(n_embd=H, n_head=A)
    formula = {"TP": tp_bytes_per_layer(S, B, H, t), "TP+SP": sp_bytes_per_layer(S, B, H, t),
               "TP+SP, inputs kept": tp_bytes_per_layer(S, B, H, t)}
    out = {}
    for name, (sp, keep) in WAYS.items():
        per_rank = launch(measure_layer_on_wire, t, cfg, sp, keep, B, S, rings=True, quiet=True)
        log, wire, calls, act = (sum(r[i] for r in per_rank) / t for i in range(4))
        out[name] = {"formula": formula[name], "log": log, "wire": wire, "calls": calls, "activations": act}
    return out


def regather_bytes(t: int = 4) -> float:
    """The two column-parallel inputs (QKV, fc) gathered again in backward: 2 · (t−1)/t · sbh (float32)."""
    return 2 * (t - 1) / t * B * S * H * 4


def show_three_ways(ways: dict, t: int = 4) -> None:
    print(f"{f'one layer, t={t}, per rank':27}{'sent, formula':>15}{'sent, logged':>14}{'kept':>11}")
    for name, w in ways.items():
        print(f"{name:27}{w['formula'] / 1024:>11.1f} KiB{w['log'] / 1024:>10.1f} KiB"
              f"{w['activations'] / 1024:>7.1f} KiB")
    claims.check_three_ways(ways, regather_bytes(t))


def train_forgetting_the_sum(world_size: int = 2):
    """The tiny GPT under TP + SP on ``world_size`` ranks with the all-reduce of the sequence-parallel
    gradients left out, compared with one device (3 Adam steps, float64)."""
    recipe = gpt_recipe(steps=3, batch_size=4, seq_len=16, vocab_size=66)
    recipe.dtype = torch.float64

    class ForgetsTheSum(gpt.TensorParallelGPT):
        def finish_backward(self):
            pass                                   # the mistake: no all-reduce of the sequence-parallel gradients

    original = gpt.TensorParallelGPT
    gpt.TensorParallelGPT = ForgetsTheSum
    try:
        return compare_to_one_device(recipe, world_size=world_size, sequence_parallel=True,
                                     launch_kwargs={"quiet": True})
    finally:
        gpt.TensorParallelGPT = original


def show_forgotten_sum(wrong) -> None:
    print(f"without the sum, after 3 steps: {wrong.worst} differs from one device by {wrong.max_abs_diff:.2g}; "
          f"a correct run differs by float64 rounding only (§6)")
    claims.check_layernorm_gradients_now_partial(wrong)


def _replicated_spread(group, seeded_by_rank: bool) -> float:
    """The tiny GPT with dropout 0.1 under TP, 2 Adam steps: the largest difference between the TP ranks'
    copies of the replicated parameters (position embedding, LayerNorms), with the replicated stream seeded by
    Megatron's rule or (``seeded_by_rank``, the mistake) by rank."""
    from minipar.debug.seeds import replica_spread
    recipe = gpt_recipe(steps=2, batch_size=8, seq_len=16, n_layer=2, n_embd=32, n_head=4, dropout=0.1)
    model = gpt.TensorParallelGPT(recipe.model().to(recipe.dtype), group)
    if seeded_by_rank:
        model.streams.replicated.manual_seed(1000 + torch.distributed.get_rank())
    opt = recipe.optimizer(model.parameters())
    for inputs, targets in recipe.batches:
        opt.zero_grad(set_to_none=True)
        model.loss(inputs, targets).backward()
        model.finish_backward()
        opt.step()
    replicated = {n: p for n, p in model.named_parameters() if n.startswith(("ln_f", "blocks.0.ln1", "pos_emb"))}
    return max(replica_spread(replicated, group).values())


def _masks(rank, world_size):
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    streams = layers.DropoutStreams(seed=0, group=group)
    x = torch.ones(1, 12)
    shard = torch.ones(1, 256, 32)                  # this rank's sequence shard of the residual stream (SP)
    return (layers.dropout(x, 0.5, streams.replicated, True).bool().int().tolist()[0],
            layers.dropout(x, 0.5, streams.per_rank, True).bool().int().tolist()[0],
            _replicated_spread(group, seeded_by_rank=False), _replicated_spread(group, seeded_by_rank=True),
            layers.dropout(shard, 0.1, streams.per_rank, True).bool(),
            layers.dropout(shard, 0.1, streams.replicated, True).bool())


def dropout_masks(world_size: int = 2) -> list:
    """[(replicated-stream mask, per-rank-stream mask, spread by the rule, spread seeded by rank, SP shard mask
    per rank, SP shard mask one seed)] per rank: 12 dropout decisions (p = 0.5) per stream; how far the
    replicated parameters' copies drift apart in 2 steps of the tiny GPT under plain TP (dropout 0.1) by
    Megatron's rule and with the replicated stream seeded by rank; and the residual-dropout mask (p = 0.1) of
    each rank's sequence shard (256 tokens × 32 features) drawn from the per-rank stream and from one seed."""
    return launch(_masks, world_size, quiet=True)


def show_dropout_masks(per_rank) -> None:
    """The two streams' masks on 2 ranks, and how often two sequence shards' residual-dropout masks agree."""
    (rep0, own0, _, _, sp0, one0), (rep1, own1, _, _, sp1, one1) = per_rank
    print("12 dropout decisions, p = 0.5 (1 = kept, 0 = dropped)")
    print(f"replicated stream, rank 0: {rep0}\n                   rank 1: {rep1}")
    print(f"per-rank stream,   rank 0: {own0}\n                   rank 1: {own1}")
    by_rank, one_seed = (sp0 == sp1).float().mean().item(), (one0 == one1).float().mean().item()
    print("\nTP+SP, residual dropout p = 0.1 on two sequence shards: share of positions where the masks agree")
    print(f"  per-rank stream          {by_rank:.2f}   (independent masks: 0.9² + 0.1² = 0.82)\n"
          f"  one seed                 {one_seed:.2f}")
    claims.check_dropout_masks_that_agree_masks(rep0, rep1, own0, own1)
    claims.check_sequence_shards_draw_their_own_masks(by_rank, one_seed)


def show_replica_drift(per_rank) -> None:
    """Plain TP, 2 steps: how far ranks 0 and 1's copies of the replicated parameters drift apart."""
    (_, _, right, wrong, _, _), _ = per_rank
    print("plain TP, 2 steps: ranks 0 and 1's copies of the replicated parameters (position embedding, LayerNorms)")
    print(f"replicated stream seeded   max |Δ|\n  by the rule              {right:.1e}\n  by rank                  {wrong:.1e}")
    claims.check_replicas_drift_seeded_by_rank(right, wrong)


def against_one_device(degrees=(2, 4)) -> dict:
    """{t: comparison with one device} (3 Adam steps, float64, vocabulary 66, label smoothing 0.1), and under
    "refused" the ValueError a sequence length 4 does not divide raises before any process starts."""
    recipe = gpt_recipe(steps=3, batch_size=4, seq_len=16, vocab_size=66)
    recipe.dtype = torch.float64
    out = {t: compare_to_one_device(recipe, world_size=t, sequence_parallel=True, label_smoothing=0.1,
                                    launch_kwargs={"quiet": True}) for t in degrees}
    try:
        compare_to_one_device(gpt_recipe(steps=1, seq_len=15), world_size=4, sequence_parallel=True)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = e
    return out


def show_against_one_device(results) -> None:
    compared = {t: c for t, c in results.items() if t != "refused"}
    for t, comparison in compared.items():           # (minipar's tests check t = 1, 2, 4)
        print(f"TP+SP, t={t}: = one device, to rounding (max |Δ| {comparison.max_abs_diff:.0e})¹")
    print("s = 15 on 4 ranks — ValueError before any process started:", results["refused"])
    tolerance = next(iter(compared.values()))
    print(f"¹ float64; every value within |Δ| ≤ {tolerance.atol:g} + {tolerance.rtol:g}·|ref|")
    for t, comparison in results.items():
        if t != "refused":
            comparison.assert_ok()
    claims.check_whole_gpt_with_tp_sp(results["refused"])


def mine_vs_pytorch_sp(rank, world_size):
    """One MLP (32 → 128 → 32) on a sequence shard, minipar's TP + SP against PyTorch's plan; returns
    (output shard shape, max |Δy|, max |Δ bias grad|, the placement of PyTorch's bias gradient): minipar's
    bias gradient summed by hand, against the local tensor of PyTorch's (summed in its backward)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from minipar.models import MLP
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    ref, theirs = MLP((32, 128, 32), seed=0), MLP((32, 128, 32), seed=0)
    mine = layers.TensorParallelMLP(ref.layers[0], ref.layers[1], group, sequence_parallel=True)
    parallelize_module(theirs, DeviceMesh.from_group(group, "cpu"),
                       {"layers.0": ColwiseParallel(input_layouts=Shard(1)),
                        "layers.1": RowwiseParallel(output_layouts=Shard(1))})
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).chunk(world_size, dim=1)[rank].clone()
    y_mine, y_theirs = mine(x), theirs(x)
    y_mine.pow(2).sum().backward()
    y_theirs.pow(2).sum().backward()
    sequence.sync_sequence_parallel_grads([mine.proj.bias], group)      # minipar sums by hand ...
    their_bias = theirs.layers[1].bias.grad                             # ... DTensor in backward: already Replicate
    return (tuple(y_mine.shape), float((y_mine - y_theirs).abs().max()),
            float((mine.proj.bias.grad - their_bias.to_local()).abs().max()), type(their_bias.placements[0]).__name__)


def show_pytorch_sp(per_rank) -> None:
    shape, _, _, placement = per_rank[0]
    print(f"{len(per_rank)} ranks, output shard {shape} each; over the ranks, max |Δy| "
          f"{max(r[1] for r in per_rank):.1e}, max |Δ bias grad| {max(r[2] for r in per_rank):.1e}\n"
          f"PyTorch's bias gradient: {placement} (its local tensor, already summed)")
    for shape, dy, db, placement in per_rank:
        claims.check_pytorchs_sequence_parallelism_side_by(shape, dy, db, placement)
