"""``python -m minipar bench ddp`` times PyTorch's DDP like for like (``gradient_as_bucket_view=True``, as
minipar's gradients are bucket views) and its default beside it, and prints minipar's ratio to each (issue 51)."""
import math
import threading
import time

from minipar.course.ch02_data_parallelism import bench, bench_where


def test_bench_ddp_times_both_torch_ddps_and_prints_both_ratios(capsys):
    assert bench.main(["--ranks", "2", "--layers", "1", "--embd", "16", "--batch", "4", "--seq", "8",
                       "--iters", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("minipar DDP", bench.TORCH_VIEW, bench.TORCH_DEFAULT):
        assert f"  {name:<28} median step" in out, out
    assert f"minipar / {bench.TORCH_VIEW} (like for like, the ratio)" in out, out
    assert f"minipar / {bench.TORCH_DEFAULT} (extra column)" in out, out
    assert "gradient_as_bucket_view=True" in out


def test_ratios_are_per_run_sorted_against_the_named_torch_ddp():
    runs = [{"minipar DDP": 2.0, bench.TORCH_VIEW: 2.0, bench.TORCH_DEFAULT: 4.0},
            {"minipar DDP": 1.0, bench.TORCH_VIEW: 2.0, bench.TORCH_DEFAULT: 0.5}]
    assert bench.ratios(runs) == [0.5, 1.0]
    assert bench.ratios(runs, bench.TORCH_DEFAULT) == [0.5, 2.0]


def test_bench_ddp_where_prints_cpu_per_phase_for_the_model_alone_and_both_ddps(capsys):
    assert bench.main(["--where", "--ranks", "2", "--layers", "1", "--embd", "16", "--batch", "4", "--seq", "8",
                       "--iters", "1"]) == 0
    out = capsys.readouterr().out
    for phase in bench_where.PHASES + ("DDP in backward (vs model alone)", "all threads, whole step"):
        assert f"  {phase:<32}" in out, out
    assert "minipar's reducer, main thread: bucket bookkeeping" in out and "minipar / torch DDP, all threads" in out


def test_describe_where_subtracts_the_model_alone_and_sums_every_thread():
    table = {bench_where.ALONE: {"forward": 1.0, "backward": 2.0, "optimizer step": 0.5, "other threads": 0.5},
             bench_where.OURS: {"forward": 1.0, "backward": 3.5, "optimizer step": 0.5, "other threads": 2.0},
             bench_where.THEIRS: {"forward": 1.5, "backward": 3.0, "optimizer step": 0.5, "other threads": 1.0}}
    parts = {"bucket bookkeeping": 0.25, "copies into buckets": 0.5, "divide by N": 0.0,
             "launching all-reduces": 0.5, "end of backward": 0.0}
    lines = bench_where.describe({"table": table, "parts": parts, "ranks": 2}).splitlines()
    ddp_line = next(line for line in lines if "DDP in backward" in line).split()
    assert ddp_line[-2:] == ["1.50", "1.00"]                  # 3.5 - 2.0 and 3.0 - 2.0
    total = next(line for line in lines if "all threads, whole step" in line).split()
    assert total[-3:] == ["4.00", "7.00", "6.00"]
    assert "the rest 0.25 ms" in lines[-2]                      # 1.5 of DDP less the 1.25 in the parts
    assert lines[-1] == "minipar / torch DDP, all threads: 1.167 (+1.00 ms per step)"


def test_other_threads_cpu_counts_another_threads_cpu_and_not_the_callers():
    """A worker burns 0.05 s of its own CPU, then waits; the caller burns 0.1 s: the other threads' CPU is the
    worker's 0.05 s (and whatever an idle thread of this process did), not the caller's."""
    before = bench_where.other_threads_cpu()
    if before is None:                                         # not Linux: nothing to see
        return
    burnt, release = threading.Event(), threading.Event()

    def worker():
        while time.thread_time() < 0.05:
            pass
        burnt.set()
        release.wait(60)

    thread = threading.Thread(target=worker)
    thread.start()
    assert burnt.wait(60)
    mine = time.thread_time()
    while time.thread_time() < mine + 0.1:
        pass
    spent = bench_where._spent(before, bench_where.other_threads_cpu())
    release.set()
    thread.join()
    assert 0.045 < spent < 0.09 and not math.isnan(spent), spent
