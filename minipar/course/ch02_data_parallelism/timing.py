"""Chapter 02's time: each strategy measured here, its trace replayed here and on named clusters.

One launch on N ranks trains the same tiny GPT with DDP at several bucket sizes, with one bucket holding
every gradient (no overlap) and with DataParallel's five exchanges (:func:`dp_step`: DP as a program of N
processes, so that each device's compute and messages are traced as DDP's are — ``minipar.data.dp`` itself
runs threads in one process, which a per-device trace cannot see). Per configuration and rank:

* **measured on this machine**: wall seconds between consecutive optimizer steps (the fastest gap; the
  strategy's figure is the slowest rank's);
* its :mod:`minipar.observe.trace` (compute in thread CPU seconds, every collective), which :func:`replays` plays on

  - this machine as a cluster (:func:`minipar.observe.cluster.this_machine`: compute as measured, links α, β
    fitted to gloo's all-reduce timed in the same launch, :func:`minipar.observe.fidelity.fit_link`),
  - a DGX-A100 node and seed 002's PCIe machine (:mod:`minipar.observe.cluster`), each compute segment scaled
    so that a step's compute is the step's counted FLOPs / (peak · efficiency) of the device
    (``compute_scale`` = FLOP/s here / the device's; FLOPs counted by ``torch.utils.flop_counter``).

The replays are a model (FlexFlow's simulator, Jia et al. 2019): labelled so wherever they are shown.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

__all__ = ["dp_step", "traced_rank", "all_reduce_seconds", "measure", "scaled", "replays", "hidden_share", "table",
           "titan_rtx", "draw_replays", "exposed_per_step", "last_step", "GPT2_SMALL_PARAMS", "SEED_TOKENS_PER_GPU"]

GPT2_SMALL_PARAMS = 124_439_808     # seed 002's model (GPT-2 small)
SEED_TOKENS_PER_GPU = 4 * 1024      # seed 002: --per_device_train_batch_size 4, run_clm's 1024-token blocks

LINK_SIZES = (4, 2 ** 19)          # bytes of the all-reduces timed here to fit α and β


def dp_step(rank, world_size, model, opt, x, y):
    """One DataParallel step as N processes: the five exchanges of :mod:`minipar.data.dp`, through rank 0
    (scatter the batch, broadcast the weights, gather the outputs, scatter ∂loss/∂outputs, reduce the
    gradients), the loss and the optimizer on rank 0 alone. ``x``, ``y``: the global batch (read on rank 0)."""
    from minipar import comm
    from minipar.loop import lm_loss
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
    from minipar.loop import lm_loss
    opt.zero_grad(set_to_none=True)
    lm_loss(wrapped(xs), ys).backward()
    opt.step()


def _traced(step, rank, steps):
    """(fastest wall gap between consecutive optimizer steps, the RankTrace of ``steps`` steps)."""
    import torch.distributed as dist
    from minipar.observe import trace
    step()                                            # warm-up, not traced
    dist.barrier()
    stamps = []
    with trace.tracing(rank) as rank_trace:
        for _ in range(steps):
            step()
            stamps.append(time.perf_counter())
            trace.mark("step")
    return min(b - a for a, b in zip(stamps, stamps[1:])), rank_trace


def all_reduce_seconds(rank, world_size, sizes=LINK_SIZES, repeats=5) -> dict:
    """{bytes: seconds} of gloo float32 all-reduces of each of ``sizes`` bytes on this rank, the fastest of
    ``repeats`` after one warm-up (the least disturbed: the machine is shared). Runs on every rank of a launch
    (``launch(all_reduce_seconds, n, ...)``, or inside a rank's function), for
    :func:`minipar.observe.fidelity.fit_link`."""
    import torch.distributed as dist
    out = {}
    for size in sizes:
        buf, times = torch.zeros(max(1, size // 4)), []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out[size] = min(times[1:])
    return out


def traced_rank(rank, world_size, bucket_sizes, layers, embd, batch, seq, steps):
    """On each rank: {config: (measured seconds per step, RankTrace)}, the link timings, the step's FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode
    from minipar.course.bench import model_and_batch
    from minipar.data import ddp
    from minipar.loop import lm_loss, shard_batch
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
    with FlopCounterMode(display=False) as counter:
        lm_loss(make()(xs), ys).backward()
    return {"runs": out, "link": all_reduce_seconds(rank, world_size), "flops": counter.get_total_flops(), "grad_bytes": grad_bytes,
            "buckets": {n: s for n, s in configs.items()}}


def measure(world_size=4, bucket_sizes=(4 * 1024, 16 * 1024, 64 * 1024), layers=2, embd=64, batch=16, seq=32,
            steps=3) -> dict:
    """Launch :func:`traced_rank`: {"traces": {config: Trace}, "measured": {config: s}, "alpha", "beta",
    "flops_here" (FLOP/s of a rank: counted FLOPs / CPU seconds of compute per step), "grad_bytes",
    "all_reduces" (per step, traced), ...}."""
    from minipar.observe.fidelity import fit_link
    from minipar.launcher import launch
    from minipar.observe.trace import Trace
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (a step is the gap between two optimizer steps), got {steps}")
    ranks = launch(traced_rank, world_size, tuple(bucket_sizes), layers, embd, batch, seq, steps, quiet=True,
                   timeout=300)
    names = list(ranks[0]["runs"])
    traces = {n: Trace([r["runs"][n][1] for r in ranks], {"strategy": n}) for n in names}
    beta, alpha = fit_link("all_reduce", world_size, ranks[0]["link"])
    ddp_trace = traces[names[0]]
    cpu_per_step = max(t.compute_cpu_seconds for t in ddp_trace.ranks) / steps
    return {"traces": traces, "measured": {n: max(r["runs"][n][0] for r in ranks) for n in names},
            "alpha": alpha, "beta": beta, "flops_per_step": ranks[0]["flops"],
            "flops_here": ranks[0]["flops"] / cpu_per_step, "grad_bytes": ranks[0]["grad_bytes"],
            "bucket_bytes": ranks[0]["buckets"], "world_size": world_size, "steps": steps,
            "all_reduces": {n: sum(c.op == "all_reduce" for c in t.ranks[0].comms()) / steps for n, t in traces.items()}}


def titan_rtx(devices: int = 2, nvlink: bool = True, fp32: bool = False):
    """Seed 002's machine: :func:`minipar.observe.cluster.pcie_node` (TITAN RTX over PCIe 3.0), and with
    ``nvlink`` its two-link NVLink bridge, 50 GB/s per direction (NVIDIA: "100 GB/s" both directions).
    ``fp32``: the peak of FP32 arithmetic, 16.3 TFLOP/s (Turing whitepaper), for a run without ``--fp16``
    (seed 002's command line has none) instead of ``pcie_node``'s FP16 tensor-core 130 TFLOP/s."""
    from minipar.observe.cluster import pcie_node
    node = pcie_node(devices)
    if fp32:
        node = dataclasses.replace(node, peak_flops=16.3e12)
    return dataclasses.replace(node, intra_bw=50e9, inter_bw=50e9) if nvlink else node


def scaled(trace, bytes_factor: float):
    """The same program with every message ``bytes_factor`` times larger (a what-if: a model with that many
    times the parameters, in the same number of buckets)."""
    from minipar.observe.trace import Comm, RankTrace, Trace
    ranks = [RankTrace(r.rank, [dataclasses.replace(e, bytes=round(e.bytes * bytes_factor))
                                if isinstance(e, Comm) else e for e in r.events]) for r in trace.ranks]
    return Trace(ranks, dict(trace.meta, bytes_factor=bytes_factor))


def replays(measured: dict, clusters: dict, compute_factor: float = 1.0, bytes_factor: float = 1.0) -> dict:
    """{cluster name: {config: ReplayResult}}. A cluster named "here" replays compute as measured (scale 1),
    the others scale it by FLOP/s here / the device's. What-ifs (1: the measured run): ``compute_factor``
    multiplies every compute segment, ``bytes_factor`` every message (:func:`scaled`) — a model ``f`` times
    larger trained on ``k`` times the tokens per rank is compute × f·k, bytes × f."""
    from minipar.observe.replay import device_scale, replay
    out = {}
    for where, cluster in clusters.items():
        scale = 1.0 if where == "here" else device_scale(cluster, measured["flops_here"])
        out[where] = {n: replay(scaled(t, bytes_factor) if bytes_factor != 1 else t, cluster,
                                compute_scale=scale * compute_factor) for n, t in measured["traces"].items()}
    return out


def last_step(result, label: str = "step"):
    """``result`` cut to one step: each rank's spans clipped to the gap between its last two marks ``label``
    (so neither a first step that differs from the rest nor the set-up or a final gather is counted)."""
    from minipar.observe.replay import ReplayResult
    timelines, finish = [], []
    for spans, marks in zip(result.timelines, result.marks):
        times = [t for name, t in marks if name == label]
        if len(times) < 2:
            raise ValueError(f"fewer than two marks {label!r} on a rank")
        t0, t1 = times[-2], times[-1]
        timelines.append([dataclasses.replace(s, start=max(s.start, t0) - t0, end=min(s.end, t1) - t0)
                          for s in spans if s.end > t0 and s.start < t1])
        finish.append(t1 - t0)
    return ReplayResult(timelines, finish, result.cluster)


def exposed_per_step(result, label: str = "step") -> float:
    """The busiest rank's communication not under its compute in one step (:func:`last_step`), seconds."""
    step = last_step(result, label)
    return step.exposed(max(range(len(step.timelines)), key=step.compute))


def hidden_share(result, label: str = "step") -> float:
    """Share of the busiest rank's transfer time that ran under its compute in one step (:func:`last_step`):
    the replay's hidden / comm."""
    step = last_step(result, label)
    rank = max(range(len(step.timelines)), key=step.compute)
    comm = step.comm(rank)
    return step.hidden(rank) / comm if comm else 0.0


def table(measured: dict, played: dict) -> list:
    """One dict per config: measured here (s), then per cluster the replayed step (s), the exposed
    communication of one step (s) and the hidden share in it (:func:`last_step`)."""
    rows = []
    for name in measured["traces"]:
        row = {"config": name, "measured_here": measured["measured"][name]}
        for where, results in played.items():
            row[f"step_{where}"] = results[name].step_between("step")
            row[f"exposed_{where}"] = exposed_per_step(results[name])
            row[f"hidden_{where}"] = hidden_share(results[name])
        rows.append(row)
    return rows


def draw_replays(axes, results: dict, p: int, unit: float = 1e-3, unit_name: str = "ms", gap: int = -1):
    """One Gantt per ``{title: ReplayResult}`` on ``axes`` (:func:`minipar.pipeline.gantt.draw_gantt`), each
    showing one step in ``unit``: the one ending at "step" mark ``gap`` (-1: the last step)."""
    from minipar.pipeline.gantt import draw_gantt, replay_rows
    for ax, (title, result) in zip(axes, results.items()):
        times = [t for label, t in result.marks[0] if label == "step"]
        t0, t1 = times[gap - 1], times[gap]
        rows = [(r, k, s, i, a / unit, b / unit) for r, k, s, i, a, b in replay_rows(result, t0, t1)]
        draw_gantt(ax, rows, p, f"{title}: step {(t1 - t0) / unit:.3g} {unit_name}", labels=False)
        ax.set_xlabel(unit_name, fontsize=7)
