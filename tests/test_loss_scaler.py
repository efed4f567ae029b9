"""The from-scratch dynamic loss scaler makes the same decisions (step or skip), keeps the same scale at
every step and leaves the same parameters as torch.amp.GradScaler on the same sequence of overflowing and
clean steps — exactly (the scales are powers of two, so unscaling is exact in both)."""
import pytest
import torch
import torch.distributed as dist

from minipar import launch
from minipar.precision.loss_scaler import DynamicLossScaler, found_inf


def _run(pattern, use_torch, **kw):
    """One parameter vector, SGD; at step i a gradient is poisoned with pattern[i] (None = clean)."""
    p = torch.nn.Parameter(torch.linspace(-1, 1, 5))
    w = torch.arange(1.0, 6.0)
    opt = torch.optim.SGD([p], lr=0.01)
    scaler = (torch.amp.GradScaler("cpu", **kw) if use_torch else
              DynamicLossScaler(**kw))
    scales, stepped, params = [], [], []
    calls = []
    real_step = opt.step
    opt.step = lambda *a, **k: (calls.append(1), real_step(*a, **k))[1]   # count the steps really taken
    for poison in pattern:
        opt.zero_grad(set_to_none=True)
        scaler.scale((p * w).sum() ** 2).backward()
        if poison is not None:
            p.grad[2] = poison
        before = len(calls)
        if use_torch:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            scaler.step(opt)
            scales.append(scaler.loss_scale)
        stepped.append(len(calls) > before)
        params.append(p.detach().clone())
    return scales, stepped, params


INF, NAN = float("inf"), float("nan")
PATTERNS = {
    "clean then growth": [None] * 7,
    "overflow bursts": [None, INF, None, None, None, NAN, INF, None, None, None, None, -INF, None],
    "random": [INF if x < 0.2 else None for x in torch.rand(60, generator=torch.Generator().manual_seed(1))],
}


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("kw", [dict(growth_interval=3),
                                dict(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)])
def test_same_decisions_scales_and_params_as_gradscaler(name, kw):
    pattern = PATTERNS[name]
    ours = _run(pattern, use_torch=False, **kw)
    theirs = _run(pattern, use_torch=True, **kw)
    assert ours[0] == theirs[0], "scale after each step"
    assert ours[1] == theirs[1], "step taken or skipped"
    assert ours[1] == [x is None for x in pattern]          # every overflow skipped, every clean step taken
    for a, b in zip(ours[2], theirs[2]):
        assert torch.equal(a, b)


def test_defaults_are_the_usual_ones():
    s = DynamicLossScaler()
    assert (s.loss_scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0 ** 16, 2.0, 0.5, 2000)
    g = torch.amp.GradScaler("cpu")
    assert (g.get_scale(), g.get_growth_factor(), g.get_backoff_factor(), g.get_growth_interval()) == \
        (s.loss_scale, s.growth_factor, s.backoff_factor, s.growth_interval)


def test_growth_interval_and_backoff_by_hand():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    assert [s.update(o) for o in (False, False, True, False)] == [True, True, False, True]
    assert [h[0] for h in s.history] == [8.0, 8.0, 16.0, 8.0] and s.loss_scale == 8.0


def test_bad_settings_raise():
    for kw in (dict(init_scale=0), dict(growth_factor=1.0), dict(backoff_factor=1.5), dict(growth_interval=0)):
        with pytest.raises(ValueError):
            DynamicLossScaler(**kw)


def test_found_inf():
    assert not found_inf([torch.ones(3), None])
    assert found_inf([torch.ones(3), torch.tensor([1.0, float("nan")])])


def _one_rank_overflows(rank, world_size):
    scaler = DynamicLossScaler(init_scale=4.0, group=dist.group.WORLD)
    grads = [torch.tensor([1.0, float("inf") if rank == 1 else 2.0])]
    return scaler.check_overflow(grads), scaler.update(scaler.check_overflow(grads)), scaler.loss_scale


def test_ranks_agree_when_only_one_overflows(no_leftover_processes):
    results = launch(_one_rank_overflows, 2, quiet=True)
    assert results == [(True, False, 2.0), (True, False, 2.0)]
