"""Bytes sent per device per step, and their α-β seconds, term by term: the communication half of
:func:`minipar.plan.estimate` (no overlap here; :mod:`.overlap` says what of it a program hides).

Per layer and micro-batch unless said otherwise (b micro-batch, s sequence, h hidden, t tp, e bytes/value):

* **tp** — 4 all-reduces of b·s·h (Megatron's f and g, forward and backward); SP: 4 all-gathers + 4
  reduce-scatters, same volume, plus this course's 2 re-gathers in backward (chapter 06);
* **cp** — the method's own formula on (b, s, h/t) (:func:`minipar.hybrid.context.cp_bytes`, chapter 06b):
  ring attention K, V passed cp−1 times forward, K, V and dK, dV 2cp−1 times backward, one (b·s/cp·h/t·2e)
  message per pass (K and V kv/a of h wide with grouped-query attention); Ulysses 4 all-to-alls of
  b·(s/cp)·h/t forward and 4 backward; RSA K, V cp−1 times
  forward and 2(cp−1) backward; full recomputation runs the forward's twice;
* **ep** — per MoE layer the dispatch and combine all-to-alls, forward and backward:
  2 directions × :func:`minipar.moe.expert_parallel.predicted_all_to_all_bytes` (its ``wire``: the padded
  (E, C, h) buffers' (ep−1)/ep that leave the rank; ≈ 2·2·k·cf·T·h·e·(ep−1)/ep), T = b·s/cp tokens;
* **pp** — each micro-batch's activation forward and its gradient back at every stage boundary (mean over the
  pipeline's ranks 2(pv−1)·m·A/p); time: 2v·m sends of A per rank;
* **dp** — the ZeRO paper's volumes (:func:`minipar.data.zero_memory.bytes_sent_per_step`) over the dp·cp
  ranks that hold the same dense parameters; ZeRO-2/3 repeat their reduce-scatter (ZeRO-3 its gathers) per
  micro-batch, in layers + 1 units; an MoE model's expert parameters over the expert-data-parallel ranks
  (dp·cp/ep) instead.
"""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

from minipar.data import zero_memory
from minipar.hybrid.context import cp_bytes
from minipar.hybrid.experts import expert_groups
from minipar.mesh import Mesh, crosses_nodes
from minipar.moe.expert_parallel import predicted_all_to_all_bytes
from minipar.tensor.sequence import sp_bytes_per_layer, tp_bytes_per_layer

from minipar.machine.cluster import collective_seconds, link
from .model import MoETransformer, stage_layers

__all__ = ["traffic", "data_parallel_traffic", "dim_link"]


@functools.lru_cache(maxsize=4096)
def _groups(sizes: tuple, ep: int, dim: str) -> tuple:
    """Every ``dim`` group of the dense mesh of ``sizes`` ((dim, degree) pairs, outermost first); for "ep",
    the expert groups, folded into the dp × cp groups (:func:`minipar.hybrid.experts.expert_groups`)."""
    mesh = Mesh(math.prod(n for _, n in sizes), **dict(sizes))
    if dim == "ep":
        return tuple(tuple(g) for ep_groups, _ in expert_groups(mesh, ep) for g in ep_groups)
    return tuple(tuple(g) for g in mesh.groups(dim))


@functools.lru_cache(maxsize=4096)
def _deciding_group(sizes: tuple, ep: int, dim: str, devices_per_node) -> tuple:
    """One ``dim`` group that decides the link: the first that spans nodes, else the first (all stay in a
    node). The planner asks this for thousands of layouts that share a few meshes: walking every group of
    a 1024-rank mesh each time was most of its run time."""
    groups = _groups(sizes, ep, dim)
    return next((g for g in groups if crosses_nodes(g, devices_per_node)), groups[0] if groups else ())


def dim_link(layout, dim: str, cluster) -> tuple:
    """(bandwidth, latency) of the slowest link a ``dim`` group of ``layout`` runs over
    (:func:`minipar.machine.cluster.link`), its ranks placed by the layout's dense mesh (``layout.sizes``: ep
    is folded into dp × cp and adds no ranks, so it stretches no other dimension's group)."""
    return link(cluster, _deciding_group(tuple(layout.sizes.items()), layout.ep, dim, cluster.devices_per_node))


def traffic(model, cluster, layout, prec, psi, bucket_bytes, *, experts: float) -> tuple:
    """({tp, cp, pp, dp[, ep]: bytes sent per device per step}, {the same: α-β seconds}, the dp term's parts
    for :mod:`.overlap`: {"reduce", "gather": seconds, "buckets", "units"}). ``psi``: the device's
    parameters, ``experts`` of them expert parameters (:func:`~.cost.stage_parameters`)."""
    vb, t, p, m, cp, sp = prec.param, layout.tp, layout.pp, layout.micro_batches, layout.cp, layout.sp
    b, h, s = layout.micro_batch, model.hidden, model.seq_len // cp
    layers = stage_layers(model.layers, p, layout.v)[1]               # the fullest stage's
    again = 1.5 if layout.recompute == "full" else 1.0                # full: the forward's again
    sent, seconds = {}, {}

    bw, lat = dim_link(layout, "tp", cluster)
    payload = s * b * h * vb
    sent["tp"] = (sp_bytes_per_layer if sp else tp_bytes_per_layer)(s, b, h, t, value_bytes=vb) * again * layers * m
    if sp:        # per layer: 4 all-gathers + 4 reduce-scatters, and the 2 re-gathers of the backward
        per = 6 * collective_seconds("all_gather", payload, t, bw, lat) + 4 * collective_seconds(
            "reduce_scatter", payload, t, bw, lat)
    else:         # per layer: g forward and f backward, in attention and in the MLP
        per = 4 * collective_seconds("all_reduce", payload, t, bw, lat)
    seconds["tp"] = per * again * layers * m if t > 1 else 0.0

    sent["cp"], seconds["cp"] = _context_parallel(model, cluster, layout, vb, layers)
    if isinstance(model, MoETransformer):
        sent["ep"], seconds["ep"] = _expert_parallel(model, cluster, layout, vb, layers)

    act = s * b * h * vb / (t if sp else 1)                          # one micro-batch at a stage boundary
    bw, lat = dim_link(layout, "pp", cluster)
    sent["pp"] = 2 * (p * layout.v - 1) * m * act / p if p > 1 else 0.0
    seconds["pp"] = 2 * layout.v * m * collective_seconds("send", act, 2, bw, lat) if p > 1 else 0.0

    bw, lat = min(dim_link(layout, "dp", cluster), dim_link(layout, "cp", cluster))    # the slower of the links
    sent["dp"], seconds["dp"], parts = data_parallel_traffic(psi - experts, layout.dp * cp, layout.zero, m,
                                                             layers + 1, prec, bw, lat, bucket_bytes)
    if experts:                   # expert gradients: over the ranks holding the same experts, dp·cp/ep
        more = data_parallel_traffic(experts, layout.expert_data_parallel, layout.zero, m, layers + 1, prec,
                                     bw, lat, bucket_bytes)
        sent["dp"], seconds["dp"] = sent["dp"] + more[0], seconds["dp"] + more[1]
        parts = {k: parts[k] + more[2][k] if k in ("reduce", "gather") else max(parts[k], more[2][k])
                 for k in parts}
    return sent, seconds, parts


def data_parallel_traffic(psi, ranks, zero, m, units, prec, bw, lat, bucket_bytes) -> tuple:
    """(bytes sent, seconds, {"reduce": the gradients' reduction seconds, "gather": the parameters' gathers,
    "buckets": DDP/ZeRO-1 buckets, "units": ZeRO-2/3 units}) of ``psi`` parameters averaged over ``ranks``.
    Stage ≤ 1: one all-reduce (or reduce-scatter + all-gather) per step in buckets of ``bucket_bytes``;
    stage 2: a reduce-scatter per unit per micro-batch, one all-gather after the step; stage 3: per unit and
    micro-batch two all-gathers (forward, backward) and a reduce-scatter."""
    buckets = max(1, math.ceil(psi * prec.grad / bucket_bytes))
    parts = {"reduce": 0.0, "gather": 0.0, "buckets": buckets, "units": units}
    if ranks == 1:
        return 0.0, 0.0, parts
    ring = (ranks - 1) / ranks
    if zero <= 1:
        sent = zero_memory.bytes_sent_per_step(psi, ranks, zero, prec)
        seconds = buckets * 2 * (ranks - 1) * lat + sent / bw
        gather = 0.0 if zero == 0 else ring * psi * prec.param / bw + buckets * (ranks - 1) * lat
        parts.update(reduce=seconds - gather, gather=gather)
        return sent, seconds, parts
    gathers = 1 if zero == 2 else 2 * m
    reduce = m * units * (ranks - 1) * lat + ring * psi * m * prec.grad / bw
    gather = gathers * units * (ranks - 1) * lat + ring * psi * gathers * prec.param / bw
    parts.update(reduce=reduce, gather=gather)
    return ring * psi * (m * prec.grad + gathers * prec.param), reduce + gather, parts


def _context_parallel(model, cluster, layout, vb, layers) -> tuple:
    """The cp method's bytes (chapter 06b's formulas, through :func:`minipar.hybrid.context.cp_bytes`) and
    seconds: ring methods one send of this rank's K and V (2·b·(s/cp)·(h/t)·e, h·kv/a with grouped-query
    attention) per pass, Ulysses
    all-to-alls of b·(s/cp)·(h/t)·e (8 per layer and micro-batch, 12 with full recomputation)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    b, seq = layout.micro_batch, model.seq_len
    # a ring passes K and V only: with grouped-query attention they are kv/a of h wide (Ainslie et al. 2023)
    width = model.hidden if layout.cp_method == "ulysses" else model.hidden * (model.kv_heads or model.heads) \
        // model.heads
    sent = cp_bytes(SimpleNamespace(n_embd=width), layout, micro_batch=b, seq=seq, blocks=layers, element_size=vb)
    block = b * (seq // cp) * width / layout.tp * vb
    bw, lat = dim_link(layout, "cp", cluster)
    if layout.cp_method == "ulysses":
        calls = (12 if layout.recompute == "full" else 8) * layers * layout.micro_batches
        return sent, calls * collective_seconds("all_to_all", block, cp, bw, lat)
    return sent, sent / (2 * block) * collective_seconds("send", 2 * block, 2, bw, lat)


def _expert_parallel(model, cluster, layout, vb, layers) -> tuple:
    """Dispatch and combine all-to-alls of every MoE layer, forward and backward (chapter 09's formula)."""
    ep = layout.ep
    if ep == 1:
        return 0.0, 0.0
    # the tp ranks of a stage route different rows (ep folded over dp × cp × tp): each holds 1/t of them
    tokens = layout.micro_batch * model.seq_len // layout.cp / layout.tp
    one = predicted_all_to_all_bytes(tokens, model.hidden, model, ep, element_size=vb)   # per direction
    moe_layers = layers * model.moe_share * layout.micro_batches
    again = 1.5 if layout.recompute == "full" else 1.0               # the forward's two exchanges again
    bw, lat = dim_link(layout, "ep", cluster)
    sent = 2 * one["wire"] * moe_layers * again
    calls = 4 * moe_layers * again                                   # each an (E, C, h) buffer
    return sent, calls * collective_seconds("all_to_all", one["buffer"] / 2, ep, bw, lat)
