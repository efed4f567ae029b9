"""Chapter 02's deeper sections: DataParallel's threads against one thread (measured), DP against DDP
replayed GPT-2-sized on named clusters, and the bucket U-curve (cost models). Each function takes what
:func:`minipar.course.ch02_data_parallelism.timing.measure` (or :mod:`.buckets`) returned, computes the rows
the chapter prints, and returns a :class:`minipar.course.report.Report`: its ``text`` (the table and the
sentences the chapter shows), its numbers by name, and ``check()``, which holds what the chapter's text says
about them; :func:`show` prints, draws and checks in one call.

The replays are a cost model (FlexFlow's simulator, Jia et al. 2019), labelled so in every table: this
machine's unpaced wall clock (4 ranks on 2 cores) does not validate them and is not shown beside them.
"""
from __future__ import annotations

import os
import statistics

from minipar.course import replays
from minipar.course.report import Report
from minipar.course.bench import model_and_batch
from minipar.machine.cluster import IB_HDR, NVLINK3, LinkCard, a100_cluster, nccl_rooted_seconds

from . import buckets as u_curve
from . import timing

__all__ = ["show", "dp_threads", "gpt2_sized", "bucket_u_curve", "GPT2_WIDTH_RATIO"]

GPT2_WIDTH_RATIO = 768 / 64          # GPT-2 small's width / the chapter's model's
DDP_DEFAULT_BUCKET = 25 * 2**20      # torch DistributedDataParallel's bucket_cap_mb=25


def link(card: LinkCard) -> str:
    """A priced link named with its assumed share of its datasheet peak (β = bandwidth × efficiency)."""
    return (f"{card.name} at {card.beta / 1e9:.4g} GB/s (an assumed {card.efficiency:.0%} of its "
            f"{card.bandwidth / 1e9:.4g} GB/s peak per direction)")


def scaled_default_bucket(layers: int = 2, embd: int = 64) -> int:
    """DDP's default 25 MiB bucket scaled down as :func:`gpt2_sized` scales the gradients up (÷ f, f = GPT-2
    small's parameters / :func:`.timing.measure`'s model's): the bucket whose GPT-2-sized copy is 25 MiB."""
    make, _ = model_and_batch(layers, embd, 16, 32)
    params = sum(p.numel() for p in make().parameters())
    return round(DDP_DEFAULT_BUCKET * params / replays.GPT2_SMALL_PARAMS)


def _check_threads(r: Report) -> None:
    assert len(r.spans) == r.world_size
    assert len(r.one) == len(r.threads) and min(r.one) > 0 and min(r.threads) > 0


def dp_threads(spans: list, gil: dict, world_size: int) -> Report:
    """DataParallel's replicas on threads: ``spans`` = [(replica, start, end)] of one step (when each ran), and
    ``gil`` = ``measure.threads_vs_one_thread(...)`` (the same shards' forwards one after another on one
    thread, and on the threads; seconds per run). A difference inside the runs' [min – max] is a tie."""
    t0 = min(s for _, s, _ in spans)
    lines = [f"replica {i}: {1e3 * (s - t0):6.1f} → {1e3 * (e - t0):6.1f} ms" for i, s, e in sorted(spans)]
    concurrency = sum(e - s for _, s, e in spans) / (max(e for _, _, e in spans) - t0)
    cores = len(os.sched_getaffinity(0))
    lines.append(f"sum of the spans / the step's span = {concurrency:.2f}: " + (
        "the replicas ran mostly one after another" if concurrency < 1.25 else
        f"on average {concurrency:.2f} replicas were in flight at once (one waiting for the GIL or a core counts; "
        f"{cores} cores can run at most {cores})"))
    one, threads = gil["one_thread"], gil["threads"]
    spread = lambda v: f"{statistics.median(v) * 1e3:.1f} ms [{min(v) * 1e3:.1f} – {max(v) * 1e3:.1f}]"  # noqa: E731
    # the ratio of the medians as printed (ms, two decimals), so a reader can divide the two numbers shown
    one_ms, threads_ms = round(statistics.median(one) * 1e3, 2), round(statistics.median(threads) * 1e3, 2)
    gain = one_ms / threads_ms
    tie = max(threads) >= min(one) and max(one) >= min(threads)
    verdict = ("a tie (the ranges overlap): the threads gained nothing measurable" if tie else
               (f"the {world_size} threads took {1 / gain:.1f}× as long as one thread" if gain < 1 else
                f"one thread took {gain:.1f}× as long as the {world_size} threads") +
               f" (median {threads_ms:.2f} vs {one_ms:.2f} ms)")
    lines.append(f"measured here, {world_size} shards' forwards: one after another on one thread {spread(one)}; on "
                 f"{world_size} DataParallel threads {spread(threads)} — {verdict}. With {cores} cores here, a "
                 f"speed-up of at most {min(world_size, cores)}× was possible")
    return Report("\n".join(lines), _check_threads, spans=spans, one=one, threads=threads, world_size=world_size,
                  concurrency=concurrency, gain=gain, tie=tie)


def show(r: Report) -> None:
    """Print ``r``'s table, draw its picture where it has one (a ``draw`` fact), and hold the chapter's
    sentences about its numbers (``r.check()``): nothing more is printed when they hold. Returns None, so a
    notebook cell that ends with the call does not echo the table a second time."""
    print(r.text)
    if "draw" in r.facts:
        r.draw()
    r.check()


def _labels(m: dict, factor: float = 1.0) -> dict:
    """{config: the row's label}: a DDP run by its buckets' count and mean size (× ``factor``: scaled)."""
    out = {}
    for name in m["traces"]:
        calls = m["all_reduces"][name]
        mean = m["grad_bytes"] * factor / calls if calls else 0
        size = f"{mean / 1e6:.0f} MB" if mean >= 1e6 else f"{mean / 1e3:.0f} KB"
        out[name] = ("DP" if not name.startswith("DDP") else f"DDP, one bucket of {size}" if calls == 1
                     else f"DDP, {calls:.0f} buckets of ~{size}")
    return out


def _check_gpt2(r: Report) -> None:
    assert r.hidden_share_dgx > 0.5                                    # GPT-2-sized on the cluster: most hides
    assert all(1e6 < r.bucket_mb[n] * 1e6 < 1e8 for n in r.ddp_names[:-1])   # GPT-2-sized buckets: MBs
    assert all(r.exposed["DDP one bucket"] > 2 * r.exposed[n] for n in r.ddp_names[:-1])   # no overlap loses
    assert r.rows["DDP one bucket"]["hidden_dgx"] < 0.05                # one bucket: nothing hides
    # DP's broadcast and reduce cannot overlap: even NCCL's ~P each way exposes more than one bucket's all-reduce
    assert r.dp_nccl["dgx"] > r.rows["DDP one bucket"]["exposed_dgx"]
    assert r.rows["DP"]["exposed_dgx"] > r.dp_nccl["dgx"]               # the star (minipar's dp) costs more still
    assert 0 < r.rows["DP"]["exposed_dgx"] - 2 * r.star_way < r.star_way    # the star: weights, gradients, the rest
    _check_both_links(r)


def _check_both_links(r: Report) -> None:
    for slow in ("slow", "fast"):                        # the guide's measured path, both ends of its bracket
        assert all(r.rows[n][f"hidden_{slow}"] < r.rows[n]["hidden_dgx"] for n in r.ddp_names[:-1])   # slower link
        assert r.dp_nccl[slow] > r.rows["DDP one bucket"][f"exposed_{slow}"]
    assert all(r.rows[n]["exposed_slow"] > r.rows[n]["exposed_fast"] for n in r.rows)   # 0.76 GB/s exposes more


def dp_nccl_exposed(grad_bytes: float, cluster, n: int) -> float:
    """DataParallel's weights and gradients on GPUs, priced as NCCL runs them: a broadcast of the weights and a
    reduce of the gradients (:func:`minipar.machine.cluster.nccl_rooted_seconds`), about P each way on device
    0's link, none of it under compute (the batch scatter and output gather not counted)."""
    return sum(nccl_rooted_seconds(op, grad_bytes, n, cluster.intra_bw, cluster.intra_latency)
               for op in ("broadcast", "reduce"))


def _draw_gpt2(big: dict, label: dict, bucketed: str, n: int) -> None:
    """The DGX replays of one step, bucketed and one bucket, as timelines (chapter 04's drawing)."""
    import matplotlib.pyplot as plt
    from minipar.pipeline.gantt import REPLAY_KINDS, gantt_legend
    fig, axes = plt.subplots(1, 2, figsize=(11, 2.6))
    replays.draw_replays(axes, {f"cost model, DGX-A100: {label[name]}": big["dgx"][name]
                                for name in (bucketed, "DDP one bucket")}, n)
    gantt_legend(fig, REPLAY_KINDS)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    plt.show()


def gpt2_sized(m: dict) -> Report:
    """Cost model, not a measurement: ``m``'s counted traces replayed GPT-2-sized (messages × f, FLOPs × f·k,
    operator bytes × k·w) on the DGX-A100 node and on TITAN RTX cards at both ends of the guide's measured no-NVLink
    speed (:data:`.timing.GUIDE_SLOW_PATH_GBPS`); the text shows the DGX rows (labelled by their scaled buckets)
    (the TITAN RTX prices are checked, not printed); ``hidden_share_dgx`` of
    the bucketed run with the largest buckets."""
    n, dgx = m["world_size"], a100_cluster(1)
    tokens_here = 16 * 32 // n                             # global batch 16 × 32 tokens, split over N ranks
    f = replays.GPT2_SMALL_PARAMS / (m["grad_bytes"] / 4)
    k = replays.SEED_TOKENS_PER_GPU / tokens_here
    w = GPT2_WIDTH_RATIO
    slow, fast = timing.GUIDE_SLOW_PATH_GBPS
    clusters = {"dgx": dgx, "slow": timing.guide_cards(n, slow), "fast": timing.guide_cards(n, fast)}
    big = replays.replays(m, clusters, compute_factor=f * k, bytes_factor=f, op_bytes_factor=k * w)
    rows = {r["config"]: r for r in timing.table(m, big)}
    ddp_names = [name for name in rows if name.startswith("DDP")]
    bucket_mb = {name: m["grad_bytes"] * f / m["all_reduces"][name] / 1e6 for name in ddp_names}
    label = _labels(m, f)
    bucketed = ddp_names[-2]                               # the largest buckets below one bucket
    count, default_count = m["all_reduces"][bucketed], m["grad_bytes"] * f / DDP_DEFAULT_BUCKET
    lines = [f"cost model (not a measurement): one step of GPT-2 small on {n} A100s of a DGX-A100 node",
             f"  compute: the counted operators, matmuls in bf16 at {dgx.device.gemm_efficiency:.0%} of the A100's "
             f"{dgx.device.peak_flops / 1e12:.0f} TFLOP/s peak (the card's matmul efficiency, as in chapters 03, "
             "05), the rest at HBM speed; gradients on the wire in fp32, as under AMP",
             f"  link:    {link(NVLINK3)}",
             f"  buckets: this model's {count:.0f}, scaled up (~{bucket_mb[bucketed]:.0f} MB each; PyTorch's "
             f"DDP would form ~{default_count:.0f} of 25 MiB)",
             f"{'config':28}{'step ms':>8} {'exposed ms':>11} {'hidden':>7}"]
    grad_bytes = m["grad_bytes"] * f
    dp_nccl = {where: dp_nccl_exposed(grad_bytes, cluster, n) for where, cluster in clusters.items()}
    label["DP"] = "DP, star (minipar's dp)"
    lines += [f"{label[name]:28}{r['step_dgx'] * 1e3:>8.1f} {r['exposed_dgx'] * 1e3:>11.1f} {r['hidden_dgx']:>7.0%}"
              for name, r in rows.items()]
    exposed = {name: rows[name]["exposed_dgx"] for name in ddp_names}
    one = rows["DDP one bucket"]
    lines.append(f"DDP with {count:.0f} buckets hides {rows[bucketed]['hidden_dgx']:.0%} of its communication; one "
                 f"bucket hides {one['hidden_dgx']:.0%} and exposes {one['exposed_dgx'] / exposed[bucketed]:.1f}× as "
                 f"much; nn.DataParallel with NCCL (broadcast and reduce, about P each way) exposes "
                 f"{dp_nccl['dgx'] * 1e3:.1f} ms of weights and gradients, none of it under backward")
    star, way = rows["DP"]["exposed_dgx"], (n - 1) * grad_bytes / dgx.intra_bw    # (N−1)·P through device 0's link
    lines.append(f"the star row (minipar's dp, the naive model) exposes {star * 1e3:.1f} ms = {way * 1e3:.1f} weights "
                 f"out + {way * 1e3:.1f} gradients in ((N−1)·P each way) + {(star - 2 * way) * 1e3:.1f} "
                 "batch slices, gathered outputs and their gradients")
    return Report("\n".join(lines), _check_gpt2, big=big, rows=rows, f=f, k=k, w=w, bucket_mb=bucket_mb,
                  exposed=exposed, ddp_names=ddp_names, label=label, hidden_share_dgx=rows[bucketed]["hidden_dgx"],
                  dp_nccl=dp_nccl, star_way=way,
                  draw=lambda: _draw_gpt2(big, label, bucketed, n))


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
