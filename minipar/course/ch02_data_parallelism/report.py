"""Chapter 02's deeper sections: DataParallel's threads against one thread (measured), DP against DDP
priced for GPT-2 small on a DGX-A100 node, and the bucket U-curve (cost models). Each function computes the rows
the chapter prints (from what :mod:`.measure` or :mod:`.buckets` returned, or from the planner's model), and returns a :class:`minipar.course.report.Report`: its ``text`` (the table and the
sentences the chapter shows), its numbers by name, and ``check()``, which holds what the chapter's text says
about them; :func:`show` prints, draws and checks in one call.

The DGX prices and the U-curve's replay are cost models, labelled so in every table: this machine's unpaced
wall clock (4 ranks on 2 cores) does not validate them and is not shown beside them.
"""
from __future__ import annotations

import math
import os
import statistics

from minipar.course.report import Report
from minipar.data.zero_memory import Precision
from minipar.layout import Layout
from minipar.machine.cluster import IB_HDR, NVLINK3, LinkCard, a100_cluster, collective_seconds, nccl_rooted_seconds
from minipar.observe.busy import OTHER_CORES
from minipar.plan import Transformer, estimate
from minipar.plan.model import parameters
from minipar.plan.operators import MEGATRON_2022, head_step, layer_step, ops_seconds, stage_seconds

from . import buckets as u_curve

# The GIL is singled out only when other processes used under OTHER_CORES of the cores while the threads ran (measured),
# else under one runnable task a core (the load average, which also counts this chapter's own earlier launches).
QUIET_LOAD_PER_CORE = 0.75

__all__ = ["show", "dp_threads", "gpt2_sized", "bucket_u_curve", "GPT2_SMALL", "AMP"]

DDP_DEFAULT_BUCKET = 25 * 2**20      # torch DistributedDataParallel's bucket_cap_mb=25


def link(card: LinkCard) -> str:
    """A priced link named with its assumed share of its datasheet peak (β = bandwidth × efficiency)."""
    return (f"{card.name} at {card.beta / 1e9:.4g} GB/s (an assumed {card.efficiency:.0%} of its "
            f"{card.bandwidth / 1e9:.4g} GB/s peak per direction)")


def _check_threads(r: Report) -> None:
    assert len(r.one) == len(r.threads) and min(r.one) > 0 and min(r.threads) > 0
    if "gain_at_cores" in r.facts:          # the last line names the GIL only on a machine quiet enough (§5's gate)
        last = r.text.splitlines()[-1]
        assert ("cannot separate the GIL" in last) == r.busy and ("mostly the GIL" in last) != r.busy
        if r.busy:                                  # the outcome it names is the line above's
            assert ("gained nothing" in last) == r.tie_at_cores
            assert r.tie_at_cores or ("were slower" in last) == (r.gain_at_cores < 1)


def _one_against_threads(gil: dict, k: int) -> tuple:
    """(the verdict's words, one thread's median / the threads', tie) for ``gil`` = ``measure.threads_vs_one_thread(
    ..., k)``; the ratio is of the medians as printed (ms, two decimals), so a reader can divide the numbers shown.
    A difference inside the runs' [min – max] is a tie."""
    one, threads = gil["one_thread"], gil["threads"]
    spread = lambda v: f"{statistics.median(v) * 1e3:.1f} ms [{min(v) * 1e3:.1f} – {max(v) * 1e3:.1f}]"  # noqa: E731
    one_ms, threads_ms = round(statistics.median(one) * 1e3, 2), round(statistics.median(threads) * 1e3, 2)
    gain = one_ms / threads_ms
    tie = max(threads) >= min(one) and max(one) >= min(threads)
    verdict = ("a tie (the ranges overlap): the threads gained nothing measurable" if tie else
               (f"the {k} threads took {1 / gain:.1f}× as long as one thread" if gain < 1 else
                f"one thread took {gain:.1f}× as long as the {k} threads") +
               f" (median {threads_ms:.2f} vs {one_ms:.2f} ms)")
    return (f"{k} shards' forwards: one after another on one thread {spread(one)}; on {k} DataParallel threads "
            f"{spread(threads)} — {verdict}"), gain, tie


def dp_threads(gil: dict, world_size: int, gil_at_cores: dict | None = None, load: float | None = None) -> Report:
    """DataParallel's replicas on threads: ``gil`` = ``measure.threads_vs_one_thread(...)`` (the same shards'
    forwards one after another on one thread, and on the threads; seconds per run); ``gil_at_cores``: the same
    with min(cores, ``world_size``) threads (no more threads than cores: on a quiet machine what is left is the
    GIL and the hand-offs, not oversubscription). ``load``: the 1-minute load average (None: this machine's,
    now); over :data:`QUIET_LOAD_PER_CORE` a core, there are about as many runnable tasks as cores or more, a
    thread may wait for a core, and the last line says that it cannot separate the GIL from that wait."""
    cores, lines = len(os.sched_getaffinity(0)), []
    load = os.getloadavg()[0] if load is None else load
    busy = load > QUIET_LOAD_PER_CORE * cores
    words, gain, tie = _one_against_threads(gil, world_size)
    lines.append(f"measured here, {words}. With {cores} cores here, a speed-up of at most "
                 f"{min(world_size, cores)}× was possible")
    facts = {}
    if gil_at_cores is not None:
        k = min(cores, world_size)
        words, facts["gain_at_cores"], facts["tie_at_cores"] = _one_against_threads(gil_at_cores, k)
        lines.append(f"no more threads than cores ({k} threads, {cores} cores), {words}")
        tie_k, gain_k = facts["tie_at_cores"], facts["gain_at_cores"]
        outcome = ("the threads gained nothing measurable" if tie_k else
                   "the threads were slower than one thread" if gain_k < 1 else "the threads were faster than one thread")
        other = gil_at_cores.get("other_cores")
        if other is not None:                       # measured: other processes' CPU while the threads ran
            busy = other > OTHER_CORES
            how = f"other processes used {other:.2f} of its {cores} cores"
        else:                                       # not measurable here (no /proc/stat): the load average
            how = f"load average {load:.1f} on {cores} cores"
        # the thresholds are the chapter's fold ("How it was measured"), not the printed line
        lines.append(f"  the machine was {'busy' if busy else 'quiet'} meanwhile ({how}), " + (
            f"so a thread may have waited for a core. With no more threads than cores {outcome}; "
            "these runs cannot separate the GIL from that wait" if busy else
            "so what the threads lost is mostly the GIL and their hand-offs"))
    return Report("\n".join(lines), _check_threads, one=gil["one_thread"], threads=gil["threads"],
                  world_size=world_size, gain=gain, tie=tie, busy=busy, load=load, **facts)


def show(r: Report) -> None:
    """Print ``r``'s table, draw its picture where it has one (a ``draw`` fact), and hold the chapter's
    sentences about its numbers (``r.check()``): nothing more is printed when they hold. Returns None, so a
    notebook cell that ends with the call does not echo the table a second time."""
    print(r.text)
    if "draw" in r.facts:
        r.draw()
    r.check()


GPT2_SMALL = Transformer(12, 768, 12, 50257, 1024, final_norm=True)   # GPT-2 small (124M), 1024-token context
AMP = Precision(2, 4, 12)           # autocast: bf16 matmuls and activations, fp32 gradients all-reduced, Adam


def _check_gpt2(r: Report) -> None:
    ddp, one = r.rows["DDP, 25 MiB buckets"], r.rows["DDP, one bucket"]
    assert r.buckets > 1 and r.hidden_share > 0.5                      # GPT-2 small on a DGX: most hides
    assert one["hidden"] == 0 and one["exposed"] > 2 * ddp["exposed"]   # one bucket: nothing hides
    assert abs(sum(r.compute_parts.values()) - one["compute"]) < 1e-12 and min(r.compute_parts.values()) > 0
    # the matmuls are 6·N·T plus attention's scores (under 20 % more), run slower than the card's full-tile rate
    assert r.six_nt < r.matmul_flops < 1.2 * r.six_nt
    assert r.matmul_flops / r.compute_parts["matmuls"] < 312e12 * 0.83
    assert all(abs(row["step"] - row["compute"] - row["exposed"]) < 1e-12 for row in r.rows.values())
    # DP's broadcast and reduce cannot overlap: even NCCL's ~P each way exposes more than one bucket's all-reduce,
    # and the star ((N−1)·P each way through device 0's link) N−1 times as much
    dp, star = r.rows["DP, NCCL"]["exposed"], r.rows["DP, star (minipar's dp)"]["exposed"]
    assert one["exposed"] < dp < star and abs(star - 2 * r.star_way) < 1e-12


def dp_nccl_exposed(grad_bytes: float, cluster, n: int) -> float:
    """DataParallel's weights and gradients on GPUs, priced as NCCL runs them: a broadcast of the weights and a
    reduce of the gradients (:func:`minipar.machine.cluster.nccl_rooted_seconds`), about P each way on device
    0's link, none of it under compute (the batch scatter and output gather not counted)."""
    return sum(nccl_rooted_seconds(op, grad_bytes, n, cluster.intra_bw, cluster.intra_latency)
               for op in ("broadcast", "reduce"))


def _draw_gpt2(rows: dict) -> None:
    """Each row's step as a bar: compute, then the communication exposed after it; the hidden communication a thin
    bar inside the compute, ending with the backward (a model: where inside the backward it runs is not drawn);
    the optimizer after the exposed communication."""
    import matplotlib.pyplot as plt
    from minipar.pipeline.gantt import KIND_COLOURS
    names = list(rows)[::-1]
    fig, ax = plt.subplots(figsize=(9, 2.4))
    for y, name in enumerate(names):
        r = rows[name]
        backward = (r["compute"] - r["optimizer"]) * 1e3          # forward and backward; Adam after the wait
        ax.barh(y, backward, color=KIND_COLOURS["compute"], label="compute" if y == 0 else None)
        ax.barh(y, r["exposed"] * 1e3, left=backward, color=KIND_COLOURS["comm exposed"],
                label="communication exposed" if y == 0 else None)
        ax.barh(y, r["optimizer"] * 1e3, left=backward + r["exposed"] * 1e3, color=KIND_COLOURS["compute"])
        if r["hidden"]:
            ax.barh(y, r["hidden"] * 1e3, left=backward - r["hidden"] * 1e3, height=0.3,   # ends with the backward
                    color=KIND_COLOURS["comm hidden"],
                    label="communication hidden under backward\n(its total; the buckets leave all along it)")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("ms per step (cost model, DGX-A100, GPT-2 small)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    plt.show()


def _matmuls(model, layout, card) -> tuple:
    """(seconds, FLOPs) of one micro-batch's matmuls (forward and backward, every layer's projections and
    attention scores, and the vocabulary head), from the same operators the planner prices
    (:func:`minipar.plan.operators.stage_seconds`); each runs at the card's full-tile rate × its shape's tile
    efficiency (:mod:`minipar.machine.gemm`); the rest runs at HBM speed."""
    layer = layer_step(model, layout.micro_batch, layout.tp, layout.sp, layout.recompute, MEGATRON_2022, 2,
                       model.seq_len)
    head = head_step(model, layout.micro_batch, layout.tp, MEGATRON_2022, 2, model.seq_len)
    gemms = lambda ops: [op for op in ops if op.kind == "gemm"]   # noqa: E731
    flops = lambda ops: sum(op.flops * op.count for op in gemms(ops))   # noqa: E731
    return (model.layers * ops_seconds(gemms(layer), card) + ops_seconds(gemms(head), card),
            model.layers * flops(layer) + flops(head))


def gpt2_sized(devices: int = 8, micro_batch: int = 4) -> Report:
    """Cost model, not a measurement: one data-parallel step of GPT-2 small (:data:`GPT2_SMALL`, ``micro_batch``
    sequences of 1024 tokens per GPU, :data:`AMP`) on ``devices`` A100s of a DGX-A100 node, priced by
    :func:`minipar.plan.estimate` from the model's own operators (:mod:`minipar.plan.operators`), with
    ``overlap=True`` (PyTorch DDP's buckets under the backward: :func:`minipar.plan.overlap.bucketed_exposed`)
    at 25 MiB buckets and at one bucket; DataParallel's weights out and gradients in beside them, not
    overlapped: NCCL's rooted ring (:func:`dp_nccl_exposed`) and the star ((N−1)·P each way on device 0's
    link, :func:`minipar.machine.cluster.collective_seconds`). Rows: compute (optimizer included), exposed and
    hidden communication, step (s)."""
    dgx, layout = a100_cluster(1), Layout(dp=devices, micro_batch=micro_batch)
    grads = parameters(GPT2_SMALL) * AMP.grad
    rows = {}
    for name, bucket in (("DDP, 25 MiB buckets", DDP_DEFAULT_BUCKET), ("DDP, one bucket", grads)):
        e = estimate(GPT2_SMALL, dgx, layout, precision=AMP, bucket_bytes=bucket, overlap=True)
        rows[name] = {"compute": e.time["compute"] + e.time["optimizer"], "exposed": e.time["dp"],
                      "hidden": e.hidden["dp"], "optimizer": e.time["optimizer"]}
    compute, adam = rows["DDP, one bucket"]["compute"], rows["DDP, one bucket"]["optimizer"]
    way = collective_seconds("broadcast", grads, devices, dgx.intra_bw, dgx.intra_latency)   # (N−1)·α + (N−1)·P/β
    rows["DP, NCCL"] = {"compute": compute, "exposed": dp_nccl_exposed(grads, dgx, devices), "hidden": 0.0,
                        "optimizer": adam}
    rows["DP, star (minipar's dp)"] = {"compute": compute, "exposed": 2 * way, "hidden": 0.0, "optimizer": adam}
    for r in rows.values():
        r["step"] = r["compute"] + r["exposed"]
    buckets = math.ceil(grads / DDP_DEFAULT_BUCKET)
    ddp, one = rows["DDP, 25 MiB buckets"], rows["DDP, one bucket"]
    share = ddp["hidden"] / (ddp["hidden"] + ddp["exposed"])
    tokens = micro_batch * GPT2_SMALL.seq_len
    operators = layout.micro_batches * stage_seconds(GPT2_SMALL, layout, dgx.device)["slowest"]
    matmuls, matmul_flops = (layout.micro_batches * x for x in _matmuls(GPT2_SMALL, layout, dgx.device))
    six_nt = 6 * parameters(GPT2_SMALL) * tokens
    parts = {"matmuls": matmuls, "rest": operators - matmuls, "adam": adam}
    lines = [f"cost model (not a measurement): one step of GPT-2 small ({parameters(GPT2_SMALL) / 1e6:.0f}M "
             f"parameters) on {devices} A100s of a DGX-A100 node, {micro_batch} sequences × {GPT2_SMALL.seq_len} "
             f"tokens = {tokens:,} tokens per GPU",
             f"  compute: {compute * 1e3:.1f} ms = {matmuls * 1e3:.1f} matmuls + {parts['rest'] * 1e3:.1f} the "
             f"other operators at HBM speed (norms, softmax, GELU, dropout, embedding, loss) + {adam * 1e3:.1f} Adam",
             f"  matmuls: {matmul_flops / 1e12:.2f} TFLOP (6 · parameters · tokens = {six_nt / 1e12:.2f}, the tied 50k-word head included, plus attention's QKᵀ and PV) "
             f"in {matmuls * 1e3:.1f} ms = {matmul_flops / matmuls / 1e12:.0f} TFLOP/s, "
             f"{matmul_flops / matmuls / dgx.device.peak_flops:.0%} of the A100's "
             f"{dgx.device.peak_flops / 1e12:.0f} TFLOP/s bf16 peak: a full tile's "
             f"{dgx.device.gemm_efficiency:.0%} × each shape's tile efficiency",
             f"  link:    {link(NVLINK3)}; gradients all-reduced in fp32 ({grads / 1e6:.0f} MB), as under AMP",
             f"  buckets: PyTorch's default 25 MiB makes {buckets} (equal buckets; torch's 1 MiB first bucket ignored)",
             f"{'config':26}{'compute ms':>11}{'exposed ms':>11}{'hidden ms':>10}{'step ms':>9}"]
    lines += [f"{name:26}{r['compute'] * 1e3:>11.1f}{r['exposed'] * 1e3:>11.2f}{r['hidden'] * 1e3:>10.2f}"
              f"{r['step'] * 1e3:>9.1f}" for name, r in rows.items()]
    lines.append(f"DDP's {buckets} buckets hide {share:.0%} of its all-reduce under the backward (all but the last "
                 f"bucket); one bucket hides none and exposes {one['exposed'] / ddp['exposed']:.0f}× as much")
    return Report("\n".join(lines), _check_gpt2, rows=rows, buckets=buckets, hidden_share=share, star_way=way,
                  tokens_per_gpu=tokens, compute_parts=parts, matmul_flops=matmul_flops, six_nt=six_nt, draw=lambda: _draw_gpt2(rows))


def _check_u(r: Report) -> None:
    steps = [row["step"] for row in r.rows]
    assert 0 < r.best < len(r.rows) - 1                                     # the lowest step is neither end: a U
    first, last = r.rows[0], r.rows[-1]
    # both arms rise; the right one by the last bucket's exposed all-reduce (about 2 % of the step since .grad is a
    # view of its bucket: no copies back into .grad are left to count as compute after it)
    assert first["step"] > 1.2 * steps[r.best] and last["step"] > 1.01 * steps[r.best]
    assert max(row["compute"] for row in r.rows) / min(row["compute"] for row in r.rows) - 1 < 1e-9   # one trace
    assert [row["buckets"] for row in r.rows] == sorted((row["buckets"] for row in r.rows), reverse=True)
    assert last["buckets"] == 1


def bucket_u_curve(n: int) -> Report:
    """One DDP run here with a bucket per parameter, its operators counted, re-bucketed at every capacity of
    :data:`.buckets.BUCKET_SIZES` (and one bucket) and replayed on :data:`.buckets.U_CLUSTER` (a model)."""
    per_param, grad_bytes = u_curve.counted_per_parameter(n)
    rows = u_curve.sweep(per_param, u_curve.BUCKET_SIZES + (grad_bytes,))
    lines = [f"cost model: one DDP run's gradients re-bucketed, priced on 4 A100s one per node over "
             f"{link(IB_HDR)}; gradients {grad_bytes:,} B",
             f"{'bucket C':>10} {'all-reduces':>12} {'step µs':>9} {'exposed µs':>11} {'compute µs':>11}"]
    lines += [f"{r['bucket_bytes']:>10,} {r['buckets']:>12} {r['step'] * 1e6:>9.0f} {r['exposed'] * 1e6:>11.0f} "
              f"{r['compute'] * 1e6:>11.0f}" for r in rows]
    best = min(range(len(rows)), key=lambda i: rows[i]["step"])
    latency = 2 * (n - 1) * u_curve.U_CLUSTER.inter_latency          # one all-reduce's latency on n ranks
    first, last = rows[0], rows[-1]
    lines.append(f"left arm: {first['buckets']} all-reduces a step × 2(N−1)·α = "
                 f"{first['buckets'] * latency * 1e6:.0f} µs of latency against {first['compute'] * 1e6:.0f} µs of "
                 f"compute: step {first['step'] * 1e6:.0f} µs; bottom: {rows[best]['buckets']} buckets of "
                 f"{rows[best]['bucket_bytes']:,} B, {rows[best]['step'] * 1e6:.0f} µs; right arm: one bucket, "
                 f"launched after the last gradient, exposes {last['exposed'] * 1e6:.0f} µs: step "
                 f"{last['step'] * 1e6:.0f} µs")
    return Report("\n".join(lines), _check_u, rows=rows, best=best, grad_bytes=grad_bytes)
