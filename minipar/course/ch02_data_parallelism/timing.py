"""Chapter 02's time: each strategy measured here, its trace replayed here and on named clusters.

One launch on N ranks trains the same tiny GPT with DDP at several bucket sizes, with one bucket holding
every gradient (no overlap) and with DataParallel's five exchanges (:func:`dp_step`: DP as a program of N
processes, so that each device's compute and messages are traced as DDP's are — ``minipar.data.dp`` itself
runs threads in one process, which a per-device trace cannot see). Per configuration, measured as
:mod:`minipar.observe.measure` measures every run:

* **measured on this machine**: wall seconds between consecutive optimizer steps (the fastest step, each
  timed on its slowest rank);
* its :mod:`minipar.observe.trace` (compute in thread CPU seconds, every collective), which
  :func:`minipar.course.replays.replays` plays on

  - this machine as a cluster (:func:`minipar.observe.cluster.this_machine`: compute as measured, links α, β
    fitted to gloo's all-reduce timed in the same launch, the fastest call of each size:
    :class:`minipar.observe.measure.Links`),
  - a DGX-A100 node and seed 002's PCIe machine (:mod:`minipar.observe.cluster`), each compute segment scaled
    so that a step's compute is the step's counted FLOPs / (peak · efficiency) of the device
    (``compute_scale`` = FLOP/s here / the device's; FLOPs counted by ``torch.utils.flop_counter``).

The replays are a model (FlexFlow's simulator, Jia et al. 2019): labelled so wherever they are shown.
"""
from __future__ import annotations

import dataclasses

import torch

from minipar import comm
from minipar.course.bench import model_and_batch
from minipar.course.replays import exposed_per_step, hidden_share
from minipar.data import ddp
from minipar.launcher import launch
from minipar.loop import lm_loss, shard_batch
from minipar.observe.cluster import pcie_node
from minipar.observe.measure import Links, RankSteps, counted_flops, gather_steps, step_cpu_seconds, time_calls, \
    timed_steps

__all__ = ["dp_step", "traced_rank", "measure", "table", "titan_rtx"]

LINK_SIZES = (4, 2 ** 19)          # bytes of the all-reduces timed here to fit α and β
LINK_REPEATS = 20                  # calls of each, after a warm-up; the fastest is fitted (the least disturbed: with 5, every
                                   # call of a size can land in the slow mode of a call here, ~2 ms, and the fit finds no bandwidth)


def dp_step(rank, world_size, model, opt, x, y):
    """One DataParallel step as N processes: the five exchanges of :mod:`minipar.data.dp`, through rank 0
    (scatter the batch, broadcast the weights, gather the outputs, scatter ∂loss/∂outputs, reduce the
    gradients), the loss and the optimizer on rank 0 alone. ``x``, ``y``: the global batch (read on rank 0)."""
    mine = torch.empty_like(x.chunk(world_size)[0])
    comm.scatter(mine, list(x.chunk(world_size)) if rank == 0 else None, src=0)      # 1 scatter inputs
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    comm.broadcast(flat, src=0)                                                       # 2 replicate model
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    opt.zero_grad(set_to_none=True)
    logits = model(mine)
    out = [torch.empty_like(logits) for _ in range(world_size)] if rank == 0 else None
    comm.gather(logits.detach().contiguous(), out, dst=0)                            # 3 gather outputs
    grad = torch.empty_like(logits)
    pieces = None
    if rank == 0:                                     # the loss lives on device 0
        full = torch.cat(out).requires_grad_()
        lm_loss(full, y).backward()
        pieces = list(full.grad.chunk(world_size))
    comm.scatter(grad, pieces, src=0)                                                 # 4 scatter ∂loss/∂y
    logits.backward(grad)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    comm.reduce(grads, dst=0)                                                         # 5 reduce grads
    if rank == 0:
        offset = 0
        for p in model.parameters():
            p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()


def _ddp_step(wrapped, opt, xs, ys):
    opt.zero_grad(set_to_none=True)
    lm_loss(wrapped(xs), ys).backward()
    opt.step()


def _traced(step, rank, steps) -> RankSteps:
    """``steps`` calls of ``step`` after one warm-up (not traced), each ending a step (:mod:`minipar.observe.measure`)."""
    step()
    with timed_steps(rank) as run:
        for _ in range(steps):
            step()
            run.tick()
    return run


def traced_rank(rank, world_size, bucket_sizes, layers, embd, batch, seq, steps):
    """On each rank: {"runs": {config: RankSteps}, "link": gloo's all-reduce times (:func:`minipar.observe.
    measure.time_calls`), "flops": the step's FLOPs, ...}."""
    torch.set_num_threads(1)
    make, (x, y) = model_and_batch(layers, embd, batch, seq)
    xs, ys = shard_batch((x, y), rank, world_size)
    grad_bytes = sum(p.numel() * p.element_size() for p in make().parameters())
    configs = {f"DDP {b // 1024} KiB buckets": b for b in bucket_sizes if b < grad_bytes}
    configs["DDP one bucket"] = 2 * grad_bytes
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01)  # noqa: E731
    out = {}
    for name, size in configs.items():
        model = make()
        wrapped, opt = ddp.DistributedDataParallel(model, bucket_bytes=size), sgd(model)
        out[name] = _traced(lambda: _ddp_step(wrapped, opt, xs, ys), rank, steps)
    model = make()
    opt = sgd(model)
    out["DP"] = _traced(lambda: dp_step(rank, world_size, model, opt, x, y), rank, steps)
    flops = counted_flops(lambda: lm_loss(make()(xs), ys).backward())
    return {"runs": out, "link": time_calls(world_size, LINK_SIZES, LINK_REPEATS, ops=("all_reduce",)),
            "flops": flops, "grad_bytes": grad_bytes, "buckets": dict(configs)}


def measure(world_size=4, bucket_sizes=(4 * 1024, 16 * 1024, 64 * 1024), layers=2, embd=64, batch=16, seq=32,
            steps=3) -> dict:
    """Launch :func:`traced_rank`: {"traces": {config: Trace}, "measured": {config: s (the fastest step, each
    on its slowest rank)}, "alpha", "beta" (gloo's all-reduce, the fastest call of each size fitted),
    "flops_here" (FLOP/s of a rank: counted FLOPs / CPU seconds of compute in a step), "grad_bytes",
    "all_reduces" (per step, traced), ...}."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (a step is the gap between two optimizer steps), got {steps}")
    ranks = launch(traced_rank, world_size, tuple(bucket_sizes), layers, embd, batch, seq, steps, quiet=True,
                   timeout=300)
    names = list(ranks[0]["runs"])
    runs = {n: gather_steps([r["runs"][n] for r in ranks], {"strategy": n}) for n in names}
    traces = {n: run.trace for n, run in runs.items()}
    beta, alpha = Links(world_size, [r["link"] for r in ranks]).fit("all_reduce", min)
    flops = ranks[0]["flops"]
    return {"traces": traces, "measured": {n: run.fastest for n, run in runs.items()},
            "alpha": alpha, "beta": beta, "flops_per_step": flops,
            "flops_here": flops / step_cpu_seconds(traces[names[0]]), "grad_bytes": ranks[0]["grad_bytes"],
            "bucket_bytes": ranks[0]["buckets"], "world_size": world_size, "steps": steps,
            "all_reduces": {n: sum(c.op == "all_reduce" for c in t.ranks[0].comms()) / steps for n, t in traces.items()}}


def titan_rtx(devices: int = 2, nvlink: bool = True, fp32: bool = False):
    """Seed 002's machine: :func:`minipar.observe.cluster.pcie_node` (TITAN RTX over PCIe 3.0), and with
    ``nvlink`` its two-link NVLink bridge, 50 GB/s per direction (NVIDIA: "100 GB/s" both directions).
    ``fp32``: the peak of FP32 arithmetic, 16.3 TFLOP/s (Turing whitepaper), for a run without ``--fp16``
    (seed 002's command line has none) instead of ``pcie_node``'s FP16 tensor-core 130 TFLOP/s."""
    node = pcie_node(devices)
    if fp32:
        node = dataclasses.replace(node, peak_flops=16.3e12)
    return dataclasses.replace(node, intra_bw=50e9, inter_bw=50e9) if nvlink else node


def table(measured: dict, played: dict) -> list:
    """One dict per config: measured here (s), then per cluster the replayed step (s), the exposed
    communication of one step (s) and the hidden share in it (:func:`minipar.course.replays.last_step`)."""
    rows = []
    for name in measured["traces"]:
        row = {"config": name, "measured_here": measured["measured"][name]}
        for where, results in played.items():
            row[f"step_{where}"] = results[name].step_between("step")
            row[f"exposed_{where}"] = exposed_per_step(results[name])
            row[f"hidden_{where}"] = hidden_share(results[name])
        rows.append(row)
    return rows
