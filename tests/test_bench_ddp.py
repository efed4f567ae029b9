"""``python -m minipar bench ddp`` times PyTorch's DDP like for like (``gradient_as_bucket_view=True``, as
minipar's gradients are bucket views) and its default beside it, and prints minipar's ratio to each (issue 51)."""
from minipar.course.ch02_data_parallelism import bench


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
