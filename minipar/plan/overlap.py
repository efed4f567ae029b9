"""What data-parallel communication a program hides under its compute: the overlap option of
:func:`minipar.plan.estimate` (a model, as the rest of the estimate; :mod:`minipar.machine.replay` plays the
measured program instead).

Two shapes of overlap, each a closed form of a pipeline of k equal pieces on one link (one transfer at a time):

* **buckets during the backward** (PyTorch DDP, Li et al. 2020, "PyTorch Distributed: Experiences on
  Accelerating Data Parallel Training", VLDB §3.2.3): k buckets of c = C/k seconds each, bucket i ready
  after i/k of the backward B (the layers after it are done); each starts when it is ready and the link is
  free. The last one ends at max over i of (i·B/k + (k−i+1)·c), so::

      exposed = max(C/k, C − B·(k−1)/k)          ("the last bucket is exposed" when c ≤ B/k)

* **prefetched units** (ZeRO-3 / FSDP, Rajbhandari et al. 2020 §7; Zhao et al. 2023): k units computed
  one after another, each needs its parameters gathered (g seconds) first, and unit i+1's gather starts
  when unit i starts computing (w seconds): the step takes g + (k−1)·max(g, w) + w, so per pass::

      exposed = g + (k−1)·max(0, g − w)          (max(compute, comm) per unit; the first gather is exposed)

  In the backward a unit's reduce-scatter (r) joins its gather on the link: blocking (minipar), it adds r
  per unit; asynchronous (DeepSpeed), exposed = g + (k−1)·max(0, g + r − w) + r.

Production systems of 2024–2026 hide the model-parallel terms too (``"production"``: :func:`model_parallel_exposed`):

* **async TP** (Megatron-Core's TP communication overlap; PyTorch's async TP, Wang et al. 2023): the
  sequence-parallel all-gather and reduce-scatter cut into :data:`TP_CHUNKS` chunks, each under the matmul of
  the chunk before — the bucket form with the layer's matmul seconds G: exposed = max(C/k, C − G·(k−1)/k);
* **PP's p2p** sent asynchronously while the next micro-batch computes (the prefetch form, units = m);
* **CP's ring** (ring attention, Liu et al. 2023): each pass's K/V exchange under the attention of the block
  already held, the local block hiding the first: exposed = max(0, C − A·(cp−1)/cp), A the attention seconds.

Which collectives overlap is the program's business. :data:`OVERLAPS` names them: ``"minipar"`` — this
course's programs (:mod:`minipar.data.ddp` all-reduces its buckets asynchronously; :mod:`minipar.data.zero`
prefetches stage 3's gathers; its ZeRO-1/2 reduce-scatters and stage 3's reduce-scatter block, as their
traces show); ``True`` — the production libraries (PyTorch DDP; DeepSpeed's ``overlap_comm``: ZeRO-1/2's
reduce-scatter in buckets during the backward as DDP's all-reduce, ZeRO-3's reduce-scatter asynchronous too).
Never overlapped, in either: TP's collectives (blocking, between dependent matmuls), pipeline sends (not in
minipar's runtime), ring attention's passes, the all-gather of ZeRO-1/2's updated parameters after the step,
and the optimizer. The backward that can hide a step's gradient reduction is the last micro-batch's (the
others accumulate under ``no_sync``).
"""
from __future__ import annotations

__all__ = ["OVERLAPS", "TP_CHUNKS", "bucketed_exposed", "prefetched_exposed", "data_parallel_exposed",
           "model_parallel_exposed", "hiding_tokens"]

_LIBRARIES = frozenset({"ddp buckets", "zero-1/2 reduce-scatter", "zero-3 gathers", "zero-3 reduce-scatter"})
OVERLAPS = {False: frozenset(),
            "minipar": frozenset({"ddp buckets", "zero-3 gathers"}),
            True: _LIBRARIES,
            "production": _LIBRARIES | {"tp async", "pp p2p", "cp ring"}}
TP_CHUNKS = 4          # chunks a TP collective is pipelined in under its matmul (a round number)


def hiding_tokens(flops_per_second: float, beta: float, grad_bytes: float = 2.0, n: int | None = None) -> float:
    """Tokens per device per step above which data-parallel gradient traffic can hide under the backward
    (the closed form of "compute-bound"; How to Scale Your Model, ch. on data parallelism): the backward does
    about 4·N FLOPs per token (2/3 of 6·N), the ring all-reduce sends 2(n−1)/n · e·N bytes per device, so it
    hides when 4·N·T / F ≥ 2(n−1)/n · e·N / β, i.e.

        T ≥ (F / β) · e · (n−1) / (2n)        (→ F·e / (2β) for large n)

    ``flops_per_second`` F what a device reaches, ``beta`` β its link (bytes/s), e = ``grad_bytes``; ``n``:
    the data-parallel ranks (None: many). FSDP/ZeRO-3 sends 1.5× DDP's bytes (two gathers and a
    reduce-scatter of the parameters): its threshold is 1.5× this one. A model: it ignores latency, the last
    bucket and the optimizer."""
    share = 2.0 if n is None else 2 * (n - 1) / n
    return (flops_per_second / beta) * grad_bytes * share / 4


def bucketed_exposed(comm: float, backward: float, buckets: int) -> float:
    """Seconds of ``comm`` (k = ``buckets`` equal transfers, issued as ``backward`` produces them) left after
    the backward ends: max(C/k, C − B·(k−1)/k)."""
    if comm <= 0:
        return 0.0
    k = max(1, int(buckets))
    return max(comm / k, comm - backward * (k - 1) / k)


def prefetched_exposed(gather: float, compute: float, units: int, reduce: float = 0.0,
                       reduce_async: bool = False) -> float:
    """Exposed seconds of one pass over ``units`` units with prefetched gathers (``gather``, ``compute`` and
    ``reduce`` the per-unit seconds): g + (k−1)·max(0, g − w), + k·r if each reduce-scatter blocks, or
    g + (k−1)·max(0, g + r − w) + r if it runs asynchronously."""
    k = max(1, int(units))
    if reduce_async:
        return gather + (k - 1) * max(0.0, gather + reduce - compute) + reduce
    return gather + (k - 1) * max(0.0, gather - compute) + k * reduce


def data_parallel_exposed(zero: int, mode, parts: dict, forward: float, backward: float, m: int) -> float:
    """Exposed seconds of the data-parallel term under overlap ``mode`` (a key of :data:`OVERLAPS`), from
    :func:`minipar.plan.traffic.data_parallel_traffic`'s ``parts`` and the step's ``forward`` and
    ``backward`` compute seconds on this device (m micro-batches)."""
    if mode not in OVERLAPS:
        raise ValueError(f"overlap must be one of {list(OVERLAPS)}, got {mode!r}")
    hides, reduce, gather = OVERLAPS[mode], parts["reduce"], parts["gather"]
    last_backward = backward / m
    if zero == 0:
        return bucketed_exposed(reduce, last_backward, parts["buckets"]) if "ddp buckets" in hides else reduce
    if zero in (1, 2):
        if "zero-1/2 reduce-scatter" not in hides:
            return reduce + gather
        if zero == 1:
            return bucketed_exposed(reduce, last_backward, parts["buckets"]) + gather
        return m * bucketed_exposed(reduce / m, last_backward, parts["units"]) + gather
    if "zero-3 gathers" not in hides:
        return reduce + gather
    k = parts["units"]
    g, r = gather / (2 * m * k), reduce / (m * k)                  # one unit's gather, reduce-scatter
    fwd, bwd = forward / (m * k), backward / (m * k)               # one unit's compute, per micro-batch
    per_micro_batch = prefetched_exposed(g, fwd, k) + prefetched_exposed(g, bwd, k, r, "zero-3 reduce-scatter"
                                                                         in hides)
    return m * per_micro_batch


def model_parallel_exposed(mode, seconds: dict, gemm: float, attention: float, compute: float, m: int,
                           cp: int) -> dict:
    """{term: exposed seconds} of the tp, pp and cp terms of ``seconds`` under overlap ``mode`` (only
    ``"production"`` hides them), given the step's matmul, attention and whole compute seconds on this
    device, m micro-batches and the cp degree: the three forms of the module's docstring."""
    hides = OVERLAPS[mode]
    out = {}
    if "tp async" in hides and seconds.get("tp"):
        out["tp"] = bucketed_exposed(seconds["tp"], gemm, TP_CHUNKS)
    if "pp p2p" in hides and seconds.get("pp"):
        out["pp"] = prefetched_exposed(seconds["pp"] / m, compute / m, m)
    if "cp ring" in hides and seconds.get("cp"):
        out["cp"] = max(0.0, seconds["cp"] - attention * (cp - 1) / cp)
    return out
