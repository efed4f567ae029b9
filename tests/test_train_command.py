"""``python -m minipar train``: --json lines, --save/--resume equal to an uninterrupted run, the single-device
layout, clear errors with exit code 2, and the same command under torchrun; the backend and device choice
(auto: NCCL on one GPU per rank where CUDA is, else gloo on the CPU), tested without a GPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

from minipar.hybrid.cli import main
from minipar.launcher import choose_backend_and_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--batch-size", "8", "--seq-len", "8", "--micro-batches", "2", "--dtype", "float64"]


def train(capfd, *flags):
    capfd.readouterr()
    assert main([*flags, *SMALL, "--json"]) == 0
    out, err = capfd.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    return {d["step"]: d["loss"] for d in lines}, err


def test_save_then_resume_equals_uninterrupted(capfd, tmp_path):
    layout = ["--dp", "1", "--pp", "2", "--tp", "2"]
    first, err = train(capfd, *layout, "--steps", "2", "--save", str(tmp_path))
    assert list(first) == [1, 2] and "tokens/s" in err and "saved step 2" in err
    resumed, _ = train(capfd, *layout, "--steps", "4", "--resume", str(tmp_path))
    straight, _ = train(capfd, *layout, "--steps", "4")
    assert list(resumed) == [3, 4]
    assert resumed == {s: straight[s] for s in (3, 4)}          # bit for bit: same layout, same arithmetic
    assert first == {s: straight[s] for s in (1, 2)}


def test_three_d_equals_one_device_from_the_shell(capfd):
    one, _ = train(capfd, "--dp", "1", "--pp", "1", "--tp", "1", "--steps", "2", "--micro-batches", "1")
    three_d, _ = train(capfd, "--dp", "2", "--pp", "2", "--tp", "2", "--steps", "2")
    assert one.keys() == three_d.keys()
    for s in one:
        assert three_d[s] == pytest.approx(one[s], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("flags, words", [
    (["--dp", "1", "--pp", "1", "--tp", "3"], "not divisible by the tensor-parallel degree 3"),
    (["--dp", "1", "--pp", "8", "--tp", "1", "--micro-batches", "8"], "cannot be cut into"),
    (["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "2"], "ZeRO-2"),
    (["--dp", "2", "--pp", "2", "--tp", "2", "--schedule", "zb-h1"], "invalid choice"),
    (["--dp", "two"], "invalid int value"),
    (["--dp", "1", "--resume", "/nonexistent/dir"], "latest is missing"),
])
def test_bad_flags_exit_2(capsys, flags, words):
    with pytest.raises(SystemExit) as info:
        main(flags)
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_exit_code_from_the_shell():
    done = subprocess.run([sys.executable, "-m", "minipar", "train", "--tp", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tensor-parallel degree 3" in done.stderr


def test_under_torchrun(capfd):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    flags = ["--dp", "1", "--pp", "2", "--tp", "1", "--steps", "2", *SMALL, "--json"]
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "-m", "minipar", "train", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    under_torchrun = {d["step"]: d["loss"] for d in map(json.loads, done.stdout.splitlines())}
    local, _ = train(capfd, *flags[:-1 - len(SMALL)])
    assert under_torchrun == local           # the same ranks, the same arithmetic, another launcher


@pytest.mark.parametrize("requested, cuda, count, local_rank, want", [
    ("auto", False, 0, 0, ("gloo", "cpu")),
    ("auto", False, 0, 3, ("gloo", "cpu")),
    ("auto", True, 8, 0, ("nccl", "cuda:0")),
    ("auto", True, 8, 5, ("nccl", "cuda:5")),
    ("auto", True, 4, 6, ("nccl", "cuda:2")),        # LOCAL_RANK beyond the GPUs wraps around
    ("gloo", True, 8, 5, ("gloo", "cpu")),           # gloo stays on the CPU even where GPUs exist
    ("gloo", False, 0, 1, ("gloo", "cpu")),
    ("nccl", True, 2, 1, ("nccl", "cuda:1")),
])
def test_choose_backend_and_device(requested, cuda, count, local_rank, want):
    assert choose_backend_and_device(requested, local_rank=local_rank, cuda_available=cuda,
                                     device_count=count) == want


@pytest.mark.parametrize("requested, words", [("nccl", "needs CUDA"), ("mpi", "'auto', 'gloo' or 'nccl'")])
def test_choose_backend_and_device_refuses(requested, words):
    with pytest.raises(ValueError, match=words):
        choose_backend_and_device(requested, local_rank=0, cuda_available=False, device_count=0)


def no_launch(*args, **kwargs):
    pytest.fail("a process was started")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: NCCL is allowed")
def test_nccl_without_a_gpu_exits_2(capsys, monkeypatch):
    monkeypatch.setattr("minipar.launcher.launch", no_launch)
    with pytest.raises(SystemExit) as info:
        main(["--backend", "nccl", "--steps", "1"])
    assert info.value.code == 2
    assert "CUDA" in capsys.readouterr().err


def test_nccl_with_more_local_ranks_than_gpus_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # pretend: one GPU, two ranks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("minipar.launcher.launch", no_launch)
    with pytest.raises(SystemExit) as info:
        main(["--backend", "auto", "--pp", "2", "--steps", "1", *SMALL])
    assert info.value.code == 2
    assert "2 ranks but 1 GPU(s)" in capsys.readouterr().err


def test_auto_backend_runs_on_gloo_here(capfd, monkeypatch):
    from minipar.launcher import launch
    started = []

    def spy(*args, **kwargs):
        started.append(kwargs["backend"])
        return launch(*args, **kwargs)
    monkeypatch.setattr("minipar.launcher.launch", spy)
    losses, err = train(capfd, "--backend", "auto", "--pp", "2", "--steps", "1")
    assert started == ["nccl" if torch.cuda.device_count() >= 2 else "gloo"] and list(losses) == [1]
