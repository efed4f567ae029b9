"""Chapter 13's displays: each runs or prints what one cell shows, and holds it to the chapter's claims
(:mod:`.claims`), printing nothing more when they hold — so a cell reads ``show(...)``."""
from __future__ import annotations

import re
import statistics

import matplotlib.pyplot as plt
import torch

from minipar.debug import stragglers
from minipar.machine.cluster import h100_cluster
from minipar.machine.replay import replay

from . import bitwise, claims, lab, torch_tools
from .spikes import spiked_run

__all__ = ["show_hang", "show_desync", "show_pytorch_tools", "show_straggler", "straggler_table",
           "show_rounding", "show_gradient_bugs", "show_dropout_replicas", "show_resume", "show_nan",
           "show_spike", "show_sum_orders", "show_first_differences", "draw_first_differences", "show_invariant"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def show_hang(program, world_size: int, timeout: float):
    """The planted hang under the launcher: the flight recorder's verdict first, then the sums the failing rank
    printed, if any, then, set apart as the raw error, the launcher's own message (up to the traceback, without
    the line repeating the verdict, gloo's source path trimmed); returns the error."""
    error, seconds, left_running = lab.planted_hang(program, world_size=world_size, timeout=timeout)
    head, _, recorder = str(error).split("\n\n--- traceback")[0].partition("\n\n--- the first call")
    print("the flight recorder: the first call the ranks' records disagree on")
    print("\n".join("  " + line for line in recorder.split("---\n", 1)[-1].splitlines()))
    sums = dict(re.findall(r"^step (\d+): sum (\S+)$", error.output, re.M))
    if sums:                                  # the programs that print their sums: the silent mismatches
        print(f"rank {error.rank}'s sums before it hung (expected {world_size} × the step):  "
              + ",  ".join(f"step {s}: {v}" for s, v in sums.items()))
    print(f"\nraw error, for reference (the launcher: {type(error).__name__} after {seconds:.1f} s; "
          f"processes left running: {left_running})")
    for line in head.splitlines():
        if "parted from the others" not in line:
            print("  " + re.sub(r"\[/\S+\] ", "", line))        # gloo's build path says nothing here
    claims.check_hang_where_ranks_parted(left_running, error)
    claims.check_silent_mismatch_sums(sums, world_size)
    return error


def show_desync() -> None:
    """The shape mismatch under ``desync_check``: what the ranks raise."""
    error, seconds = lab.desync_failure()
    print(f"{type(error).__name__} on rank {error.rank} after {seconds:.1f} s:")
    print(lab.first_error_line(error))
    claims.check_desync_caught_before_hang(error)


def _fingerprints(message: str) -> str:
    """DETAIL's message cut to what it says: which rank ran which call with which shape ("Rank 0 … [4] …")."""
    found = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                       r"OpType=(\w+), TensorShape=(\[[^\]]*\])", message)
    return ", but ".join(f"Rank {r} … SequenceNumber={n}, OpType={op}, TensorShape={shape}"
                         for r, n, op, shape in found) if len(found) == 2 else message


def show_pytorch_tools(started):
    """What DETAIL and the Flight Recorder said in the process started at the top of the chapter: rank 0's
    mismatch, cut to its two fingerprints, then rank 0's Flight Recorder entries on one line (the chapter reads
    them in a box); returns every rank's full message, folded."""
    from IPython.display import Markdown
    reports = torch_tools.collect(started)
    print(f"DETAIL's error on rank 0: {_fingerprints(torch_tools.detail_message(reports[0]))}")
    entries = reports[0]["recorded"]
    states = sorted({state for _, _, state in entries})
    print("rank 0's Flight Recorder (op, input sizes): "
          + ", ".join(f"{op.split(':')[-1]} {sizes}" for op, sizes, _ in entries)
          + f"; state of every entry: {', '.join(states)}")
    claims.check_every_rank_reports_mismatch(reports)
    full = "\n".join(f"rank {r['rank']}: {torch_tools.detail_message(r)}" for r in reports)
    return Markdown(f"<details><summary>DETAIL's full messages, every rank</summary>\n\n```\n{full}\n```\n</details>")


def straggler_table(run, skip: int = 1) -> dict:
    """Per rank, medians over the steps after the first ``skip`` (set-up): compute in CPU time (the work done),
    the wall time inside the all-reduce, the wall step, and "other": the wall step's rest (waiting for a
    core, Python)."""
    cpu = stragglers.per_rank_steps(run.trace, clock="cpu")
    wall = stragglers.per_rank_steps(run.trace, clock="wall")
    rows = {}
    for c, w in zip(cpu, wall):
        med = lambda xs: statistics.median(xs[skip:])     # noqa: E731
        rows[c.rank] = {"cpu": med(c.compute), "comm": med(w.comm), "step": med(w.total)}
        rows[c.rank]["other"] = rows[c.rank]["step"] - rows[c.rank]["cpu"] - rows[c.rank]["comm"]
    return rows


def show_straggler(run):
    """Each rank's step split into CPU compute and the all-reduce (medians over steps 1 on, counted from 0; a footnote when a
    rank also waited long for a core),
    and the straggler named and priced against the wall step; returns it. The trace replayed on one DGX H100
    node (NVLink: microseconds on the wire) holds the chapter's sentence that the straggler's share is larger
    there; it prints nothing."""
    rows = straggler_table(run)
    slow = stragglers.find_straggler(run.trace, clock="cpu", skip=1)
    steps = len(stragglers.per_rank_steps(run.trace)[0].compute)
    print(f"ms a step, median of steps 1-{steps - 1}  compute (CPU time)  in the all-reduce  wall step")
    for rank, r in rows.items():
        print(f"rank {rank}{'':28}{r['cpu'] * 1e3:18.1f}{r['comm'] * 1e3:19.1f}{r['step'] * 1e3:11.1f}")
    wall_step = max(r["step"] for r in rows.values())
    cpu = sorted(r["cpu"] for r in rows.values())
    shown = [round(c * 1e3, 1) for c in (cpu[0], cpu[-1])]   # the ratio of the values printed above
    print(f"{run.trace.meta['planted']}: its compute is {shown[1] / shown[0]:.1f}x the other rank's CPU time")
    print(f"rank {slow.rank} is the straggler: {_ms(slow.cost)} more CPU time a step than the other rank, "
          f"{slow.cost / wall_step:.0%} of the {_ms(wall_step)} wall step; the other rank waits for it "
          "inside the all-reduce.")
    # CPU time counts every thread, so it can pass the wall time it spans: "other" is floored at 0. On this
    # shared CPU a rank may also wait for a core; a footnote only when that is a noticeable part of the step
    for rank, r in rows.items():
        if max(0.0, r["other"]) > 0.1 * wall_step:
            print(f"(rank {rank} also waited {_ms(r['other'])} a step for a core: this machine's cores are shared)")
    claims.check_stragglers_which_rank_makes_others(slow, rows)
    _straggler_replay(run, slow, wall_step)
    return slow


def _straggler_replay(run, slow, wall_step) -> None:
    """The trace replayed on one DGX H100 node, as run and without the straggler: the straggler's share of a
    replayed step is larger than its share measured here (checked, not printed)."""
    cluster = h100_cluster(1)
    as_run = replay(run.trace, cluster)
    fixed = replay(stragglers.without_straggler(run.trace, slow.rank), cluster)
    median = lambda gaps: sorted(gaps)[len(gaps) // 2]   # noqa: E731
    step, step_fixed = median(as_run.step_gaps()), median(fixed.step_gaps())
    claims.check_microseconds_wire(step, step_fixed, as_run, slow, wall_step)


def show_rounding() -> float:
    """A correct DDP run against one device in float32 and float64; returns the first-departure search's tolerance: the
    measured float64 rounding times a safety factor of 1000 (empirical, not a bound)."""
    noise = lab.rounding_study()
    for dtype, d in noise.items():
        print(f"correct DDP vs one device, {str(dtype)[6:]}: largest departure {d:.1e} "
              f"({d / torch.finfo(dtype).eps:.0f} x the dtype's epsilon)")
    tolerance = 1e3 * noise[torch.float64]
    print(f"tolerance for the first-departure search, in float64: 1000 x its measured rounding = {tolerance:.0e}")
    claims.check_few_epsilons(noise)
    return tolerance


def show_gradient_bugs(tolerance: float) -> None:
    """The three planted gradient bugs, each searched against one device; first the control, the same TP and
    ring launches' correct runs."""
    found, controls = lab.planted_gradient_bugs(tolerance)
    print("control, correct runs: largest departure " + ", ".join(f"{name} {d:.1e}" for name, d in controls.items())
          + f", both under the tolerance {tolerance:.0e}")
    claims.check_controls_under_tolerance(controls, tolerance)
    for bug, result in found.items():
        print(f"{bug}:\n  {_backward_order_first(result)}")
        claims.check_first_divergence_found(result, step=2 if bug.startswith("DDP") else 0)
    claims.check_silent_wrong_gradients_equality_harness(*found.values())


def _backward_order_first(result) -> str:
    """How many parameters depart first (the line that tells the bugs apart), then the informative name (the
    first parameter to depart in backward order, and those backward reached before it while still right)."""
    first, right = result.first, result.reached_first[::-1]
    after = ", ".join(right[:4]) + (f" (+{len(right) - 4})" if len(right) > 4 else "") or "none"
    return (f"{len(result.wrong)} of {len(result.order)} parameters depart at step {first.step} "
            f"({first.name} by {first.size:.1e})\n"
            f"  departing, by module: {_by_module(result.wrong, result.order)}\n"
            f"  first to depart in backward order: {result.boundary}; reached before it, still right: {after}")


def _module(name: str) -> str:
    """A parameter's module at the level that tells bugs apart: the block (``blocks.1``) or the top-level module."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def _by_module(wrong, order) -> str:
    """``wrong`` grouped by :func:`_module`, in model order, as 'module departing/all'."""
    modules = list(dict.fromkeys(_module(n) for n in order))
    counts = {m: (sum(_module(n) == m for n in wrong), sum(_module(n) == m for n in order)) for m in modules}
    return ", ".join(f"{m} {w}/{a}" for m, (w, a) in counts.items() if w)


def show_dropout_replicas() -> None:
    """Replicated parameters on 2 TP ranks by Megatron's rule and by a per-rank seed (max |Δ| between the
    copies); the split-region masks are held to the rule silently (chapter 06 §5 shows them)."""
    right, wrong = lab.dropout_replicas(wrong_rule=False), lab.dropout_replicas(wrong_rule=True)
    print(f"replica_spread after 2 steps: max |Δ| between the 2 TP ranks' copies\n"
          f"{'parameter':<20}{'Megatron rule':>14}{'seeded by rank':>16}")
    for name in right:
        print(f"{name:<20}{right[name]:>14.1e}{wrong[name]:>16.1e}")
    masks = lab.split_region_masks()
    claims.check_randomness_across_ranks(right, wrong, masks)


def show_resume() -> None:
    """4 steps straight against stopped after 2 and resumed, without and with the RNG state."""
    for restore in (False, True):
        straight, resumed = lab.resumed_losses(restore_rng=restore)
        print(f"RNG state restored: {restore!s:<5}  losses of steps 3, 4: uninterrupted "
              + ", ".join(f"{x:.6f}" for x in straight) + " | resumed " + ", ".join(f"{x:.6f}" for x in resumed))
        claims.check_resume_restores_random_state(straight, resumed, restore)


def show_nan() -> None:
    """The float16 overflow on 2 ranks under ``first_nonfinite``, and ``detect_anomaly`` on the same step."""
    ranks = lab.overflow_run()
    for rank, (found, loss, grads_finite) in enumerate(ranks):
        born = (str(found).removeprefix(f"rank {rank}: ") if found else
                "nothing" + ("" if grads_finite else ": its non-finite gradients came through the all-reduce"))
        print(f"rank {rank}: loss {loss:.4g}; gradients after the all-reduce: "
              f"{'finite' if grads_finite else 'not finite'}\n"
              f"        non-finite value born on rank {rank}: {born}")
    print("torch.autograd.detect_anomaly on rank 1's step:", lab.anomaly_on())
    (born0, _, finite0), (born1, _, _) = ranks
    claims.check_nan_first_operator_rank_that(born0, finite0, born1)


def show_spike(bad_step: int = 12, guard: float = 5.0, clip: float = 1.0) -> None:
    """The MLP with one batch of outliers: no guard, clipping ‖g‖ at ``clip``, and the skip guard; norms and
    losses, drawn."""
    runs = {"no guard": spiked_run(None, bad_step), f"clip ‖g‖ at {clip:g}": spiked_run(None, bad_step, clip=clip),
            f"skip if ‖g‖ > {guard:g} × median": spiked_run(guard, bad_step)}
    plain, clipped, guarded = runs.values()
    print(f"‖g‖ before step {bad_step}: {min(plain['norm'][:bad_step]):.2f}–{max(plain['norm'][:bad_step]):.2f}; "
          f"at step {bad_step}: {plain['norm'][bad_step]:.1f}. Held-out loss before step {bad_step}: "
          f"{plain['loss'][bad_step - 1]:.3f}")
    corrupt = corrupt_shard_runs(bad_step, guard, clip)   # the second spike: end losses only, in the last column
    print(f"{'held-out loss':24}   {'outliers at step ' + str(bad_step):<22}   "
          f"corrupt shard, steps {bad_step}–{bad_step + CORRUPT_STEPS - 1}\n"
          f"{'':24}   {'after it':>8}  {'at the end':>10}   {'at the end':>10}")
    for (name, r), c in zip(runs.items(), corrupt.values()):
        print(f"{name:24}   {r['loss'][bad_step]:>8.3f}  {r['loss'][-1]:>10.3f}   {c['loss'][-1]:>10.3f}"
              + (f"   (skipped {_steps(r['skipped'])}; {_steps(c['skipped'])})" if r["skipped"] else ""))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.2))
    for name, r in runs.items():
        a.plot(r["norm"], marker=".", label=name)
        b.plot(r["loss"], marker=".", label=name)
    a.set(yscale="log", xlabel="step", ylabel="gradient norm ‖g‖")
    b.set(yscale="log", xlabel="step", ylabel="loss on a held-out batch")
    b.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    claims.check_spike_skipped(plain, guarded, bad_step)
    claims.check_clipping_bounds_the_step(clipped, bad_step, clip)
    claims.check_clipping_handled_this_spike(clipped, guarded, plain)


CORRUPT_STEPS = 6     # the corrupt shard's batches in a row


def _steps(steps: list) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}" if steps else "none"


def corrupt_shard_runs(bad_step: int = 12, guard: float = 5.0, clip: float = 1.0, bad_steps: int = CORRUPT_STEPS) -> dict:
    """A second spike: ``bad_steps`` batches in a row whose targets are flipped and ×30 (inputs clean). Clipping takes each
    harmful step at length ``clip``; the guard skips them all. The three runs (about 0.2 s), held to the claim."""
    runs = {"no guard": spiked_run(None, bad_step, bad_steps=bad_steps, flipped=True),
            f"clip at {clip:g}": spiked_run(None, bad_step, clip=clip, bad_steps=bad_steps, flipped=True),
            "skip guard": spiked_run(guard, bad_step, bad_steps=bad_steps, flipped=True)}
    plain, clipped, guarded = runs.values()
    claims.check_skip_guard_beats_clipping_on_a_corrupt_shard(plain, clipped, guarded, bad_step, bad_steps)
    return runs


def show_sum_orders() -> None:
    """The same 4096 float32 numbers summed in five orders, with their distance in ULPs."""
    sums = bitwise.sum_orders()
    exact = torch.tensor(sums["exact, rounded once"][0], dtype=torch.float32)
    from_exact = {order: int(bitwise.ulp_distance(torch.tensor(value, dtype=torch.float32), exact))
                  for order, (value, _) in sums.items()}
    for order, (value, ulps) in sums.items():
        print(f"{order:<38} {value:.9f}   {ulps:>3} ULP from left to right, {from_exact[order]:>3} from exact")
    print(f"five orders, {len({v for v, _ in sums.values()})} different floats, "
          f"up to {max(u for _, u in sums.values())} ULP apart from left to right")
    claims.check_sum_orders(sums)
    claims.check_split_sums_no_further_from_exact(from_exact)


def show_first_differences():
    """One device against each layout: the first tensor that differs in any bit. Returns the diffs and what
    :func:`draw_first_differences` draws."""
    diffs, profiles, names = bitwise.first_differences()
    for layout, diff in diffs.items():
        print(f"one device vs {layout}: {diff}\n")
    claims.check_first_differences(diffs)
    return diffs, (profiles, names)


def draw_first_differences(drawn) -> None:
    """Max ULPs from one device of every tensor, in execution order, one marker style per layout."""
    bitwise.draw_profiles(*drawn)
    plt.show()


def show_invariant() -> None:
    """Each layout against one device in the invariant mode, and a tp 2 step's seconds in both modes."""
    invariant = bitwise.invariant_demo()
    inv_diffs, seconds = invariant
    for layout, diff in inv_diffs.items():
        print(f"invariant mode, one device vs {layout}: {diff}")
    (default, lo_d, hi_d), (inv, lo_i, hi_i) = seconds["default"], seconds["invariant"]
    print(f"tp 2 step here (median, min-max over its steps): {_ms(default)} ({lo_d * 1e3:.1f}-{hi_d * 1e3:.1f}) "
          f"default, {_ms(inv)} ({lo_i * 1e3:.1f}-{hi_i * 1e3:.1f}) invariant: "
          + (f"{inv / default:.1f}x, outside the spread" if lo_i > hi_d else "a tie, the ranges overlap")
          + " (indicative: this machine's cores are shared)")
    claims.check_invariant_mode(invariant)
