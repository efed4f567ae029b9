"""Checks for chapter 13's exercises: a program that hangs, a gradient that departs from one device, the
dropout seeds of tensor parallelism, and the ULP distance between two float32 tensors. Each runs the learner's
function (on ranks where it communicates), and on a wrong answer says what was expected, what came back, and —
with the chapter's tools — where it went wrong.
"""
from __future__ import annotations

import torch

from minipar.course.checks import ExerciseError, fail

__all__ = ["check_clipped_average", "check_average_gradients", "check_dropout_seeds", "check_ulp_distance",
           "grads_of",
           "expected_clipped_average", "mlp_steps"]

MAX_NORM = 1.0


# 1. The hang --------------------------------------------------------------------------------------------

def grads_of(rank: int) -> torch.Tensor:
    """Rank ``rank``'s gradient in exercise 1: rank 1's is large, the others' small (float64)."""
    g = torch.arange(1.0, 7.0, dtype=torch.float64) / 10 * (rank + 1)
    return g * 8 if rank == 1 else g


def expected_clipped_average(world_size: int, max_norm: float = MAX_NORM) -> torch.Tensor:
    g = sum(grads_of(r) for r in range(world_size)) / world_size
    norm = g.norm()
    return g * (max_norm / norm) if norm > max_norm else g


def _run_clipped(rank, world_size, fn):
    return fn(grads_of(rank).clone(), world_size, MAX_NORM)


def check_clipped_average(clipped_average, world_size: int = 3) -> None:
    """``clipped_average(grad, world_size, max_norm)`` on every rank -> the average of the ranks' gradients,
    scaled down to norm ``max_norm`` when it is longer; the same tensor on every rank."""
    from minipar import LaunchTimeout, RankError, launch
    try:
        results = launch(_run_clipped, world_size, clipped_average, timeout=3, quiet=True)
    except LaunchTimeout as exc:
        raise ExerciseError(f"clipped_average hung on {world_size} ranks; the flight recorder says:\n"
                            f"{exc.flight or '(no record)'}\nlikely mistake: a collective called only on the "
                            f"ranks that take a branch (a norm above max_norm): every rank must make every "
                            f"call, whatever its own data — decide after the all-reduce, not before") from None
    except RankError as exc:
        message = str(exc).split(" failed: ", 1)[-1].split("\n\n---", 1)[0]
        if message.startswith("NotImplementedError"):
            raise NotImplementedError("clipped_average is not written yet: replace '# YOUR CODE HERE' and the "
                                      "raise below it") from None
        raise ExerciseError(f"clipped_average raised on rank {exc.rank}:\n{exc.rank_traceback.rstrip()}") from None
    want = expected_clipped_average(world_size)
    for rank, got in enumerate(results):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(got, want, atol=1e-12):
            local = [grads_of(r) * min(1.0, MAX_NORM / float(grads_of(r).norm())) for r in range(world_size)]
            clipped_locally = sum(local) / world_size
            if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, clipped_locally):
                mistake = ("each rank clipped its own gradient before the average: clip the average, by the "
                           "norm of the averaged gradient (the same on every rank)")
            elif isinstance(got, torch.Tensor) and got.shape == want.shape and \
                    torch.allclose(got, want * world_size, atol=1e-12):
                mistake = "the sum, not the average: divide by world_size after the all-reduce"
            else:
                mistake = "all-reduce the gradient on every rank, divide by world_size, then clip by its norm"
            fail(f"clipped_average on rank {rank}", [round(x, 6) for x in want.tolist()],
                 got.tolist() if isinstance(got, torch.Tensor) else got, mistake)
    print(f"clipped_average: every rank of {world_size} made every call and returned the clipped average "
          f"(norm {float(want.norm()):.3f})")


# 2. The silent gradient bug -------------------------------------------------------------------------------

def _mlp_recipe():
    from minipar.check import mlp_recipe
    recipe = mlp_recipe(steps=3, batch_size=8, sizes=(8, 16, 4))
    recipe.dtype = torch.float64
    recipe.batches = [(x.double(), y.double()) for x, y in recipe.batches]
    return recipe


def _mlp_rank(rank, world_size, average_gradients):
    from minipar.loop import shard_batch
    recipe = _mlp_recipe()
    model = recipe.model().to(recipe.dtype)
    opt = recipe.optimizer(model.parameters())
    steps = []
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        opt.zero_grad(set_to_none=True)
        recipe.loss(model, x, y).backward()
        average_gradients(list(model.parameters()), world_size)
        opt.step()
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return steps


def mlp_steps(average_gradients, world_size: int = 2) -> tuple:
    """(one device's parameters after each step, each rank's) for data parallelism on the MLP of exercise 2
    (float64, SGD, 3 steps) with ``average_gradients(params, world_size)`` after every backward."""
    from minipar import launch
    from minipar.debug.first_departure import reference_steps
    return reference_steps(_mlp_recipe()), launch(_mlp_rank, world_size, average_gradients, quiet=True, timeout=15)


def check_average_gradients(average_gradients, world_size: int = 2, tolerance: float = 1e-12) -> None:
    """``average_gradients(params, world_size)``: every parameter's ``.grad`` becomes the mean over the ranks."""
    from minipar import RankError
    from minipar.debug.first_departure import first_departure
    try:
        reference, ranks = mlp_steps(average_gradients, world_size)
    except RankError as exc:
        message = str(exc).split(" failed: ", 1)[-1].split("\n\n---", 1)[0]
        if message.startswith("NotImplementedError"):
            raise NotImplementedError("average_gradients is not written yet: replace '# YOUR CODE HERE' and "
                                      "the raise below it") from None
        raise ExerciseError(f"average_gradients failed on rank {exc.rank}: {message}") from None
    found = first_departure(reference, ranks, tolerance)
    if found.first is not None:
        biases = all(n.endswith("bias") for n in found.wrong)
        mistake = ("only the biases depart: every parameter's gradient needs the same all-reduce and the same "
                   "division, whatever its shape" if biases else
                   "all-reduce every gradient (a sum over ranks), then divide by world_size: the mean")
        fail("data parallelism against one device (float64, first-departure search)", f"within {tolerance:g} at every step",
             str(found), mistake)
    print(f"average_gradients: {world_size} ranks equal one device at every step and parameter (within {tolerance:g})")


# 3. The seed bug ------------------------------------------------------------------------------------------

def check_dropout_seeds(dropout_seeds, tp: int = 4, seeds=(0, 1234)) -> None:
    """``dropout_seeds(seed, tp_rank)`` -> ``(replicated, split)``: the seed for dropout on tensors every TP
    rank holds whole, and for tensors split across the TP group."""
    for seed in seeds:
        pairs = [dropout_seeds(seed, r) for r in range(tp)]
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            fail(f"dropout_seeds({seed}, tp_rank)", "a pair (replicated, split)", pairs[0],
                 "return the two seeds, in that order")
        replicated, split = [p[0] for p in pairs], [p[1] for p in pairs]
        if len(set(replicated)) != 1:
            fail(f"replicated seeds on the {tp} TP ranks (seed {seed})", "the same on every TP rank", replicated,
                 "a tensor every TP rank holds whole (the residual stream) needs the same mask on each, or its "
                 "copies differ and the replicated parameters drift apart: no tp_rank in the replicated seed")
        if len(set(split)) != tp:
            fail(f"split-region seeds on the {tp} TP ranks (seed {seed})", "a different seed on every TP rank",
                 split, "each rank's heads need their own masks: add tp_rank to the split seed (Megatron: "
                        "seed + 2718 + tp_rank)")
        if set(split) & set(replicated):
            fail(f"split and replicated seeds (seed {seed})", "two different streams", (replicated, split),
                 "offset the split seeds (Megatron adds 2718): with seed + tp_rank, TP rank 0's split masks "
                 "would repeat its replicated masks")
    a, b = dropout_seeds(seeds[0], 0), dropout_seeds(seeds[1], 0)
    if a == b:
        fail("dropout_seeds with two different seeds", "different seeds", (a, b), "start from the run's seed")
    print(f"dropout_seeds: one replicated seed per TP group, {tp} distinct split seeds, two separate streams")


# 4. Equal to the last bit ------------------------------------------------------------------------------------

def _ulp_cases() -> dict:
    """Pairs of float32 tensors, each with what a wrong ULP distance would say about it."""
    one = torch.tensor([1.0])
    up, down = (torch.nextafter(one, torch.tensor([x])) for x in (2.0, 0.0))
    tiny = torch.tensor([1e-45])
    return {"1.0 and the next float up": (one, up), "1.0 and the next float down": (one, down),
            "-0.0 and +0.0": (torch.tensor([-0.0]), torch.tensor([0.0])),
            "the smallest subnormal either side of 0": (tiny, -tiny),
            "-1.0 and 1.0": (-one, one), "1e-30 and 2e-30": (torch.tensor([1e-30]), torch.tensor([2e-30]))}


def check_ulp_distance(ulp_distance) -> None:
    """``ulp_distance(a, b)`` on float32 tensors -> the number of float32 values between them, elementwise."""
    from minipar.debug.first_diff import ulp_distance as right
    for what, (a, b) in _ulp_cases().items():
        want, got = right(a, b), ulp_distance(a.clone(), b.clone())
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.is_floating_point() \
                or not torch.equal(got.long(), want):
            if isinstance(got, torch.Tensor) and got.is_floating_point():
                mistake = ("a float came back: a ULP distance counts the float32 values between a and b (an "
                           "integer), and |a − b| / ε is not that count — the spacing of floats halves below "
                           "every power of two")
            elif what == "1.0 and the next float down":
                mistake = ("the difference divided by a fixed spacing (ε at 1.0): below a power of two the "
                           "floats are twice as dense, so a neighbour is one ULP away whatever its |Δ|; count "
                           "floats, from the bits")
            elif what == "-0.0 and +0.0":
                mistake = ("the raw bits of a negative float count down from −2³¹ (the sign bit), not from 0: "
                           "map them to −2³¹ − bits so that the integers are ordered like the floats")
            else:
                mistake = ("read the float32 bits as int32 (t.view(torch.int32)), order them (negative floats "
                           "to −2³¹ − bits), and return |difference| as int64, elementwise")
            fail(f"ulp_distance for {what}", want.tolist(), got.tolist() if isinstance(got, torch.Tensor) else got,
                 mistake)
    print(f"ulp_distance: right on all {len(_ulp_cases())} pairs, neighbours, zeros of both signs and across zero")
