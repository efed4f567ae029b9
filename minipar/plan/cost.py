"""The cost model: memory per device and time per step of one layout, every term visible.

Memory of the busiest device (the first pipeline stage, or the last when the output layer weighs more)::

    model states   zero_memory.model_state_bytes_formula(Ψ_stage / t, dp, zero)    (ZeRO: 16Ψ, 4Ψ + 12Ψ/N, ...)
    activations    activation_bytes_per_layer × layers per stage × micro-batches in flight
                   (in flight: counted on the schedule itself — GPipe m, 1F1B p, interleaved p + (p-1)/v)
                   + the output layer's logits on the last stage
    buffers        ZeRO-3's gathered units (the embedding unit + the current and the prefetched layer);
                   ZeRO-2/3's reduce-scatter of one layer's gradients (a working copy and two ring chunks);
                   with recomputation, what the backward rematerializes for one layer at a time

Time of one step on one device (``overlap=False``, the default: no overlap of communication with compute,
an upper bound; ``overlap="minipar"`` or ``True``: the data-parallel term is what :mod:`.overlap` leaves
exposed — DDP's buckets under the backward, ZeRO-3's prefetched gathers under the previous unit's compute —
and ``Estimate.hidden`` the rest; ``"production"``: async TP, PP's p2p and CP's ring hidden too)::

    compute        on a cluster with a device card (:func:`minipar.machine.cluster.gpu_cluster`): the
                   operators of one micro-batch on the slowest stage (:mod:`.operators`: matmuls, attention,
                   memory-bound operators, kernel floors) priced on the card, × micro-batches; else (a CPU,
                   :func:`~minipar.machine.cluster.this_machine`) hardware FLOPs / (devices · FLOP/s measured)
    bubble         (compute + tp, cp, ep collectives) · f / (1 - f),  f = bubble_formula(schedule, p, m, v)
                   (chapter 04): an idle slot lasts a stage's whole work on a micro-batch, collectives included
    collectives    the α-β model of :mod:`minipar.machine.cluster`, on the links each group really crosses
                   (:mod:`.traffic`: tp, cp, ep, pp, dp), exposed seconds
    optimizer      parameters the device updates (its stage's share, ÷ dp with ZeRO): Adam's bytes on the
                   card (:func:`.operators.optimizer_step`), or × the cluster's seconds per parameter
                   (when it gives one: calibrated on a CPU)

or, FlexFlow's way, compute measured instead of counted: ``compute_seconds`` = the step run for real with
its communication cut (:func:`minipar.observe.wirecut.cut_wire`: every matmul, element-wise op and optimizer step
of this device's share, no transfer, no wait); the model then adds only the bubble and the collectives.

Bytes sent per device per step: :mod:`.traffic` (the same numbers the communication log shows, chapter by
chapter). CP ranks hold the same parameters: gradients are averaged, and ZeRO shards, over the dp·cp ranks
(Megatron's data-parallel group with CP); a cp rank keeps the activations of its s/cp tokens. Ring attention
keeps no score matrix for the backward (O and the log-sum-exp only): one (s/cp)² block at a time; nor does a
fused FlashAttention kernel (``kernels.attention == "flash"``: Dao 2023): it keeps what selective recomputation
keeps; Ulysses (whole sequence, a/cp heads) and RSA ((s/cp) × s rows) keep a·s²·b/cp scores. An :class:`MoETransformer`
with ep: E/ep experts per rank, their model states sharded (ZeRO) over the expert-data-parallel dp·cp/ep ranks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from minipar.data import zero_memory
from minipar.layout import Layout
from minipar.pipeline.schedules import make_schedule, validate as validate_schedule
from minipar.recompute import MODES
from minipar.sequence.context_parallel import METHODS as CP_METHODS
from minipar.tensor.sequence import uncounted_bytes

from minipar.machine.cluster import Cluster, collective_seconds
from minipar.machine.device import ops_seconds
from .model import (MoETransformer, Transformer, activation_bytes_per_layer, expert_parameters, forward_flops,
                    hardware_flops, layer_parameters, model_flops, stage_layers)
from .operators import MEGATRON_2022, optimizer_step, stage_seconds
from .overlap import OVERLAPS, data_parallel_exposed, model_parallel_exposed
from .sums import device_memory, step_time
from .traffic import traffic

__all__ = ["Cluster", "Layout", "Estimate", "estimate", "validate", "in_flight", "held_per_rank",
           "stage_parameters", "collective_seconds"]


def validate(model: Transformer, layout: Layout, cluster: Cluster | None = None) -> None:
    """Raise ValueError with the reason a layout cannot run this model (on this cluster)."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a minipar.layout.Layout, got {type(layout).__name__}")
    layout.check()
    if layout.ep != 1 and not isinstance(model, MoETransformer):
        raise ValueError("ep > 1 needs a mixture-of-experts model (chapter 09: plan.MoETransformer); this "
                         "Transformer is dense")
    if layout.ep != 1 and model.experts % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide the {model.experts} experts (each rank holds E/ep of them)")
    if layout.cp_method not in CP_METHODS:
        raise ValueError(f"unknown context-parallel method {layout.cp_method!r}; choose one of {CP_METHODS}")
    if layout.cp > 1 and layout.cp_method == "ulysses" and (model.heads // layout.tp) % layout.cp:
        raise ValueError(f"Ulysses gives each cp rank whole heads: heads / tp = {model.heads // layout.tp} must "
                         f"be divisible by cp = {layout.cp}")
    if layout.cp > 1 and layout.cp_method == "ring-zigzag" and model.seq_len % (2 * layout.cp):
        raise ValueError(f"zig-zag ring attention cuts the sequence in 2·cp chunks: {model.seq_len} is not "
                         f"divisible by {2 * layout.cp}")
    if layout.recompute not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {layout.recompute!r}")
    if model.heads % layout.tp:
        raise ValueError(f"tp={layout.tp} must divide the {model.heads} attention heads")
    if layout.sp and layout.tp == 1:
        raise ValueError("sequence parallelism shards along the tensor-parallel group: it needs tp > 1")
    if model.seq_len % (layout.cp * (layout.tp if layout.sp else 1)):
        raise ValueError(f"sequence length {model.seq_len} must be divisible by cp"
                         f"{'·tp' if layout.sp else ''} = {layout.cp * (layout.tp if layout.sp else 1)}")
    if layout.pp > 1:
        validate_schedule(layout.schedule, layout.pp, layout.micro_batches, layout.v)
        stage_layers(model.layers, layout.pp, layout.v)          # equal stages, or Llama 3's balanced cut
    elif layout.v != 1:
        raise ValueError("v (virtual stages) needs a pipeline: pp > 1")
    if cluster is not None and layout.devices > cluster.devices:
        raise ValueError(f"the layout needs {layout.devices} devices, the cluster has {cluster.devices}")


@functools.lru_cache(maxsize=4096)
def in_flight(schedule: str, p: int, m: int, v: int = 1, rank: int | None = None) -> float:
    """Most micro-batches whose activations one rank holds at once, in units of a whole rank's layers
    (a chunk is 1/v of them), counted by walking the schedule (``F`` adds one, ``BW`` or ``W`` frees
    one). ``rank=None``: the max over ranks — GPipe m, 1F1B p, interleaved p + (p-1)/v (on rank 0);
    otherwise that rank's — the last rank holds 1 under 1F1B, but m under GPipe and p under ZB-H1 (its
    deferred W keeps every rank's activations until then: Qi et al. 2023, same peak p on every stage)."""
    if p == 1:
        return 1.0
    peaks = held_per_rank(schedule, p, m, v)
    return (max(peaks) if rank is None else peaks[rank]) / v


@functools.lru_cache(maxsize=1024)
def held_per_rank(schedule: str, p: int, m: int, v: int) -> tuple:
    """Each rank's most chunks held at once (:func:`in_flight` in chunks, for every rank), counted by one walk
    of the schedule: the planner asks for the max and for the last rank of thousands of layouts."""
    peaks = []
    for actions in make_schedule(schedule, p, m, v).actions:
        held = peak = 0
        for a in actions:
            held += 1 if a.kind == "F" else -1 if a.kind in ("BW", "W") else 0
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def stage_parameters(model: Transformer, layout: Layout) -> dict:
    """Parameters held by one device of the first and of the last pipeline stage (tensor-parallel share):
    {"first": ..., "last": ..., "layer": one layer's, "experts": the expert parameters of a stage's layers
    (:func:`~.model.expert_parameters`; 0 for a dense model), which are averaged and sharded over the
    expert-data-parallel ranks (dp·cp/ep) instead of dp·cp}. The word embedding is split over the
    vocabulary (÷ t); the last stage keeps its own copy of it for the output layer when the weights are tied
    and pp > 1 (as Megatron does); positions and the final LayerNorm stay whole."""
    t, h = layout.tp, model.hidden
    layer = layer_parameters(model, t, layout.ep)
    first_layers, most, last_layers = stage_layers(model.layers, layout.pp, layout.v)
    experts = most * expert_parameters(model, t, layout.ep)
    word = model.vocab * h / t
    first = first_layers * layer + word + model.positions * h
    last_extra = (word if (not model.tied_embeddings or layout.pp > 1) else 0) + (2 * h if model.final_norm else 0)
    if layout.pp == 1:
        return {"first": first + last_extra, "last": first + last_extra, "layer": layer, "experts": experts}
    return {"first": first, "last": last_layers * layer + last_extra, "layer": layer, "experts": experts}


@dataclass
class Estimate:
    """Per-device memory (bytes), step time (seconds; its communication terms are the *exposed* seconds),
    bytes sent per device per step, MFU; ``hidden``: communication seconds the overlap model puts under
    compute, per term (empty without overlap). All of it a model."""
    layout: Layout
    memory: dict
    time: dict
    bytes_sent: dict
    mfu: float
    memory_limit: float
    in_flight: float
    notes: list = field(default_factory=list)
    hidden: dict = field(default_factory=dict)
    overlap: object = False

    @property
    def exposed_comm_seconds(self) -> float:
        """Communication the step waits for (model): the time terms that are collectives."""
        return sum(v for k, v in self.time.items() if k in self.bytes_sent)

    @property
    def hidden_comm_seconds(self) -> float:
        """Communication under compute (model): 0 without overlap."""
        return sum(self.hidden.values())

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory_limit

    @property
    def step_seconds(self) -> float:
        return self.time["total"]

    def __str__(self) -> str:
        gb = lambda x: f"{x / 1e9:.1f}"  # noqa: E731
        mem = ", ".join(f"{k} {gb(v)}" for k, v in self.memory.items() if k != "total")
        tim = ", ".join(f"{k} {v:.3g}" + (f" (+{self.hidden[k]:.3g} hidden)" if self.hidden.get(k) else "")
                        for k, v in self.time.items() if k != "total")
        comm = (f"; model: comm exposed {self.exposed_comm_seconds:.3g} s, hidden {self.hidden_comm_seconds:.3g} s"
                if self.overlap else "")
        return (f"{self.layout}: memory {gb(self.memory['total'])} GB/device ({mem}); step "
                f"{self.time['total']:.3g} s ({tim}{comm}); MFU {self.mfu:.1%}"
                f"{'' if self.fits else '  DOES NOT FIT'}")


def estimate(model: Transformer, cluster: Cluster, layout: Layout, *, precision="mixed", dropout: bool = True,
             eager: bool = False, persistent_grads: bool = True, bucket_bytes: float = 25e6,
             compute_seconds: float | None = None, overlap=False, kernels=MEGATRON_2022) -> Estimate:
    """Memory per device, step time and MFU of ``layout`` training ``model`` on ``cluster``.

    ``precision``: "mixed" (16-bit values, Adam 2 + 2 + 12 bytes), "fp32", or a
    :class:`minipar.data.zero_memory.Precision`; activations take the parameter's width. ``eager=True``
    adds what PyTorch's unfused kernels keep beyond the paper's count (LayerNorm statistics, the causal
    mask: :func:`minipar.tensor.sequence.uncounted_bytes`); ``dropout=False`` drops the masks.
    ``persistent_grads=False``: gradients do not outlive the step (``zero_grad(set_to_none=True)``, no flat
    gradient buffer): they are created as the backward frees activations, so only what exceeds the
    activations adds to the peak. ``overlap``: False (every collective exposed), ``"minipar"`` (what this
    course's programs overlap) or True (what PyTorch DDP and DeepSpeed overlap): :mod:`.overlap`.
    ``kernels``: how the framework runs a layer (:class:`.operators.Kernels`), on a cluster with a device card."""
    validate(model, layout, cluster)
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {list(OVERLAPS)}, got {overlap!r}")
    prec = zero_memory._precision(precision)
    memory, psi, experts, flying = _memory(model, layout, prec, dropout, eager, persistent_grads,
                                           kernels.attention == "flash")
    sent, seconds, dp_parts = traffic(model, cluster, layout, prec, psi, bucket_bytes, experts=experts)
    flops = hardware_flops(model, layout.global_batch, layout.recompute)
    stage = stage_seconds(model, layout, cluster.device, kernels, prec.param) if cluster.device else None
    if compute_seconds is not None:
        compute = compute_seconds
    elif stage:                                    # the operators of the slowest stage, m micro-batches
        compute = layout.micro_batches * stage["slowest"]
    else:
        compute = flops / (layout.devices * cluster.peak_flops * cluster.flops_efficiency)
    hidden = {}
    if overlap:               # the forward's share of the FLOPs (the rest, recomputation included, is backward)
        forward = compute * forward_flops(model, layout.global_batch * model.seq_len) / flops
        exposed = {"dp": data_parallel_exposed(layout.zero, overlap, dp_parts, forward, compute - forward,
                                               layout.micro_batches)}
        exposed |= model_parallel_exposed(overlap, seconds, *_matmuls_and_attention(model, layout, compute, stage),
                                          compute, layout.micro_batches, layout.cp)
        for term, left in exposed.items():
            hidden[term], seconds[term] = seconds[term] - left, left
    time = step_time(compute, seconds, layout)
    updated = (psi - experts) / (layout.dp * layout.cp) + experts / layout.expert_data_parallel \
        if layout.zero else psi
    if cluster.optimizer_seconds_per_param and compute_seconds is None:     # measured compute includes it
        time["optimizer"] = updated * cluster.optimizer_seconds_per_param
    elif cluster.device is not None and compute_seconds is None:
        time["optimizer"] = ops_seconds(optimizer_step(updated), cluster.device)
    time["total"] = sum(time.values())
    util = model_flops(model, layout.global_batch) / (time["total"] * layout.devices * cluster.peak_flops)
    return Estimate(layout, memory, time, sent, util, cluster.memory_bytes, flying, hidden=hidden, overlap=overlap)


def _matmuls_and_attention(model, layout, compute, stage) -> tuple:
    """(matmul, attention-core) seconds of ``compute``: the slowest stage's operators' shares (:func:`.operators.
    stage_seconds`), else the attention core's share of the forward FLOPs (4·s·h per token and layer)."""
    if stage:
        scale = compute / stage["slowest"]
        return scale * stage["gemm"], scale * stage["attention"]
    attention = compute * 4 * model.seq_len * model.hidden * model.layers / forward_flops(model, 1)
    return compute - attention, attention


def _memory(model, layout, prec, dropout, eager, persistent_grads, fused_attention=False):
    """(memory terms of the busiest device, its parameter count, the expert parameters among them,
    micro-batches in flight)."""
    vb, t, p, sp = prec.param, layout.tp, layout.pp, layout.sp
    b, h, s = layout.micro_batch, model.hidden, model.seq_len // layout.cp
    params = stage_parameters(model, layout)

    ring = layout.cp > 1 and layout.cp_method.startswith("ring")

    def per_layer(mode):        # ring attention, a fused (flash) kernel: no scores kept, as if recomputed
        mode = "selective" if (ring or fused_attention) and mode == "none" else mode
        kept = activation_bytes_per_layer(model, b, t, sp, mode, value_bytes=vb, dropout=dropout, seq_len=s)
        if layout.cp > 1 and not ring and mode == "none":    # Ulysses, RSA: a·s²·b/cp = cp × the (s/cp)² term
            kept += (layout.cp - 1) * (kept - activation_bytes_per_layer(
                model, b, t, sp, "selective", value_bytes=vb, dropout=dropout, seq_len=s))
        return kept + (uncounted_bytes(s, b, t, sp, value_bytes=vb) if eager and mode != "full" else 0)

    kept = per_layer(layout.recompute)
    flying = in_flight(layout.schedule, p, layout.micro_batches, layout.v) if p > 1 else 1.0
    logits = 4 * s * b * model.vocab / t + 2 * vb * s * b * h / (t if sp else 1)  # fp32 log-softmax; LN, head in
    data_ranks = layout.dp * layout.cp               # gradients averaged, ZeRO sharded, over dp·cp ranks
    buffers = 2.0 * vb * b * s * s * model.heads / t if ring else 0.0   # one block: scores, probs
    if layout.zero == 3:                      # the embedding unit and the current and next layer, gathered
        buffers += prec.param * (2 * params["layer"] + model.vocab * h / t + model.positions * h)
    if layout.zero >= 2 and data_ranks > 1:   # one layer's gradients in a ring reduce-scatter: a working
        buffers += prec.grad * params["layer"] * (1 + 2 / data_ranks)   # copy, a chunk to send, one received
    if layout.recompute != "none":            # what the backward rematerializes for one layer at a time
        buffers += per_layer("none") - kept
    stages = {}
    last_flight = in_flight(layout.schedule, p, layout.micro_batches, layout.v, rank=p - 1) if p > 1 else 1.0
    experts, most = params["experts"], stage_layers(model.layers, p, layout.v)[1]   # over dp·cp/ep; fullest stage
    for name, flight in (("first", flying), ("last", last_flight)):
        states = zero_memory.model_state_bytes_formula(params[name] - experts, data_ranks, layout.zero, prec)
        if experts:
            more = zero_memory.model_state_bytes_formula(experts, layout.expert_data_parallel, layout.zero, prec)
            states = {k: states[k] + more[k] for k in states}
        # the output layer's logits belong to each micro-batch the last stage holds (GPipe m, ZB-H1 p, 1F1B 1)
        stages[name] = device_memory(states, kept, most, flight, buffers, persistent_grads=persistent_grads,
                                     extra=logits if name == "last" or p == 1 else 0.0)
    busiest = max(stages, key=lambda k: stages[k]["total"])
    return stages[busiest], params[busiest], experts, flying
