"""Chapter 03's two FSDP designs: both equal one device, the same collectives per unit, bytes within the padding,
the per-parameter design's gradients on the module's own parameters."""
import pytest

from minipar import comm
from minipar.check import compare, train_reference
from minipar.course.ch03_zero_and_fsdp import designs


@pytest.fixture(scope="module")
def runs():
    return designs.run(4)


def test_both_designs_equal_one_device(runs):
    reference = train_reference(designs.recipe())
    for name, per_rank in runs.items():
        compare(reference, [r["result"] for r in per_rank], atol=1e-10, rtol=0).assert_ok()


def test_one_gather_twice_and_one_reduce_scatter_per_unit_either_way(runs):
    flat, per = runs["flat"][0], runs["per-parameter"][0]
    assert len(flat["units"]) == len(per["units"]) == 3
    for r in (flat, per):
        assert r["per_step"]["all_gather"][0] == 2 * 3 and r["per_step"]["reduce_scatter"][0] == 3
        padded = sum(p for _, p in r["units"])
        assert r["per_step"]["reduce_scatter"][1] == comm.predicted_bytes_sent("reduce_scatter", 8 * padded, 4)
    assert [n for n, _ in flat["units"]] == [n for n, _ in per["units"]]       # the same parameters
    flat_pad = sum(p - n for n, p in flat["units"])
    per_pad = sum(p - n for n, p in per["units"])
    assert flat_pad <= 3 * 3 < per_pad                    # ≤ N-1 per unit vs ≤ N-1 rows per parameter


def test_the_loop_sees_grads_on_shards_of_the_modules_own_parameters(runs):
    flat, per = runs["flat"][0]["grads"], runs["per-parameter"][0]["grads"]
    assert len(flat) == 3 and all(len(shape) == 1 for shape, _ in flat)        # one flat shard per unit
    assert len(per) == len(list(designs.recipe().model().parameters()))
    assert all(grad == shape for shape, grad in per)
    assert any(len(shape) == 2 for shape, _ in per)                            # matrices stay matrices
