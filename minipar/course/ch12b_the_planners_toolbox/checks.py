"""Checks for chapter 12b's exercise.

``training_days(parameters, tokens, gpus, flops_per_gpu, recompute)``: the learner writes Narayanan et al.'s
end-to-end estimate (2021, Eq. 4), time ≈ c·T·P / (n·X) with c = 8 FLOPs per parameter per token under full
recomputation (forward, backward = 2 forwards, and one more forward) and c = 6 without, in days. The check
compares with that formula on GPT-3 (175 B parameters, 300 B tokens, 1024 GPUs at 140 TFLOP/s: 34 days) and a
second case, and names the mistake when the answer equals a known wrong one.
"""
from __future__ import annotations

from minipar.course.checks import fail

__all__ = ["DAYS_CASES", "expected_days", "check_training_days"]

DAY = 86400.0
# (parameters, tokens, gpus, achieved FLOP/s per GPU, recompute): GPT-3 as Narayanan et al. estimate it, and
# the same model without recomputation on half the GPUs at a higher rate
DAYS_CASES = [(175e9, 300e9, 1024, 140e12, "full"), (175e9, 300e9, 512, 160e12, "none")]


def expected_days(parameters, tokens, gpus, flops_per_gpu, recompute) -> float:
    """c·T·P / (n·X) in days, c = 8 with full recomputation, else 6 (Narayanan et al. 2021, Eq. 4)."""
    per_token = 8 if recompute == "full" else 6
    return per_token * tokens * parameters / (gpus * flops_per_gpu) / DAY


def _wrong(case) -> dict:
    """{likely mistake: the days that mistake gives} for one case (None where it is the right answer)."""
    p, t, n, x, rc = case
    right, full = expected_days(*case), rc == "full"
    return {"6 FLOPs per parameter per token with full recomputation: the recomputed forward adds 2 more":
            6 * t * p / (n * x) / DAY if full else None,
            "8 FLOPs per parameter per token without recomputation: only forward (2) and backward (4) run":
            None if full else 8 * t * p / (n * x) / DAY,
            "the answer is in seconds: divide by 86,400 for days": right * DAY,
            "the answer is for one GPU: divide by the n GPUs": right * n}


def check_training_days(fn) -> None:
    for case in DAYS_CASES:
        got, want = fn(*case), expected_days(*case)
        if isinstance(got, (int, float)) and abs(got - want) <= 1e-6 * want:
            continue
        mistake = "time = c·T·P / (n·X), c = 8 with full recomputation and 6 without, in days"
        for why, wrong in _wrong(case).items():
            if wrong is not None and isinstance(got, (int, float)) and abs(got - wrong) <= 1e-6 * wrong:
                mistake = why
        fail(f"training_days{case}", f"{want:.2f} days", got, mistake)
    print(f"training_days: right for all {len(DAYS_CASES)} cases ({expected_days(*DAYS_CASES[0]):.0f} days for GPT-3)")
