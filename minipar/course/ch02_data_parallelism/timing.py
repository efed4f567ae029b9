"""Chapter 02's time: each strategy measured here, its trace replayed here and on named clusters.

One launch on N ranks trains the same tiny GPT with DDP at several bucket sizes, with one bucket holding
every gradient (no overlap) and with DataParallel's five exchanges (:func:`minipar.data.dp.step_on_ranks`: DP as a program of N
processes, so that each device's compute and messages are traced as DDP's are — ``minipar.data.dp``'s
``DataParallel`` runs threads in one process, which a per-device trace cannot see). Per configuration, measured as
:mod:`minipar.observe.measure` measures every run:

* **measured on this machine**: wall seconds between consecutive optimizer steps, each timed on its slowest
  rank: ``steps`` − 1 of them per configuration (5 by default), shown as median [min – max];
* its :mod:`minipar.machine.trace` (compute in thread CPU seconds, every collective), which
  :func:`minipar.course.replays.replays` plays on

  - this machine as a cluster (:func:`minipar.machine.cluster.this_machine`: compute as measured, links α, β
    fitted to gloo's all-reduce timed in the same launch, the fastest call of each size:
    :class:`minipar.observe.measure.Links`; the chapter does not show this replay: on 2 shared cores it sits
    several times below the wall clock, which it does not model),
  - a DGX-A100 node and the Hugging Face guide's TITAN RTX cards at its measured no-NVLink speed (:mod:`minipar.machine.cluster`), each compute segment scaled
    so that a step's compute is the step's counted FLOPs / (peak · efficiency) of the device
    (``compute_scale`` = FLOP/s here / the device's; FLOPs counted by ``torch.utils.flop_counter``).

The replays are a model (FlexFlow's simulator, Jia et al. 2019): labelled so wherever they are shown.
"""
from __future__ import annotations

import dataclasses

import torch

from minipar.course.bench import model_and_batch
from minipar.course.replays import exposed_per_step, hidden_share
from minipar.data import ddp, dp
from minipar.launcher import launch
from minipar.loop import lm_loss, shard_batch
from minipar.machine.cluster import PCIE3, LinkCard, gpu_cluster
from minipar.machine.device import A100_SXM_80GB, DeviceCard
from minipar.observe.measure import LINK_SIZES, Links, RankSteps, counted_flops, gather_steps, step_cpu_seconds, time_calls, \
    timed_steps

__all__ = ["traced_rank", "measure", "table", "TITAN_RTX", "TITAN_RTX_FP32", "NVLINK_BRIDGE",
           "titan_rtx", "GUIDE", "GUIDE_SLOW_PATH_GBPS", "guide_cards"]

LINK_REPEATS = 20                  # calls of each, after a warm-up; the fastest is fitted (the least disturbed: with 5, every
                                   # call of a size can land in the slow mode of a call here, ~2 ms, and the fit finds no bandwidth)


def _ddp_step(wrapped, opt, xs, ys):
    opt.zero_grad(set_to_none=True)
    lm_loss(wrapped(xs), ys).backward()
    opt.step()


def _traced(step, rank, steps, ops=False) -> RankSteps:
    """``steps`` calls of ``step`` after one warm-up (not traced), each ending a step (:mod:`minipar.observe.measure`;
    ``ops``: each compute segment's operators counted, which slows them: not a timed run)."""
    step()
    with timed_steps(rank, ops=ops) as run:
        for _ in range(steps):
            step()
            run.tick()
    return run


def traced_rank(rank, world_size, bucket_sizes, layers, embd, batch, seq, steps):
    """On each rank: {"runs": {config: RankSteps}, "counted": {config: RankSteps of 2 steps, operators
    counted}, "link": gloo's all-reduce times (:func:`minipar.observe.
    measure.time_calls`), "flops": the step's FLOPs, ...}."""
    torch.set_num_threads(1)
    make, (x, y) = model_and_batch(layers, embd, batch, seq)
    xs, ys = shard_batch((x, y), rank, world_size)
    grad_bytes = sum(p.numel() * p.element_size() for p in make().parameters())
    configs = {f"DDP {b // 1024} KiB buckets": b for b in bucket_sizes if b < grad_bytes}
    configs["DDP one bucket"] = 2 * grad_bytes
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01)  # noqa: E731
    out, counted = {}, {}
    for name, size in configs.items():
        model = make()
        wrapped, opt = ddp.DistributedDataParallel(model, bucket_bytes=size), sgd(model)
        out[name] = _traced(lambda: _ddp_step(wrapped, opt, xs, ys), rank, steps)
        counted[name] = _traced(lambda: _ddp_step(wrapped, opt, xs, ys), rank, 2, ops=True)
    model = make()
    opt = sgd(model)
    out["DP"] = _traced(lambda: dp.step_on_ranks(rank, world_size, model, opt, x, y), rank, steps)
    counted["DP"] = _traced(lambda: dp.step_on_ranks(rank, world_size, model, opt, x, y), rank, 2, ops=True)
    flops = counted_flops(lambda: lm_loss(make()(xs), ys).backward())
    return {"runs": out, "counted": counted, "link": time_calls(world_size, LINK_SIZES, LINK_REPEATS, ops=("all_reduce",)),
            "flops": flops, "grad_bytes": grad_bytes, "buckets": dict(configs)}


def measure(world_size=4, bucket_sizes=(4 * 1024, 16 * 1024, 64 * 1024), layers=2, embd=64, batch=16, seq=32,
            steps=6) -> dict:
    """Launch :func:`traced_rank`: {"traces": {config: Trace}, "counted": {config: Trace of 2 more steps with
    each compute segment's operators, for a replay on a device card}, "measured": {config: s (the median step, each on
    its slowest rank)}, "measured_steps": {config: [s of each of the ``steps`` − 1 steps]}, "alpha", "beta" (gloo's all-reduce, the fastest call of each size fitted),
    "flops_here" (FLOP/s of a rank: counted FLOPs / CPU seconds of compute in a step), "grad_bytes",
    "all_reduces" (per step, traced), ...}."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (a step is the gap between two optimizer steps), got {steps}")
    ranks = launch(traced_rank, world_size, tuple(bucket_sizes), layers, embd, batch, seq, steps, quiet=True,
                   timeout=300)
    names = list(ranks[0]["runs"])
    runs = {n: gather_steps([r["runs"][n] for r in ranks], {"strategy": n}) for n in names}
    traces = {n: run.trace for n, run in runs.items()}
    counted = {n: gather_steps([r["counted"][n] for r in ranks], {"strategy": n}).trace for n in names}
    beta, alpha = Links(world_size, [r["link"] for r in ranks]).fit("all_reduce", min)
    flops = ranks[0]["flops"]
    return {"traces": traces, "counted": counted, "measured": {n: run.median for n, run in runs.items()},
            "measured_steps": {n: list(run.seconds) for n, run in runs.items()},
            "alpha": alpha, "beta": beta, "flops_per_step": flops,
            "flops_here": flops / step_cpu_seconds(traces[names[0]]), "grad_bytes": ranks[0]["grad_bytes"],
            "bucket_bytes": ranks[0]["buckets"], "world_size": world_size, "steps": steps,
            "all_reduces": {n: sum(c.op == "all_reduce" for c in t.ranks[0].comms()) / steps for n, t in traces.items()}}


_ROUND = "launch floor, efficiencies: the A100 card's (minipar.machine.device), not fitted on a TITAN RTX"
TITAN_RTX = DeviceCard(
    "TITAN RTX", 130e12, 672e9, 24e9, A100_SXM_80GB.launch_floor,
    gemm_efficiency=A100_SXM_80GB.gemm_efficiency, attention_efficiency=A100_SXM_80GB.attention_efficiency,
    memory_efficiency=A100_SXM_80GB.memory_efficiency,
    source="NVIDIA Turing architecture whitepaper (2018), TITAN RTX: 130 TFLOP/s FP16 tensor cores with FP32 "
           "accumulate, 16.3 TFLOP/s FP32; 24 GB GDDR6 at 672 GB/s; " + _ROUND)
TITAN_RTX_FP32 = dataclasses.replace(TITAN_RTX, name="TITAN RTX, FP32", peak_flops=16.3e12)
NVLINK_BRIDGE = LinkCard("NVLink bridge (two TITAN RTX)", 50e9, 10e-6, 0.80,
                         "NVIDIA: the TITAN RTX NVLink bridge, 100 GB/s both directions together; latency and "
                         "efficiency: PCIE3's round numbers")


def titan_rtx(devices: int = 2, nvlink: bool = True, fp32: bool = False):
    """Seed 002's machine as a carded cluster (:func:`minipar.machine.cluster.gpu_cluster`): ``devices``
    :data:`TITAN_RTX` in one node over PCIe 3.0 x16 (:data:`minipar.machine.cluster.PCIE3`) or, with
    ``nvlink``, over their NVLink bridge (:data:`NVLINK_BRIDGE`, 50 GB/s per direction). ``fp32``: the card
    at its FP32 peak (:data:`TITAN_RTX_FP32`), for a run without ``--fp16`` (the guide's command line has
    none) instead of its FP16 tensor cores."""
    card = TITAN_RTX_FP32 if fp32 else TITAN_RTX
    link = NVLINK_BRIDGE if nvlink else PCIE3
    return gpu_cluster(card, 1, link, link, devices_per_node=devices)


# The Hugging Face guide's table (GPT-2 small, 2 TITAN RTX, 200 steps, fp32), as chapter 02's Sources box quotes it.
GUIDE = {"params": 124_439_808, "ranks": 2, "steps": 200, "ddp_nvlink_s": 101.9003, "ddp_no_nvlink_s": 131.4367}
# What its DDP without NVLink moved: each rank's all-reduce, 2(N-1)/N·P = P fp32 bytes at N = 2, over the whole
# step (the slowest the path can have been) or over only the time it added to the NVLink step (the fastest).
_PER_RANK = GUIDE["params"] * 4 * 2 * (GUIDE["ranks"] - 1) / GUIDE["ranks"]
GUIDE_SLOW_PATH_GBPS = (_PER_RANK / (GUIDE["ddp_no_nvlink_s"] / GUIDE["steps"]) / 1e9,
                        _PER_RANK / ((GUIDE["ddp_no_nvlink_s"] - GUIDE["ddp_nvlink_s"]) / GUIDE["steps"]) / 1e9)


def guide_cards(devices: int, gbps: float):
    """``devices`` :data:`TITAN_RTX_FP32` joined by a link of ``gbps`` GB/s, all of it reached (efficiency 1):
    the guide's measured no-NVLink path (``NCCL_P2P_DISABLE=1``, :data:`GUIDE_SLOW_PATH_GBPS`), not PCIe's peak."""
    path = LinkCard(f"the guide's no-NVLink path, as measured ({gbps:.2g} GB/s)", gbps * 1e9, PCIE3.latency, 1.0,
                    "Hugging Face guide's table: 498 MB all-reduced per rank in 148-657 ms; latency: PCIE3's")
    return gpu_cluster(TITAN_RTX_FP32, 1, path, path, devices_per_node=devices)


def table(measured: dict, played: dict) -> list:
    """One dict per config: measured here (s: the median, and "measured_min" / "measured_max"), then per cluster the replayed step (s), the exposed
    communication of one step (s) and the hidden share in it (:func:`minipar.course.replays.last_step`)."""
    rows = []
    for name in measured["traces"]:
        steps = measured["measured_steps"][name]
        row = {"config": name, "measured_here": measured["measured"][name], "measured_min": min(steps),
               "measured_max": max(steps)}
        for where, results in played.items():
            row[f"step_{where}"] = results[name].step_between("step")
            row[f"exposed_{where}"] = exposed_per_step(results[name])
            row[f"hidden_{where}"] = hidden_share(results[name])
        rows.append(row)
    return rows
