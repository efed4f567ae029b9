"""Chapter 02's core cells, shown: each function prints what one cell measured (a small table), draws where
the cell has a picture, and holds the chapter's sentences about those numbers (:mod:`.claims`), printing nothing
more when they hold. The cells keep the runs; the formatting and the checks live here."""
from __future__ import annotations

import torch.utils.data as tud

from minipar import comm
from minipar.check import compare
from minipar.data import dp
from minipar.data.sampler import DistributedSampler
from minipar.course.report import against_one_device

from . import claims, timing
from .measure import timeline_summary

__all__ = ["averaging", "dp_exchanges", "parameter_server", "ddp_bytes", "ours_vs_torch", "timeline",
           "paced_overlap", "sampler", "accumulation", "no_sync", "summary_bytes", "counted_bytes",
           "guide_slow_path"]

DP_RULES = {"scatter inputs": "(N-1)/N·|x|", "replicate model": "(N-1)·P", "gather outputs": "(N-1)/N·|y|",
            "scatter output grads": "(N-1)/N·|y|", "reduce grads": "(N-1)·P"}


def averaging(worst: float, n: int) -> None:
    """§1: the largest difference between the full-batch gradient and the mean of ``n`` shard gradients."""
    print(f"max |full-batch gradient − mean of {n} shard gradients| = {worst:.1e}  (float summation order only)")
    claims.check_why_averaging_shard_gradients_exact(worst)


def dp_exchanges(reference, result, log, recipe, n: int, grad_bytes: int) -> None:
    """§2: DataParallel against one device, then its five exchanges of one step (``log``), measured beside
    :func:`minipar.data.dp.predicted_exchange_bytes`."""
    c = compare(reference, [result])
    print(f"DP on {n} thread-driven replicas {against_one_device(c)}")
    x, _ = recipe.batches[0]
    out_bytes = x.numel() * recipe.model().cfg.vocab_size * 4                 # the logits, fp32
    want = dp.predicted_exchange_bytes(n, grad_bytes, x.numel() * x.element_size(), out_bytes)
    got = log.by_exchange()
    print(f"\n{'exchange':<22}{'measured B':>12}{'formula B':>12}   which formula")
    for name, rule in DP_RULES.items():
        print(f"{name:<22}{got[name]:>12,}{want[name]:>12,.0f}   {rule}")
    print(f"all through device 0: {log.bytes:,} bytes per step")
    c.assert_ok()
    claims.check_dataparallel_one_process_threads_five(got, want, DP_RULES)


def parameter_server(runs: dict, reference, grad_bytes: int) -> None:
    """§3: ``runs`` = {N: per rank (RunResult, bytes sent per step)}: the server's bytes and a worker's, beside
    (N−1)·P and a ring all-reduce's 2(N−1)/N·P; then each N's run against one device."""
    print(f"{'N':>2} {'server sends':>14} {'= (N-1)·P':>12} {'a worker sends':>15} "
          f"{'ring all-reduce 2(N-1)/N·P':>28}")
    for n, out in runs.items():
        print(f"{n:>2} {out[0][1]:>14,.0f} {(n - 1) * grad_bytes:>12,} {out[1][1]:>15,.0f} "
              f"{comm.predicted_bytes_sent('all_reduce', grad_bytes, n):>28,.0f}")
    for n, out in runs.items():
        print(f"parameter server on {n} ranks {against_one_device(compare(reference, [r for r, *_ in out]))}")
    claims.check_same_training_as_one_device(reference, grad_bytes, runs)


def ddp_bytes(out: list, one, reference, grad_bytes: int, n: int) -> None:
    """§4: ``out`` = per rank (RunResult, bytes sent per step, all-reduces per step) of DDP on ``n`` ranks;
    ``one`` = the same on one rank, compared bit for bit (nothing is reordered)."""
    c = compare(reference, [r for r, _, _ in out])
    one = compare(reference, [r for r, _, _ in one], atol=0, rtol=0)
    print(f"DDP on {n} ranks {against_one_device(c)}")
    formula = comm.predicted_bytes_sent("all_reduce", grad_bytes, n)
    for rank, (_, sent, calls) in enumerate(out):
        print(f"rank {rank}: {sent:,.0f} bytes sent per step in {calls:.0f} all-reduces; 2(N-1)/N·P = {formula:,.0f}")
    print(f"DDP on one rank {against_one_device(one)}")
    c.assert_ok()
    claims.check_ddp_from_scratch(formula, out, one)


def ours_vs_torch(diffs: list) -> None:
    """§4: per rank (max |Δ gradient| over the steps, max |Δ parameter| at the end), minipar's DDP against
    torch's."""
    print("minipar's DDP vs torch's, per rank: max |Δ gradient| (any step), max |Δ parameter| (end):",
          ", ".join(f"{g:.0e} / {p:.0e}" for g, p in diffs))
    claims.check_ours_matches_torch_ddp(diffs)


def timeline(per_rank: list) -> None:
    """D4: draw rank 0's measured DDP step (:func:`.figures.draw_timeline`) and print when its first bucket left
    and when backward ended (its last gradient); the claim holds it on every rank. Not when every bucket was
    reduced, nor a hidden share: on 2 shared cores those say how busy the cores were, not what overlap saves
    (the paced run does), and the other ranks' bars would show the same noise."""
    import matplotlib.pyplot as plt
    from .figures import draw_timeline
    draw_timeline(per_rank[:1])
    plt.show()
    summary = [timeline_summary(events) for events in per_rank]
    s = summary[0]
    print(f"rank 0: {s['buckets']} buckets; the first left {s['first_launch_ms']:.1f} ms into backward, "
          f"the last gradient came {s['last_grad_ms']:.1f} ms into backward")
    claims.check_buckets_left_during_backward(summary)


def paced_overlap(m: dict) -> None:
    """§5: the paced run (:func:`.paced.measure`): each configuration's buckets, step times and the saving."""
    from .paced import table
    text = table(m)
    print(text)
    claims.check_overlap_saves_time_paced(m, text)


def sampler(mine: list, length: int, n: int, epoch: int = 5, seed: int = 3) -> None:
    """§6: each rank's indices (``mine``, no shuffle), then minipar's shuffled sampler against
    ``torch.utils.data.DistributedSampler`` at ``epoch``, on every rank."""
    print(f"{length} examples on {n} ranks, no shuffle: padded to {n * -(-length // n)}")
    for r in range(n):
        print(f"  rank {r}: {mine[r]}")
    same = []
    for r in range(n):
        a, b = DistributedSampler(length, n, r, seed=seed), tud.DistributedSampler(range(length), n, r, seed=seed)
        a.set_epoch(epoch), b.set_epoch(epoch)
        same.append(list(a) == list(b))
    print(f"shuffled, epoch {epoch}: identical to torch.utils.data.DistributedSampler on every rank: {all(same)}")
    claims.check_which_examples_each_rank_sees(same, mine, length, n)


def accumulation(out: list, reference, grad_bytes: int, n: int, global_batch: int) -> None:
    """§7: ``out`` = {k: per rank (RunResult, bytes/step, all-reduces/step)} for k micro-batches a step."""
    checks = [compare(reference, [r for r, _, _ in per_rank]) for per_rank in out.values()]
    formula = comm.predicted_bytes_sent("all_reduce", grad_bytes, n)
    print(f"per-rank batch {global_batch // n} sequences, global batch {global_batch}")
    print(f"{'micro-batches k':>16} {'micro-batch':>12} {'bytes/step':>12} {'bytes/micro-batch':>18} "
          f"{'all-reduces/step':>17}  matches 1 device")
    for (k, per_rank), c in zip(out.items(), checks):
        _, sent, calls = per_rank[0]
        print(f"{k:>16} {global_batch // n // k:>12} {sent:>12,.0f} {sent / k:>18,.0f} {calls:>17.0f}  "
              f"{c.matches} (max |Δ| {c.max_abs_diff:.0e})")
    claims.check_global_batch_gradient_accumulation(checks, formula, out)


def no_sync(runs: dict, reference) -> None:
    """§8: ``runs`` = {wrong: per rank (replicas in sync, RunResult, [its own shard's loss each step])}, with
    ``no_sync`` used rightly and wrongly: each run against one device, then each rank's loss and the mean."""
    seen, falls = {}, {}
    for wrong, out in runs.items():
        c = compare(reference, [r for _, r, _ in out])
        seen[wrong] = (all(ok for ok, _, _ in out), c.matches)
        mean = out[0][1].losses                 # the mean over ranks, the same on every rank
        k = max(range(len(mean)), key=lambda s: abs(mean[s] - reference.losses[s]))
        verdict = (f"differs from one device: the mean loss of step {k + 1}, {mean[k]:.3f} against one device's "
                   f"{reference.losses[k]:.3f}" if not c.matches else against_one_device(c))
        print(f"{'WRONG' if wrong else 'right'}: replicas in sync: {seen[wrong][0]}; {verdict}")
        falls[wrong] = mean[-1] < mean[0]
        ranks = " | ".join(" → ".join(f"{v:.3f}" for v in mine) for _, _, mine in out)
        print(f"  loss by step, each rank's shard: {ranks}; mean {' → '.join(f'{v:.3f}' for v in mean)}")
    claims.check_pitfall_no_sync_used_wrongly(seen, falls)


def unused(errors: list, c) -> None:
    """§8's aside: ``errors`` = each rank's error without ``find_unused_parameters``; ``c`` the comparison with
    one device with it (:func:`.measure.unused_branch`)."""
    for error in errors:
        print("without the option:", error.split(";")[0])
    print(f"find_unused_parameters=True: {against_one_device(c)}")
    claims.check_unused_parameters(errors, c)


def summary_bytes(dp_log, ddp_out: list, grad_bytes: int, n: int) -> None:
    """Summary: the bytes of one step already counted, on the first cell's model: DP's device 0 in §2 (``dp_log``,
    star model: it sends (N−1)·P of weights and receives (N−1)·P of gradients) against a DDP rank in §4
    (``ddp_out`` = per rank (RunResult, bytes sent a step, all-reduces)), 2(N−1)/N·P; their ratio is N/2. Silently
    also the arithmetic on the Hugging Face guide's table (:func:`guide_slow_path`)."""
    dp_bytes, ddp_sent = dp_log.by_exchange(), ddp_out[0][1]
    print(f"one step on {n} devices, bytes counted in §2 and §4: DP's device 0 sends {dp_bytes['replicate model']:,} B "
          f"of weights and receives {dp_bytes['reduce grads']:,} B of gradients, (N−1)·P each way; a DDP rank sends "
          f"{ddp_sent:,.0f} B, 2(N−1)/N·P: device 0 sends {dp_bytes['replicate model'] / ddp_sent:.0f}× as much (N/2)")
    claims.check_dp_against_ddp_measured_here({"step_bytes_sent": ddp_sent}, grad_bytes, n, dp_bytes)
    guide_slow_path(quiet=True)


def counted_bytes(counted: dict, n: int) -> None:
    """The bytes of one step each (``counted`` = :func:`.bench.run`): DP's device 0 sends (N−1)·P in the star
    model, a DDP rank 2(N−1)/N·P."""
    from .bench import describe_run
    print(describe_run(counted))
    claims.check_dp_against_ddp_measured_here(counted, counted["grad_bytes"], n, counted["dp_bytes"])


GUIDE = timing.GUIDE   # the guide's table (GPT-2 small on two TITAN RTX)


def guide_slow_path(quiet: bool = False) -> None:
    """Arithmetic on the Hugging Face guide's table (:data:`GUIDE`, not a measurement): its DDP without NVLink
    all-reduces GPT-2 small's fp32 gradients, 2(N−1)/N·P a rank, each step; the slow path's speed if that took
    only the extra seconds over DDP with NVLink, or the whole step."""
    per_rank = comm.predicted_bytes_sent("all_reduce", GUIDE["params"] * 4, GUIDE["ranks"])
    extra = (GUIDE["ddp_no_nvlink_s"] - GUIDE["ddp_nvlink_s"]) / GUIDE["steps"]
    whole_step = GUIDE["ddp_no_nvlink_s"] / GUIDE["steps"]
    fastest, slowest = per_rank / extra / 1e9, per_rank / whole_step / 1e9
    if not quiet:
        print(f"Hugging Face guide: DDP without NVLink takes {1e3 * extra:.0f} ms more per step ({1e3 * whole_step:.0f} "
              f"ms in all); each rank all-reduces {per_rank / 1e6:.0f} MB per step, so the slow path moved between "
              f"{slowest:.2f} GB/s (if the all-reduce took the whole step) and {fastest:.1f} GB/s (if it took only the "
              "extra time)")
    claims.check_range_text_below_quotes(slowest, fastest)
