"""Chapter 02's helpers: the Hugging Face guide's machine, D2's cost model, the reports' claims."""
import os

import pytest
import torch

from minipar.course.ch02_data_parallelism import timing


def test_titan_rtx_cards_links_and_peaks():
    from minipar.machine.cluster import PCIE3
    nvlink, pcie, fp32 = timing.titan_rtx(2), timing.titan_rtx(2, nvlink=False), timing.titan_rtx(2, fp32=True)
    assert nvlink.intra_bw == 50e9 * timing.NVLINK_BRIDGE.efficiency and pcie.intra_bw == PCIE3.beta
    assert (nvlink.device.peak_flops, nvlink.device.hbm_bandwidth, fp32.device.peak_flops) == (130e12, 672e9, 16.3e12)
    assert nvlink.devices_per_node == 2 and nvlink.nodes == 1 and "Turing" in timing.TITAN_RTX.source


def test_threads_vs_one_thread_times_the_same_shards_both_ways():
    from minipar.check import gpt_recipe
    from minipar.course.ch02_data_parallelism.measure import threads_vs_one_thread
    recipe = gpt_recipe(steps=1, batch_size=4, n_layer=1, n_embd=16)
    before = torch.get_num_threads()
    got = threads_vs_one_thread(recipe, 2, runs=3)
    assert len(got["one_thread"]) == len(got["threads"]) == 3 and min(got["one_thread"] + got["threads"]) > 0
    assert torch.get_num_threads() == before                   # the caller's thread count is restored
    with pytest.raises(ValueError, match="runs"):
        threads_vs_one_thread(recipe, 2, runs=0)


def test_dp_threads_report_calls_overlapping_ranges_a_tie():
    from minipar.course.ch02_data_parallelism import report
    tie = report.dp_threads({"one_thread": [0.010, 0.013], "threads": [0.012, 0.014]}, 2)
    tie.check()
    assert tie.tie and "a tie" in tie.text and "replica" not in tie.text       # the timing only, no span list
    faster = report.dp_threads({"one_thread": [0.020, 0.021], "threads": [0.010, 0.011]}, 2)
    assert not faster.tie and "one thread took 2.0× as long as the 2 threads (median 10.50 vs 20.50 ms)" in faster.text
    slower = report.dp_threads({"one_thread": [0.0015, 0.0016], "threads": [0.0050, 0.0052]}, 2)
    # the ratio is the printed medians' ratio: 5.10 / 1.55 = 3.3 (at one decimal, 5.1 / 1.6 would read 3.2)
    assert "the 2 threads took 3.3× as long as one thread (median 5.10 vs 1.55 ms)" in slower.text
    with pytest.raises(AssertionError):
        report.dp_threads({"one_thread": [0.01, 0.02], "threads": [0.01]}, 2).check()   # a timing missing
    at_cores = report.dp_threads({"one_thread": [0.010, 0.013], "threads": [0.012, 0.014]}, 64,
                                 {"one_thread": [0.0015, 0.0016], "threads": [0.0050, 0.0052]}, load=0.5)
    k = len(os.sched_getaffinity(0))          # 64 ranks: never fewer than this machine's cores
    assert f"no more threads than cores ({k} threads, {k} cores" in at_cores.text and not at_cores.tie_at_cores
    assert "took 3.3× as long as one thread (median 5.10 vs 1.55 ms)" in at_cores.text.splitlines()[-2]
    at_cores.check()
    assert at_cores.text.splitlines()[-1] == (f"  the machine was quiet meanwhile (load average 0.5 on {k} cores), so what "
                                              "the threads lost is mostly the GIL and their hand-offs")
    assert "0.75" not in at_cores.text and "under" not in at_cores.text   # the threshold is the fold's, not the line's
    # §5's load gate on D1 too: on a busy machine the last line does not put the loss on the GIL
    busy = report.dp_threads({"one_thread": [0.010, 0.013], "threads": [0.012, 0.014]}, 64,
                             {"one_thread": [0.0015, 0.0016], "threads": [0.0050, 0.0052]}, load=8.0 * k)
    busy.check()
    assert busy.busy and "mostly the GIL" not in busy.text
    assert busy.text.splitlines()[-1].endswith("With no more threads than cores the threads were slower than one "
                                               "thread; these runs cannot separate the GIL from that wait")
    # measured other processes' CPU decides when the run gives it, not the load average of earlier cells
    quiet_cores = {"one_thread": [0.0015, 0.0016], "threads": [0.0050, 0.0052], "other_cores": 0.02}
    alone = report.dp_threads({"one_thread": [0.010, 0.013], "threads": [0.012, 0.014]}, 64, quiet_cores, load=8.0 * k)
    alone.check()
    assert not alone.busy and alone.text.splitlines()[-1].startswith(
        f"  the machine was quiet meanwhile (other processes used 0.02 of its {k} cores), so")
    among = report.dp_threads({"one_thread": [0.010, 0.013], "threads": [0.012, 0.014]}, 64,
                              dict(quiet_cores, other_cores=1.1), load=0.1)
    among.check()
    assert among.busy and "cannot separate the GIL" in among.text.splitlines()[-1]
    loaded = report.dp_threads({"one_thread": [0.010, 0.013], "threads": [0.012, 0.014]}, 64,
                               {"one_thread": [0.0015, 0.0016], "threads": [0.0050, 0.0052]}, load=1.5 * k)
    assert loaded.busy and "a thread may have waited for a core" in loaded.text   # 1.5 a core: more tasks than cores
    busy.text = at_cores.text                 # the quiet words on a busy run: the check refuses them
    with pytest.raises(AssertionError):
        busy.check()


def test_paced_claim_needs_the_spread_unless_the_slots_ran_long():
    from types import SimpleNamespace
    from minipar.course.ch02_data_parallelism import claims, paced
    ok = SimpleNamespace(matches=True, max_abs_diff=0.0)
    m = {"seconds": {"bucket per block": [0.10, 0.11, 0.12], "one bucket": [0.13, 0.14, 0.15]},
         "matches": {"bucket per block": ok, "one bucket": ok}, "overruns": 0, "slots": 100, "load": 1.0,
         "buckets": {"bucket per block": [2e5] * 5, "one bucket": [1e6]}, "slot_s": (0.01, 0.02), "blocks": 4, "grad_bytes": 1e6}
    claims.check_overlap_saves_time_paced(m)
    assert "ranges apart" in paced.table(m) and "too busy" not in paced.table(m)
    assert "slots" not in paced.table(m) and "floor" not in paced.table(m)      # the result only: no apparatus
    assert "all-reduces of 0.2 + 0.2 + 0.2 + 0.2 + 0.2 MB" in paced.table(m)     # each bucket's size, printed
    waited = dict(m, exposed_s={"bucket per block": [0.004, 0.005, 0.006], "one bucket": [0.03, 0.03, 0.04]},
                  allreduce_s=[0.02, 0.025, 0.03])                           # timed in the steps; alone, a scale
    text = paced.table(waited)
    assert text.startswith("overlap saves 30.0 ms a step, timed on a quiet machine\n  after the last gradient, "
                           "each step still waited for its all-reduces: one bucket 30.0 ms, bucket per block 5.0 ms; "
                           "the difference, 25.0 ms, is 83% of the saving\n")
    assert len(text.splitlines()) == 5 and "slots" not in text and "alone" not in text   # the apparatus on request
    claims.check_overlap_saves_time_paced(waited, text)
    all_of_it = dict(waited, exposed_s={"bucket per block": [0.005], "one bucket": [0.0355]})   # 30.5 of a 30.0 ms saving
    assert "the difference, 30.5 ms, is about all of the saving" in paced.table(all_of_it)
    with pytest.raises(AssertionError):                                 # the one bucket must have waited longer
        claims.check_overlap_saves_time_paced(dict(waited, exposed_s={"bucket per block": [0.03], "one bucket": [0.01]}))
    parts = paced.table(waited, verbose=True)
    assert "the one bucket's all-reduce alone, no compute and the ranks started together: 25.0 [20.0 – 30.0] ms" in parts
    assert "compute floor (slots) 120 ms (0 of 100 slots ran long)" in parts.splitlines()[5]   # 4 × (10 + 20)
    assert "one bucket: step 140.0 ms = 120 slots + 30.0 waiting for the all-reduces after the last gradient + -10.0 rest" in parts
    assert "bucket per block: step 110.0 ms = 120 slots + 5.0 waiting" in parts
    tie = dict(m, seconds={"bucket per block": [0.10, 0.13, 0.15], "one bucket": [0.11, 0.12, 0.14]})
    with pytest.raises(AssertionError):
        claims.check_overlap_saves_time_paced(tie)
    claims.check_overlap_saves_time_paced(dict(tie, overruns=11))        # too busy: the times are not compared
    assert "too busy" in paced.table(dict(tie, overruns=11))
    busy = paced.table(dict(m, overruns=11))
    assert "11 of 100 slots ran long" in busy                            # a disturbed run says why
    assert "ms a step" not in busy and "110.0" not in busy                   # a disturbed run: no saving, no step times
    # both branches' printed verdict, pinned on made-up runs (no quiet machine needed): a quiet run opens with the
    # saving; a busy one (slots ran long, or the load average over twice the cores) with "no result", says it is no
    # evidence, what a quiet run shows and that D2 models it
    claims.check_overlap_saves_time_paced(m, paced.table(m))
    for disturbed in (dict(m, overruns=11), dict(m, load=100.0), dict(m, late_s=0.004),
                      dict(m, late_s=0.0002, other_cores=1.2)):
        text = paced.table(disturbed)
        assert text.startswith("no result: the machine was busy (") and "no evidence" in text
        assert "on a quiet machine the step with a bucket per block is the faster one" in text and "Deeper D2" in text
        claims.check_overlap_saves_time_paced(disturbed, text)
        with pytest.raises(AssertionError):                             # the quiet run's words on a busy run
            claims.check_overlap_saves_time_paced(disturbed, paced.table(m))
    assert "ranks woke a median 4.0 ms late from their slots" in paced.table(dict(m, late_s=0.004))
    assert "other processes used 1.2 cores" in paced.table(dict(m, late_s=0.0002, other_cores=1.2))
    woke_on_time = dict(m, load=100.0, late_s=0.0002, other_cores=0.01)   # the load average of earlier runs: not this run's
    assert paced.table(woke_on_time).startswith("overlap saves")
    claims.check_overlap_saves_time_paced(woke_on_time, paced.table(woke_on_time))
    with pytest.raises(AssertionError):                                 # the busy run's words on a quiet run
        claims.check_overlap_saves_time_paced(m, paced.table(dict(m, overruns=11)))
    assert "step 110.0 [100.0 – 120.0] ms" in paced.table(m)
    with pytest.raises(AssertionError):
        claims.check_overlap_saves_time_paced(dict(m, matches={"bucket per block": ok,
                                                              "one bucket": SimpleNamespace(matches=False)}))


def test_timeline_colours_a_bucket_hidden_before_the_last_gradient_and_exposed_after():
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.colors import to_hex
    from minipar.pipeline.gantt import KIND_COLOURS
    from minipar.course.ch02_data_parallelism.figures import draw_timeline
    events = [("forward", "forward", 0.0, 0.001), ("backward", "backward", 0.001, 0.004), ("grad", "g", 0.004, 0.004),
              ("wait", "wait", 0.004, 0.006), ("comm", "bucket 0", 0.002, 0.005)]
    fig = draw_timeline([events])
    bars = {to_hex(c.get_facecolor()[0]): c.get_paths()[0].get_extents().width
            for c in fig.axes[0].collections if len(c.get_paths())}
    assert bars[KIND_COLOURS["comm hidden"].lower()] == pytest.approx(2.0)     # 2 → 4 ms, under backward
    assert bars[KIND_COLOURS["comm exposed"].lower()] == pytest.approx(1.0)    # 4 → 5 ms, after it
    assert "#55a868" not in bars                                               # green means hidden, nothing else
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    # the step may still idle after the last gradient: the legend says when green ran, not that it cost nothing
    assert "all-reduce during backward (a tick: a bucket left)" in labels and not any("hidden" in t for t in labels)


def test_dp_and_ddp_bytes_count_what_each_sends(capsys):
    """The summary counts one direction for both: DP's device 0 sends (N−1)·P in the star model, a DDP rank
    2(N−1)/N·P, so DP's busiest sender carries N/2 times a DDP rank's, not N times; and the Sources box's range
    for the guide's slow path holds (a fp16 count, half the bytes, would not)."""
    from minipar import comm
    from minipar.course.ch02_data_parallelism import claims, show
    n, grads = 4, 1000
    counted = {"medians": {}, "grad_bytes": grads, "step_bytes_sent": comm.predicted_bytes_sent("all_reduce", grads, n),
               "dp_bytes": {"replicate model": (n - 1) * grads, "reduce grads": (n - 1) * grads}}
    show.counted_bytes(counted, n)
    out = capsys.readouterr().out
    assert "device 0 sends 3,000 B of weights" in out and "each rank sends 1,500 B" in out
    with pytest.raises(AssertionError):                  # DP counting device 0's own copy: N·P each way
        show.counted_bytes({**counted, "dp_bytes": {"replicate model": n * grads, "reduce grads": n * grads}}, n)
    capsys.readouterr()
    show.guide_slow_path(quiet=True)
    assert capsys.readouterr().out == ""
    with pytest.raises(AssertionError):
        claims.check_range_text_below_quotes(0.76 / 2, 3.4 / 2)


def test_one_line_equivalence_keeps_the_diagnostic_on_failure():
    """A match prints one short line with its tolerance; a mismatch the cell does not expect prints the full
    diagnostic (every offending tensor), an expected one its largest difference and where."""
    from minipar.check import Comparison
    from minipar.course.report import against_one_device
    ok = Comparison(True, 9.48e-06, 4.6e-4, "blocks.0.attn.qkv.bias on rank 0", [0.0], 2e-5, 1e-4)
    assert against_one_device(ok) == "= one device (max |Δ| 9e-06 ≤ 2e-05 + 0.0001·|ref|)"
    assert against_one_device(Comparison(True, 0.0, 0.0, "-", [0.0], 0, 0)) == "= one device, bit for bit"
    bad = Comparison(False, 0.06, 1.6e3, "loss at step 1 on rank 3", [0.06], 2e-5, 1e-4, ["tok_emb.weight: too far"])
    assert "DOES NOT MATCH" in against_one_device(bad) and "tok_emb.weight" in against_one_device(bad)
    assert against_one_device(bad, brief=True) == "differs from one device: max |Δ| 0.06 (at loss at step 1 on rank 3)"


def test_d2_prices_gpt2_smalls_own_operators_in_pytorchs_25_mib_buckets():
    """D2 is GPT-2 small at its own size (124M parameters, 4 × 1024 tokens per GPU, printed), priced by the
    planner's estimate with PyTorch's 25 MiB buckets (19 of them): compute from GPT-2's operators, not a toy
    trace scaled, and the hidden share ≈ (k−1)/k; its claims hold and fail when a row is wrong."""
    from minipar.course.ch02_data_parallelism import report
    from minipar.layout import Layout
    from minipar.machine.cluster import a100_cluster
    from minipar.plan import estimate
    r = report.gpt2_sized()
    assert r.buckets == 19 and r.tokens_per_gpu == 4096
    assert "124M parameters" in r.text and "4 sequences × 1024 tokens = 4,096 tokens per GPU" in r.text
    assert "25 MiB makes 19" in r.text
    e = estimate(report.GPT2_SMALL, a100_cluster(1), Layout(dp=8, micro_batch=4), precision=report.AMP)
    assert r.rows["DDP, one bucket"]["compute"] == pytest.approx(e.time["compute"] + e.time["optimizer"])
    assert 0.9 < r.hidden_share < 18 / 19 + 1e-9
    parts = r.compute_parts                                          # the compute a reader can audit, printed
    assert sum(parts.values()) == pytest.approx(r.rows["DDP, one bucket"]["compute"])
    assert parts["matmuls"] > 6 * 124e6 * 4096 / (312e12 * 0.83)     # at least 6·params·tokens at the matmul rate
    assert f"= {parts['matmuls'] * 1e3:.1f} matmuls" in r.text and f"+ {parts['adam'] * 1e3:.1f} Adam" in r.text
    # the matmul FLOPs a reader can recount: 6·(N − position table)·T + attention's QKᵀ and PV, 12·L·b·s²·h
    L, h, s, b = 12, 768, 1024, 4
    recount = 6 * (124_439_808 - s * h) * 4096 + 12 * L * b * s * s * h
    assert r.matmul_flops == pytest.approx(recount, rel=2e-3)
    rate = r.matmul_flops / parts["matmuls"]
    assert f"{r.matmul_flops / 1e12:.2f} TFLOP" in r.text and f"= {rate / 1e12:.0f} TFLOP/s" in r.text
    r.check()
    r.matmul_flops = 0.9 * r.six_nt                                  # fewer FLOPs than 6·N·T: the claim fails
    with pytest.raises(AssertionError):
        r.check()
    r.matmul_flops = 1.1 * r.six_nt
    r.rows["DDP, one bucket"]["hidden"] = 1e-3                       # one bucket cannot hide: the claim fails
    with pytest.raises(AssertionError):
        r.check()


def test_dataparallel_on_gpus_is_priced_as_nccl_broadcast_and_reduce_not_the_star():
    """On a DGX, nn.DataParallel's NCCL broadcast and reduce carry about P each way on device 0's link: GPT-2's
    498 MB of fp32 weights cost 2·(P/β + (N−1)·α) ≈ 4.3 ms at 231 GB/s, not the star's 2(N−1)·P/β ≈ 13 ms."""
    from minipar.course.ch02_data_parallelism import report
    from minipar.machine.cluster import a100_cluster
    p = 4 * 124_439_808
    priced = report.dp_nccl_exposed(p, a100_cluster(1), 4)
    assert abs(priced - 2 * (p / 231e9 + 3 * 5e-6)) < 1e-9 and 4.2e-3 < priced < 4.5e-3


def test_unused_parameters_claim_needs_each_rank_named_and_one_device():
    from types import SimpleNamespace
    from minipar.course.ch02_data_parallelism import claims
    errors = [f"rank {r}: parameter(s) ['unused.bias', 'unused.weight'] got no gradient" for r in range(2)]
    claims.check_unused_parameters(errors, SimpleNamespace(matches=True))
    for bad in ([errors[1], errors[0]], errors[:1], ["", ""]):              # wrong rank, one rank, no error
        with pytest.raises(AssertionError):
            claims.check_unused_parameters(bad, SimpleNamespace(matches=True))
    with pytest.raises(AssertionError):
        claims.check_unused_parameters(errors, SimpleNamespace(matches=False))


def test_slots_sized_from_measured_compute():
    """size_slots widens the slots to twice the compute's slow end, never under the floor nor over the ceiling."""
    from minipar.observe.paced_compute import Pacer, size_slots
    p = Pacer([], 0.01, 0.02)
    # one outlier in 20 lies above the 90th percentile (index int(0.9 * 20) = 18); in 10 it would be index 9, the max
    p.computed = {"forward": [0.001] * 19 + [0.5], "backward": [0.02] * 10}
    assert size_slots([p], (0.01, 0.02), ceiling=0.08) == (0.01, 0.04)
    assert (p.forward_s, p.backward_s, p.computed["forward"]) == (0.01, 0.04, [])
    p.computed = {"forward": [0.2] * 10, "backward": []}
    assert size_slots([p], (0.01, 0.02), ceiling=0.08) == (0.08, 0.02)


def test_the_gil_folds_quiet_machine_rule_is_the_codes():
    """D1 prints only whether the machine was quiet; its fold ("How it was measured") states the rule in words: it
    must be the thresholds the report applies (§5's paced rules: tests/test_paced_compute.py)."""
    import json
    from minipar.course import ROOT
    from minipar.course.ch02_data_parallelism.report import QUIET_LOAD_PER_CORE
    from minipar.observe.busy import OTHER_CORES
    nb = json.loads((ROOT / "notebooks" / "02_data_parallelism.ipynb").read_text())
    text = " ".join(" ".join("".join(c["source"]).split()) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert (OTHER_CORES, QUIET_LOAD_PER_CORE) == (0.25, 0.75)
    for words in ("under a quarter of a core", "a load average under 0.75 a core"):
        assert words in text, words
