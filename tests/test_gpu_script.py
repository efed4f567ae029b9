"""tools/gpu_operators.py — the prepared GPU check — runs end to end (a dry run on the CPU: tiny size, no card
to compare with) and writes its labelled JSON; on a CPU-only machine it refuses CUDA with a clear message."""
import json
import runpy

import pytest
import torch


def _main():
    return runpy.run_path("tools/gpu_operators.py")["main"]


def test_dry_run_writes_labelled_json(tmp_path, one_thread):
    """One thread (conftest's one_thread) and one repeat after the warm-ups: the plumbing is what a dry run
    checks, and two threads on a busy 2-core machine spend most of their CPU spinning."""
    out = tmp_path / "ops.json"
    assert _main()(["--device", "cpu", "--tiny", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["date"] and report["card"] is None
    tiny = report["sizes"]["tiny"]
    assert {"gemm", "memory", "attention"} <= set(tiny["classes"])
    assert all(r["measured_s"] > 0 and r["flops"] >= 0 and r["kernels"] >= 1 for r in tiny["operators"])
    assert tiny["block_step_s"] > 0 and report["course"] and report["adamw"]["measured_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_it_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device"):
        _main()(["--out", str(tmp_path / "x.json")])
