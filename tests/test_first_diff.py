"""minipar.debug.first_diff: ULP distance, the first-departure search at tolerance 0, and the first tensor where one device
and each layout part (default mode), with the reduction whose order made it; two identical runs, and a pipeline
that only moves work, do not part."""
import pytest
import torch

from minipar.debug import first_departure
from minipar.debug.first_diff import capture, first_difference, reduction_for, ulp_distance
from minipar.layout import Layout
from minipar.recipe import gpt_recipe


def _next(x, towards, dtype=torch.float32):
    return torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(towards, dtype=dtype))


def test_ulp_distance_counts_floats_between_not_their_difference():
    one, three = torch.tensor(1.0), torch.tensor(3.0)
    # neighbours are 1 ULP apart whatever their spacing: below 1.0 it is half the spacing above
    assert ulp_distance(one, _next(1.0, 2.0)) == 1 and ulp_distance(one, _next(1.0, 0.0)) == 1
    assert ulp_distance(three, _next(3.0, 4.0)) == 1                   # |Δ| = 2.4e-7, 2 ε: still one step
    assert ulp_distance(torch.tensor(1e-30), torch.tensor(2e-30)) > 10 ** 6   # tiny |Δ|, many floats between
    assert ulp_distance(torch.tensor(-0.0), torch.tensor(0.0)) == 0
    tiny = torch.tensor(1e-45)                                          # the smallest subnormal, either side of 0
    assert ulp_distance(tiny, -tiny) == 2
    assert ulp_distance(torch.tensor(-1.0), one) == 2 * 0x3F800000      # across zero: both sides' steps
    assert ulp_distance(torch.tensor(1.0, dtype=torch.float64), _next(1.0, 2.0, torch.float64)) == 1
    with pytest.raises(ValueError, match="one floating dtype"):
        ulp_distance(one, one.double())


def test_first_departure_at_tolerance_zero_asks_for_bitwise_equality():
    reference = [{"a": torch.ones(3), "b": torch.ones(2)}]
    same = [{n: t.clone() for n, t in reference[0].items()}]
    assert first_departure.first_departure(reference, [same], 0.0).first is None
    assert str(first_departure.first_departure(reference, [same], 0.0)).startswith("bitwise equal")
    same[0]["b"][1] = _next(1.0, 2.0)                                   # one ULP on one element
    found = first_departure.first_departure(reference, [same], 0.0)
    assert found.first.name == "b" and "not bitwise equal" in str(found)
    with pytest.raises(ValueError, match="tolerance"):
        first_departure.first_departure(reference, [same], -1.0)


def test_reduction_names_by_what_the_layouts_split():
    one, tp2 = Layout(), Layout(tp=2)
    assert "vocabulary-parallel softmax" in reduction_for("forward loss per token", one, tp2)
    assert "mean over tokens" in reduction_for("forward loss", one, Layout(dp=2))
    assert "same layout" in reduction_for("forward blocks.0.attn.proj", one, one)


LAYOUTS = {   # layout -> (first tensor where it parts from one device, words of the reduction named)
    "dp 2": (dict(dp=2), "backward head.weight.grad", "DP all-reduce"),
    "micro-batches 2": (dict(micro_batches=2), "backward head.weight.grad", "gradient accumulation"),
    "tp 2": (dict(tp=2), "forward blocks.0.attn.proj", "row-parallel linear's all-reduce over the inner"),
    "tp 2 with SP": (dict(tp=2, sp=True), "forward blocks.0.attn.proj", "row-parallel"),
    "cp 2": (dict(cp=2), "forward blocks.0.attn.core", "key-block merge"),
    "dp 2 x tp 2": (dict(dp=2, tp=2), "forward blocks.0.attn.proj", "row-parallel"),
    "dp 2 x pp 2 x tp 2": (dict(dp=2, pp=2, tp=2, micro_batches=2), "forward blocks.0.attn.proj", "row-parallel"),
}


@pytest.fixture(scope="module")
def one_device():
    recipe = gpt_recipe(steps=1, batch_size=4, seq_len=8, n_layer=2, n_embd=16, n_head=4)
    return recipe, capture(recipe)


def test_each_layout_parts_from_one_device_at_its_first_reordered_sum(one_device):
    recipe, one = one_device
    for label, (dims, name, reduction) in LAYOUTS.items():
        run = capture(recipe, **dims)
        diff = first_difference(one, run)
        assert (diff.name, diff.step) == (name, 0), (label, str(diff))
        assert reduction in diff.reduction, (label, diff.reduction)
        want = ulp_distance(run.steps[0][name], one.steps[0][name])
        assert diff.ulps_max == int(want.max()) >= 1 and 0 < diff.ulps_count == int((want > 0).sum()), label
        if name.startswith("backward"):            # tokens split: every activation and the loss equal, bit for bit
            assert "forward" not in diff.first_in_phase, (label, diff.first_in_phase)
    assert run.steps[0].keys() == one.steps[0].keys() and len(one.steps[0]) == 71


def test_identical_runs_and_a_pipeline_alone_report_no_difference(one_device):
    recipe, one = one_device
    for dims in ({}, dict(pp=2, schedule="gpipe")):      # PP moves whole layers: no sum changes its order
        diff = first_difference(one, capture(recipe, **dims))
        assert diff.name is None and str(diff).startswith("no difference"), (dims, str(diff))
