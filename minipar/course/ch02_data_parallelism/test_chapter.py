"""Chapter 02's timing helpers: DP's five exchanges as processes equal one device; the link fit; the what-if."""
import pytest
import torch

from minipar.course.ch02_data_parallelism import timing
from minipar.observe.trace import Comm, Compute, RankTrace, Trace


def _dp_train(rank, world_size, recipe):
    from minipar.check import RunResult
    model = recipe.model()
    opt = recipe.optimizer(model.parameters())
    for x, y in recipe.batches:
        timing.dp_step(rank, world_size, model, opt, x, y)
    return RunResult(None, {n: p.detach().clone() for n, p in model.named_parameters()})


def test_dp_step_as_processes_equals_one_device():
    from minipar.check import gpt_recipe, train_reference
    from minipar.launcher import launch
    recipe = gpt_recipe(steps=2, batch_size=8, optimizer="sgd")
    recipe.dtype = torch.float64
    recipe.model = (lambda make: lambda: make().double())(recipe.model)
    want = train_reference(recipe).params
    got = launch(_dp_train, 2, recipe, quiet=True)[0].params       # rank 0 holds DP's model
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-12


def test_exposed_and_hidden_are_read_in_the_last_step_alone():
    from minipar.observe.replay import ReplayResult, Span
    spans = [Span(0, "compute", 0, 1, 0), Span(0, "all_reduce", 1, 3, 1),        # step 1: exposed 2
             Span(0, "compute", 3, 5, 3), Span(0, "all_reduce", 4, 5, 4),        # step 2: hidden 1
             Span(0, "all_gather", 5, 6, 6)]                                     # after: a final gather
    result = ReplayResult([spans], [6.0], marks=[[("step", 3.0), ("step", 5.0)]])
    assert timing.exposed_per_step(result) == 0 and timing.hidden_share(result) == 1.0   # whole run: 3, 1/4
    assert [(s.start, s.end) for s in timing.last_step(result).timelines[0]] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="fewer than two"):
        timing.last_step(ReplayResult([spans], [6.0], marks=[[("step", 3.0)]]))


def test_scaled_multiplies_messages_only():
    trace = Trace([RankTrace(0, [Compute(1.0, 1.0), Comm("all_reduce", (0, 1), 100)])])
    out = timing.scaled(trace, 3.0)
    assert out.ranks[0].events[1].bytes == 300 and out.ranks[0].events[0].seconds_cpu == 1.0
    assert trace.ranks[0].events[1].bytes == 100                     # the measured trace is left as it was


def test_measure_refuses_one_step_before_launch():
    with pytest.raises(ValueError, match="at least 2"):
        timing.measure(2, steps=1)


def test_titan_rtx_links_and_peaks():
    assert timing.titan_rtx(2).intra_bw == 50e9 and timing.titan_rtx(2, nvlink=False).intra_bw == 15.75e9
    assert timing.titan_rtx(2, fp32=True).peak_flops == 16.3e12
