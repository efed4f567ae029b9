"""Checks for chapter 14's exercises: PowerSGD's bytes per step for a list of gradient shapes, and DiLoCo's
outer step from the replicas' parameters.

Both run in one process. The first compares with :func:`minipar.data.powersgd.powersgd_bytes` on shape lists
that contain every case (vectors, a matrix too small to gain, a 4-D tensor viewed as a matrix); the second
runs the learner's outer step for several rounds beside ``torch.optim.SGD(nesterov=True)`` on the mean
pseudo-gradient, as :class:`minipar.data.diloco.DiLoCo` does. Each names the likely mistake when the answer
matches a known wrong one.
"""
from __future__ import annotations

import math

import torch

from minipar.comm import predicted_bytes_sent
from minipar.course.checks import fail
from minipar.data.powersgd import compressible, powersgd_bytes

__all__ = ["check_powersgd_step_bytes", "check_outer_step", "shape_cases", "outer_reference"]


def shape_cases():
    """(name, shapes, r, ranks, bytes per number) the bytes check tries."""
    gpt = [(64, 16), (32, 16), (16,), (16,), (48, 16), (48,), (16, 16), (16,), (64, 16), (64,), (16, 64), (16,)]
    return [
        ("one 64×16 matrix, r = 1, 2 ranks", [(64, 16)], 1, 2, 4),
        ("a bias and a 48×16 matrix, r = 2, 4 ranks", [(48,), (48, 16)], 2, 4, 4),
        ("a 3×3 matrix (P and Q: 12 numbers, the matrix: 9) and an 8×8, r = 2, 2 ranks", [(3, 3), (8, 8)], 2, 2, 4),
        ("a conv kernel 32×16×3×3 (viewed as 32×144), r = 4, 8 ranks", [(32, 16, 3, 3), (32,)], 4, 8, 2),
        ("the tiny GPT's first layers, r = 4 (16×16 gains, 16×16 at r = 8 does not), 2 ranks", gpt, 4, 2, 4),
        ("the same at r = 8, 4 ranks, float64", gpt, 8, 4, 8),
    ]


def _wrong_answers(shapes, r, n, b) -> dict:
    """{likely mistake: the number it gives} for the bytes exercise."""
    def numbers(compress, size):
        return sum(size(s) if compress(s) else math.prod(s) for s in shapes)

    def pq(s):
        rows, cols = s[0], math.prod(s[1:])
        return (rows + cols) * min(rows, cols, r)
    def matrix(s):
        return len(s) >= 2
    ring = predicted_bytes_sent("all_reduce", 1, n)
    right = numbers(lambda s: compressible(s, r), pq)
    return {
        "the ring all-reduce sends 2(N−1)/N of the payload per rank: multiply by it": right * b,
        "compress a matrix only when (n + m)·r < n·m; otherwise it goes as it is": numbers(matrix, pq) * b * ring,
        "a tensor of more than 2 dimensions is viewed as (shape[0], the product of the rest)":
            numbers(lambda s: matrix(s) and compressible(s[:2], r), lambda s: pq(s[:2])) * b * ring
            if any(len(s) > 2 for s in shapes) else None,
        "P has n·r numbers and Q has m·r: count both": numbers(lambda s: compressible(s, r),
                                                               lambda s: s[0] * r) * b * ring,
        "each number is elem_bytes bytes": right * ring,
    }


def check_powersgd_step_bytes(powersgd_step_bytes) -> None:
    """``powersgd_step_bytes(shapes, r, n_ranks, elem_bytes)`` -> bytes one rank sends per PowerSGD step."""
    for name, shapes, r, n, b in shape_cases():
        want = powersgd_bytes(shapes, r, n, b)
        got = powersgd_step_bytes([tuple(s) for s in shapes], r, n, b)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            fail(f"{name}: the return value", "a number of bytes", type(got).__name__, "return a number")
        if not math.isclose(got, want, rel_tol=1e-9):
            mistakes = [m for m, v in _wrong_answers(shapes, r, n, b).items()
                        if v is not None and math.isclose(got, v, rel_tol=1e-9)]
            fail(f"{name}: bytes per rank per step", f"{want:,.1f}", f"{got:,.1f}",
                 mistakes[0] if mistakes else "for each tensor: (n + m)·r numbers if it is a matrix with "
                 "(n + m)·r < n·m, else all its numbers; the sum × elem_bytes × 2(N−1)/N")
    print("powersgd_step_bytes: every case equals minipar.data.powersgd.powersgd_bytes")


def outer_reference(theta, drift, lr: float, momentum: float) -> list:
    """θ after each round, where round k's replicas are θ + drift[k][i]: ``torch.optim.SGD(nesterov=True)``
    on Δ = mean over replicas of (θ − θ_i)."""
    theta = theta.clone()
    opt = torch.optim.SGD([theta], lr=lr, momentum=momentum, nesterov=True)
    out = []
    for d in drift:
        replicas = [theta.detach() + x for x in d]
        theta.grad = sum(theta.detach() - t for t in replicas) / len(replicas)
        opt.step()
        out.append(theta.detach().clone())
    return out


def _outer_case(n_replicas: int, rounds: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(6, dtype=torch.float64, generator=g)
    drift = [[0.1 * torch.randn(6, dtype=torch.float64, generator=g) for _ in range(n_replicas)]
             for _ in range(rounds)]
    return theta, drift


def _wrong_outer(theta, drift, lr, momentum) -> dict:
    """{likely mistake: θ after the first two rounds} for the outer-step exercise."""
    def run(step):
        t, buf, out = theta.clone(), None, []
        for d in drift[:2]:
            replicas = [t + x for x in d]
            delta = sum(t - r for r in replicas) / len(replicas)
            t, buf = step(t, replicas, delta, buf)
            out.append(t)
        return out

    def step(t, delta, buf, nesterov=True):
        buf = delta if buf is None else momentum * buf + delta
        return t - lr * (delta + momentum * buf if nesterov else buf), buf
    return {
        "Δ = mean(θ − θ_i), the outer *gradient*: θ moves against it (θ − lr·…)":
            run(lambda t, reps, delta, buf: step(t, -delta, buf)),
        "Nesterov: step with Δ + momentum·buf, not with buf alone (that is plain momentum)":
            run(lambda t, reps, delta, buf: step(t, delta, buf, nesterov=False)),
        "the outer step is an optimizer step on Δ, not the replicas' average":
            run(lambda t, reps, delta, buf: (sum(reps) / len(reps), buf)),
        "Δ is the mean over replicas, not the sum":
            run(lambda t, reps, delta, buf: step(t, delta * len(reps), buf)),
    }


def check_outer_step(outer_step, lr: float = 0.7, momentum: float = 0.9) -> None:
    """``outer_step(theta, replicas, buf, lr, momentum)`` -> ``(new_theta, new_buf)``; ``buf`` is None at
    the first round."""
    for n_replicas, rounds, seed in ((2, 4, 0), (4, 3, 1)):
        theta, drift = _outer_case(n_replicas, rounds, seed)
        t, buf, got = theta.clone(), None, []
        for d in drift:                                  # each round the replicas drift from the current θ
            result = outer_step(t.clone(), [t + x for x in d], buf, lr, momentum)
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                fail("the return value", "a tuple (new_theta, new_buf)", type(result).__name__,
                     "return both: the next round needs the momentum buffer")
            t, buf = torch.as_tensor(result[0], dtype=torch.float64), result[1]
            got.append(t)
        want = outer_reference(theta, drift, lr, momentum)
        for k, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape or not torch.allclose(g, w, atol=1e-12, rtol=1e-10):
                wrong = _wrong_outer(theta, drift, lr, momentum)
                mistakes = [m for m, v in wrong.items() if k < 2 and torch.allclose(g, v[k], atol=1e-12)]
                fail(f"{n_replicas} replicas, round {k + 1}: θ after the outer step",
                     [round(x, 6) for x in w.tolist()], [round(x, 6) for x in g.tolist()],
                     mistakes[0] if mistakes else "Δ = mean_i(θ − θ_i); buf = Δ at first, then "
                     "momentum·buf + Δ; θ ← θ − lr·(Δ + momentum·buf)")
    print("outer_step: every round equals torch.optim.SGD(nesterov=True) on the mean pseudo-gradient")

