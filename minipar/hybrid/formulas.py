"""What a 3D step sends, from the shapes alone: the formulas the measured bytes of
:mod:`minipar.hybrid.parallel3d` are checked against (ring collectives, Megatron's f/g, SP's re-gathers)."""
from __future__ import annotations

import math

from ..layout import Layout
from ..moe.layer import moe_blocks
from ..pipeline.actions import placement_of, stages_of
from .context import cp_bytes
from ..moe.router import capacity

__all__ = ["bytes_formula", "ring_dp", "expert_bytes", "expert_params"]


def bytes_formula(cfg, *, batch: int, seq: int, layout: Layout | None = None, pp_rank: int = 0,
                  element_size: int = 8, m: int | None = None, moe=None, **dims) -> dict:
    """{"dp", "pp", "tp"} (+ "cp" when cp > 1): the bytes rank ``pp_rank`` of a pipeline sends per step, from
    the shapes alone.
    ``layout``: a :class:`~minipar.layout.Layout`, or its fields as keywords (``dp=2, pp=2, tp=2, m=4``;
    ``m`` is ``micro_batches``).
    With SP every TP all-reduce becomes an all-gather + reduce-scatter ((t-1)/t·S each) and the column-parallel
    layers re-gather their input in backward: per block 4 reduce-scatters + 6 all-gathers, the embedding 1 + 1,
    the head 1 + 2; the activations between stages are sequence shards; the LayerNorm / row-bias / position
    gradients are summed over tp once per step. Full recomputation re-runs each block's forward collectives
    (and, with SP, the head's all-gather; measured: the embedding and the loss are not re-run). With context parallelism every activation holds s/cp tokens, the
    gradients are averaged over dp × cp, and the cp group carries :func:`minipar.hybrid.context.cp_bytes`.
    ``moe`` (a :class:`minipar.moe.layer.MoEConfig`): every ``moe.every``-th block's FFN is an MoE layer on
    1/t of the rows per tp rank (its block has attention's f and g, and the rows' two all-gathers over tp), its
    router in the dense Ψ, its experts reduced over expert-DP; adds "ep", "edp", "balance"
    (:func:`expert_bytes`)."""
    layout = Layout.of(layout, **dims, **({} if m is None else {"micro_batches": m}))
    dp, pp, tp, m, v, zero, sp, cp = (getattr(layout, k) for k in (
        "dp", "pp", "tp", "micro_batches", "v", "zero", "sp", "cp"))
    b, h, mb, n_stages, full_seq, seq = element_size, cfg.n_embd, batch // (dp * m), pp * v, seq, seq // cp
    mine = stages_of(pp_rank, pp, v, placement_of(layout.schedule))    # the schedules' one placement
    per_stage = cfg.n_layer // n_stages
    first, last = sum(s == 0 for s in mine), sum(s == n_stages - 1 for s in mine)
    ring, half = 2 * (tp - 1) / tp, (tp - 1) / tp
    act, loss = mb * seq * h, 3 * mb * seq * last                           # one micro-batch's boundary tensor
    blocks = per_stage * len(mine)
    with_moe = set(moe_blocks(cfg.n_layer, moe.every)) if moe is not None else set()
    is_moe = [b in with_moe for b in range(cfg.n_layer)]
    moe_in = [sum(is_moe[s * per_stage:(s + 1) * per_stage]) for s in range(n_stages)]   # MoE layers per stage
    moe_layers = sum(moe_in[s] for s in mine)
    if sp:
        sp_params = blocks * 6 * h + first * cfg.block_size * h + last * 2 * h
        tp_bytes = b * m * (half * (10 * blocks + 2 * first + 3 * last) * act + ring * loss) + ring * b * sp_params
    else:
        tp_bytes = ring * b * m * ((4 * blocks - 2 * moe_layers + first + last) * act + loss)  # f, g; emb g; head f
        tp_bytes += half * b * m * 2 * moe_layers * act      # MoE: rows split over tp, outputs/gradients re-gathered
        if moe is not None:                  # ... and each router's and shared expert's gradient summed over tp once
            tp_bytes += ring * b * moe_layers * (moe.experts * h + moe.shared * expert_params(cfg, moe))
    if layout.recompute == "full":       # the blocks' forward collectives again (SP: and the head's all-gather)
        tp_bytes += b * m * act * (half * (4 * blocks + last) if sp else ring * 2 * blocks)
    crossings = sum((s < n_stages - 1) + (s > 0) for s in mine)
    pp_bytes = b * m * act // (tp if sp else 1) * crossings
    vocab = math.ceil(cfg.vocab_size / tp) * tp
    per_block = (12 * h * h + 7 * h) // tp + 6 * h          # split weights/biases /t; LayerNorms, row biases whole
    per_moe_block = (4 * h * h + 3 * h) // tp + 5 * h      # attention, LNs; router and shared experts whole:
    per_moe_block += moe.experts * h + moe.shared * expert_params(cfg, moe) if moe else 0
    psi = [(per_stage - moe_in[s]) * per_block + moe_in[s] * per_moe_block
           + (s == 0) * (vocab * h // tp + cfg.block_size * h)
           + (s == n_stages - 1) * (vocab * h // tp + 2 * h) for s in mine]
    if zero:                                                 # ZeRO-1 pads each stage's flat buffer to d shards
        psi = [math.ceil(x / (dp * cp)) * dp * cp for x in psi]
    kinds = {"dp": ring_dp(dp * cp) * b * sum(psi), "pp": pp_bytes, "tp": tp_bytes}
    if cp > 1:
        kinds["cp"] = cp_bytes(cfg, layout, micro_batch=mb, seq=full_seq, blocks=blocks, element_size=b)
    if moe is not None:
        kinds |= expert_bytes(cfg, moe, layout, micro_batch=mb, seq=full_seq, moe_layers=moe_layers, element_size=b)
    return kinds


def ring_dp(n: int) -> float:
    """2(n-1)/n: an all-reduce (or a reduce-scatter + an all-gather) per byte of payload."""
    return 2 * (n - 1) / n


def expert_bytes(cfg, moe, layout, *, micro_batch: int, seq: int, moe_layers: int, element_size: int = 8) -> dict:
    """{"ep", "edp", "balance"}: bytes one rank sends per step (:mod:`minipar.hybrid.experts`' docstring),
    ``moe_layers`` its MoE layers. Dropless (``moe.dropless``): "ep" under uniform routing, per layer and
    micro-batch 4·(ep−1)/ep·k·T·h·b + (ep−1)/ep·E·8 (the split sizes, int64), T the rank's tokens; an uneven
    routing moves another amount (:func:`minipar.moe.dropless.predicted_exchange_bytes`)."""
    n, ep, edp = layout.dp * layout.cp * layout.tp, layout.ep, layout.expert_data_parallel
    b, m = element_size, layout.micro_batches
    tokens = micro_batch * seq // layout.cp // layout.tp
    rows = moe.k * tokens if moe.dropless else moe.experts * capacity(tokens, moe.experts, moe.capacity_factor, moe.k)
    counts = (ep - 1) / ep * moe.experts * 8 if moe.dropless else 0
    psi = moe_layers * moe.experts // ep * expert_params(cfg, moe)
    loss_free = 1 if moe.bias_rate > 0 else 0                # the bias's load: E counts once per step
    return {"ep": m * moe_layers * (4 * (ep - 1) / ep * rows * cfg.n_embd * b + counts),
            "edp": 2 * (edp - 1) / edp * b * psi,
            "balance": (m + loss_free) * moe_layers * 2 * (n - 1) / n * moe.experts * b}


def expert_params(cfg, moe) -> int:
    """One (routed or shared) expert FFN's parameters: 2·h·(ffn/m) weights, + biases."""
    hidden = cfg.ffn_hidden // moe.granularity
    return 2 * cfg.n_embd * hidden + (hidden + cfg.n_embd) * cfg.bias
