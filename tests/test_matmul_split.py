"""Chapter 01: the data, column and row splits of one matmul equal the single-device matmul.

Forward output, dx and dw against autograd on one device, on 2 and 4 ranks, including uneven splits (5 rows
of w over 2 or 4 ranks). float64: the only difference is the order of additions in a sum over ranks, so
the tolerance is 1e-12 absolute. Then training with each split against ``minipar.check`` (loss every step,
w after 3 SGD steps; float32 default tolerances atol 2e-5, rtol 1e-4). Bytes sent equal the formula exactly.
"""
import pytest
import torch

from minipar.check import check_equivalence
from minipar.tensor import matmul_split as ms

ATOL = 1e-12


def _problem(b=4, k=5, m=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w, dy = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((b, k), (k, m), (b, m)))
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = x_ref @ w_ref
    y_ref.backward(dy)
    return (x, w, dy), (y_ref.detach(), x_ref.grad, w_ref.grad)


@pytest.mark.parametrize("world_size, shape", [(2, (4, 5, 8)), (4, (4, 5, 8)), (3, (6, 7, 9))])
def test_every_split_equals_one_device_forward_and_backward(world_size, shape):
    b, k, m = shape
    (x, w, dy), (y, dx, dw) = _problem(b, k, m)
    results = ms.run(x, w, dy, world_size=world_size)
    for rank, per_split in enumerate(results):
        for split, r in per_split.items():
            for name, got, want in (("y", r["y"], y), ("dx", r["dx"], dx), ("dw", r["dw"], dw)):
                assert torch.allclose(got, want, atol=ATOL, rtol=0), f"{split} {name} rank {rank}"
            p = ms.predicted_bytes(split, x.shape, w.shape, world_size, itemsize=8)
            assert r["bytes"]["forward"] == p["forward"] and r["bytes"]["backward"] == p["backward"], split


def test_each_split_uses_the_collective_the_table_says():
    (x, w, dy), _ = _problem()
    r = ms.run(x, w, dy, world_size=4)[1]
    assert r["data"]["ops"] == {"forward": {}, "backward": {"all_reduce": (1, 2 * 3 / 4 * 5 * 8 * 8)}}
    assert r["column"]["ops"] == {"forward": {}, "backward": {"all_reduce": (1, 2 * 3 / 4 * 4 * 5 * 8)}}
    assert r["row"]["ops"] == {"forward": {"all_reduce": (1, 2 * 3 / 4 * 4 * 8 * 8)}, "backward": {}}
    # the pieces: rank 1 of 4 holds x row 1, w columns 2..3, and (row split: 5 rows = 2+1+1+1) w row 2
    assert torch.equal(r["data"]["x"], x[1:2]) and torch.equal(r["column"]["w"], w[:, 2:4])
    assert torch.equal(r["row"]["w"], w[2:3]) and torch.equal(r["row"]["x"], x[:, 2:3])


def test_a_missing_all_reduce_is_caught():
    """The test can fail: data parallelism without the gradient all-reduce gives each rank its own dw."""
    (x, w, dy), (_, _, dw) = _problem()
    x_rows, dy_rows = ms.shard(x, 0, 0, 2), ms.shard(dy, 0, 0, 2)
    assert not torch.allclose(x_rows.T @ dy_rows, dw, atol=1e-3)


@pytest.mark.parametrize("split", ms.SPLITS)
def test_training_with_each_split_matches_one_device(split):
    comparison = check_equivalence(ms.parallel_train, 4, ms.matmul_recipe(b=8, k=8, m=16), split=split,
                                   launch_kwargs={"quiet": True})
    comparison.assert_ok()


@pytest.mark.parametrize("split, x_shape, w_shape, n, message", [
    ("rows", (4, 5), (5, 8), 2, "one of"),
    ("data", (4, 5), (6, 8), 2, "inner dimensions"),
    ("data", (4, 5), (5, 8), 8, "size 4"),
    ("row", (4, 5), (5, 8), 6, "size 5"),
])
def test_bad_splits_are_refused_before_launch(split, x_shape, w_shape, n, message):
    with pytest.raises(ValueError, match=message):
        ms.validate(split, x_shape, w_shape, world_size=n)
    with pytest.raises(ValueError, match=message):
        ms.run(torch.zeros(x_shape), torch.zeros(w_shape), torch.zeros(x_shape[0], w_shape[1]), world_size=n,
               splits=(split,))
