"""Chapter 02's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import statistics

import torch.utils.data as tud

from minipar import comm
from minipar.check import compare
from minipar.observe.busy import run_disturbed
from minipar.observe.paced_compute import verdict


def check_why_averaging_shard_gradients_exact(worst) -> None:
    """Why averaging shard gradients is exact"""
    assert worst < 1e-6


def check_dataparallel_one_process_threads_five(got, want, rules) -> None:
    """DataParallel: one process, threads, five exchanges through device 0"""
    assert all(got[name] == want[name] for name in rules)


def check_same_training_as_one_device(reference, G, runs) -> None:
    """A parameter server: the server's link carries everything: same training as one device"""
    assert all(compare(reference, [r for r, *_ in out]).matches and out[0][1] == (n - 1) * G
               and all(s == G for _, s, *_ in out[1:]) for n, out in runs.items())


def check_ddp_from_scratch(formula, out, one) -> None:
    """DDP from scratch"""
    assert all(sent == formula for _, sent, _ in out) and one.matches and one.max_abs_diff == 0


def check_ours_matches_torch_ddp(diffs) -> None:
    """DDP from scratch"""
    assert all(g <= 1e-7 and p <= 1e-6 for g, p in diffs)


def check_buckets_left_during_backward(summary) -> None:
    """Overlap: the bucket timeline: buckets left during backward"""
    assert all(s["buckets"] > 1 and s["first_launch_ms"] < s["last_grad_ms"] for s in summary)   # buckets left during backward
    assert all(s["last_grad_ms"] <= s["reduced_ms"] for s in summary)       # the drawn backward ends before the wait


def check_which_examples_each_rank_sees(same, mine, L, N) -> None:
    """Which examples each rank sees: the distributed sampler"""
    assert all(same) and mine == [list(tud.DistributedSampler(range(L), N, r, shuffle=False)) for r in range(N)]


def check_global_batch_gradient_accumulation(checks, formula, out) -> None:
    """Global batch and gradient accumulation"""
    assert all(c.matches for c in checks) and all(per_rank[0][1] == formula for per_rank in out.values())


def check_pitfall_no_sync_used_wrongly(seen, falls=None) -> None:
    """The pitfall: `no_sync` used wrongly: the replicas drift and differ from one device, yet the mean loss
    falls in both runs (``falls``: {wrong: last step's mean loss below the first's})"""
    assert seen == {False: (True, True), True: (False, False)}
    assert falls is None or all(falls.values())


def check_unused_parameters(errors, c) -> None:
    """Unused and frozen parameters: each rank's error names it and the parameters; with the option the
    run equals one device"""
    assert all(e.startswith(f"rank {r}: parameter(s) ['unused.bias', 'unused.weight']") for r, e in enumerate(errors))
    assert len(errors) > 1 and c.matches


def check_dp_against_ddp_measured_here(counted, grads, N, dp_bytes) -> None:
    """DP against DDP: measured here, replayed here and on a named cluster"""
    assert counted["step_bytes_sent"] == comm.predicted_bytes_sent("all_reduce", grads, N) and dp_bytes["replicate model"] + dp_bytes["reduce grads"] == 2 * (N - 1) * grads


def check_range_text_below_quotes(slowest, fastest) -> None:
    """DP against DDP: measured here, replayed here and on a named cluster: the range the text below quotes"""
    assert 0.7 < slowest < 0.8 and 3.3 < fastest < 3.5


def check_overlap_saves_time_paced(m, text: str | None = None) -> None:
    """Overlap: the bucket timeline: paced, a bucket per block is faster than one bucket outside the spread (a
    median outside the other's [min – max]; unless other load took the cores: more than 5 % of the slots ran
    long, other processes used over a quarter of a core, or the ranks woke a median over 1 ms late from their
    slots: :func:`minipar.observe.busy.disturbed`), and both equal one device. The printed
    ``text`` opens with the saving when the run counts, and says it was timed on a quiet machine; otherwise with
    "no result", says the run is no evidence, what a quiet run shows and where it is modelled (D2), and states no
    saving and no step time."""
    assert all(c.matches for c in m["matches"].values())
    busy = run_disturbed(m)
    if not busy:
        assert verdict(m["seconds"]["bucket per block"], m["seconds"]["one bucket"]) != "tie"
    if text is not None:
        first = text.splitlines()[0]
        if busy:
            assert first.startswith("no result: the machine was busy") and "no evidence" in first
            assert "on a quiet machine" in text and "D2" in text and " ms a step" not in text      # no saving stated
            assert text.count("step time not shown") == len(m["seconds"])              # no step time printed
        else:
            assert first.startswith("overlap saves ") and first.endswith("timed on a quiet machine")
            assert "no result" not in text and "no evidence" not in text
    if not busy and "exposed_s" in m:                   # the wait after the last gradient: the buckets hid part of it
        waits = [statistics.median(s) for s in (m["exposed_s"]["bucket per block"], m["exposed_s"]["one bucket"])]
        assert waits[0] < waits[1]
