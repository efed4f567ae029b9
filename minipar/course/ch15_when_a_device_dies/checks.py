"""Checks for chapter 15's exercises: the Young/Daly checkpoint interval, a gradient fingerprint that no
single flipped bit gets past, and the gradient a step committed by the live replicas applies.

All run in one process. The first compares with √(2·C·M) on several save costs and failure rates; the second
flips every bit of a few elements (a low mantissa bit of a tiny number beside a large one, the sign of a zero,
the top exponent bit) and asks that the fingerprint changes each time, while equal tensors keep equal
fingerprints; the third compares with (1/n)·Σ over the n live replicas' gradients, with a dead replica's
half-done gradient and an absent one's zeros among the inputs. Each names the likely mistake when the answer
matches a known wrong one.
"""
from __future__ import annotations

import math

import torch

from minipar.course.checks import close, fail
from minipar.debug.sdc import flip_bit

__all__ = ["check_young_daly", "check_fingerprint", "check_average_live", "interval_cases", "flip_cases", "live_cases"]


def interval_cases():
    """(save seconds C, mean time between failures M in seconds) the interval check tries."""
    return [(60.0, 3.1 * 3600), (2.0, 3.1 * 3600), (600.0, 24 * 3600), (30.0, 1800.0)]


def check_young_daly(young_daly_interval) -> None:
    for c, m in interval_cases():
        got = young_daly_interval(c, m)
        want = math.sqrt(2 * c * m)
        if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9):
            continue
        wrong = {"the factor 2: waste = C/τ + τ/(2M), and its minimum is at τ² = 2CM": math.sqrt(c * m),
                 "the square root: τ* = √(2CM), not 2CM": 2 * c * m,
                 "M is the mean time between failures: a failure loses τ/2 on average, so τ/(2M), not τ·2/M":
                     math.sqrt(c * m / 2),
                 "τ* grows with both C and M: √(2·C·M), not √(2·M/C)": math.sqrt(2 * m / c)}
        mistake = next((why for why, value in wrong.items() if isinstance(got, (int, float))
                        and math.isclose(got, value, rel_tol=1e-6)), "minimise C/τ + τ/(2M) over τ")
        fail(f"young_daly_interval(C={c:g} s, M={m:g} s)", f"{want:.6g} s", got, mistake)
    print("young_daly_interval: right on every case.")


def flip_cases():
    """(what, tensor, element, bit): flips a fingerprint must see."""
    big_and_tiny = torch.tensor([1.0e6, 1.0e-9, 3.0], dtype=torch.float64)
    zeros = torch.zeros(4, dtype=torch.float32)
    g = torch.linspace(-1, 1, 33, dtype=torch.float32)
    return [("the lowest mantissa bit of 1e-9 beside 1e6 (float64)", big_and_tiny, 1, 0),
            ("the sign bit of 0.0 (0.0 becomes -0.0, which compares equal)", zeros, 2, 31),
            ("the top exponent bit of a gradient element (float32)", g, 7, 30),
            ("a middle mantissa bit (float32)", g, 20, 11),
            ("the sign bit of a float64", big_and_tiny, 2, 63)]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def check_fingerprint(fingerprint) -> None:
    for what, tensor, index, bit in flip_cases():
        before = fingerprint(tensor.clone())
        if not _same(before, fingerprint(tensor.clone())):
            fail(f"fingerprint of the same tensor twice ({what})", "equal fingerprints", "different ones",
                 "a fingerprint must be a function of the bits only (no randomness, no address)")
        flipped = tensor.clone()
        flip_bit(flipped, index, bit)
        if _same(before, fingerprint(flipped)):
            float_sum = "a floating-point sum: a small change is rounded away beside a large element, and -0.0 == 0.0"
            fail(f"fingerprint after flipping {what}", "a different fingerprint", "the same one",
                 float_sum + "; read the elements' bits as integers (tensor.view(torch.int64) for float64, "
                 "torch.int32 for float32) and sum those exactly")
    print("fingerprint: every planted flip changes it; equal tensors give equal fingerprints.")


def live_cases():
    """(what, grads: one per configured replica, live: the replicas in the step's committed quorum)."""
    g = torch.Generator().manual_seed(15)
    grads = lambda n: [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(n)]   # noqa: E731
    absent = grads(4)
    absent[3] = torch.zeros(3, 4, dtype=torch.float64)
    return [("3 replicas; replica 1 died after its backward, its gradient never voted on", grads(3), [0, 2]),
            ("4 replicas; replica 3 absent, its entry zeros", absent, [0, 1, 2]),
            ("3 replicas; only replica 2 live", grads(3), [2]),
            ("2 replicas, both live", grads(2), [0, 1])]


def _head(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {tuple(t.shape)} tensor starting {[round(x, 6) for x in t.flatten()[:3].tolist()]}"
    return repr(t)


def check_average_live(average_live) -> None:
    for what, grads, live in live_cases():
        want = torch.stack([grads[r] for r in live]).mean(0)
        got = average_live([t.clone() for t in grads], list(live))
        if close(got, want, 1e-12):
            continue
        live_sum = sum(grads[r] for r in live)
        wrong = {"dividing by the configured replicas, not the live ones: the step shrinks by n/R while a replica "
                 "is missing (divide by len(live))": live_sum / len(grads),
                 "averaging every entry: a dead replica's gradient was never voted on and is never applied; "
                 "average only grads[r] for r in live": sum(grads) / len(grads),
                 "a sum, not a mean: each replica's gradient is of its own rows' mean loss, so divide by the number "
                 "of live replicas": live_sum}
        mistake = next((why for why, value in wrong.items() if close(got, value, 1e-9)),
                       "the mean over the live replicas' gradients: (1/n)·Σ_{r in live} grads[r]")
        fail(f"average_live({what}; live={live})", _head(want), _head(got), mistake)
    print("average_live: the mean over the live replicas' gradients, on every case.")
