"""ShardedOptimizer skips what torch.optim.AdamW skips: a frozen parameter (requires_grad=False: never
moved, never decayed, in no collective), a parameter no rank used this step (.grad None everywhere: its
moments, weight decay and step count stay) and one only some ranks used (stepped with the mean gradient,
as one device on the whole batch). Float64 on 4 ranks against AdamW on one device."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minipar import comm, launch
from minipar.data.sharded_optimizer import ShardedOptimizer

STEPS, BATCH, WORLD = 6, 16, 4
ATOL = 1e-12          # float64: only the order of the gradient sum differs; a stepped frozen weight is off by ~1e-2
OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


class Net(nn.Module):
    """``body`` trains; ``frozen`` is used but requires no gradient; ``sometimes`` runs on odd steps only;
    ``first_rows`` only on the batch's first quarter (rank 0's rows, so the other ranks never call it)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.frozen, self.body, self.sometimes, self.first_rows = (
            nn.Linear(8, 8), nn.Linear(8, 5), nn.Linear(8, 5), nn.Linear(8, 5))
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))
        self.frozen.requires_grad_(False)
        self.double()

    def forward(self, x, step, rows):
        h = torch.tanh(self.frozen(x))
        out = self.body(h)
        if step % 2:
            out = out + self.sometimes(h)
        quarter = range(0, BATCH // WORLD)
        take = [i for i, r in enumerate(rows) if r in quarter]
        if take:
            out = out.index_add(0, torch.tensor(take), self.first_rows(h[take]))
        return out


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 5, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _loop(model, opt, rank=0, world_size=1):
    per = BATCH // world_size
    rows = list(range(rank * per, (rank + 1) * per))
    for step, (x, y) in enumerate(_data()):
        loss = nn.functional.mse_loss(model(x[rows], step, rows), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _single_device():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), **OPTIONS)
    return _loop(model, opt), opt.state_dict()


def _on_rank(rank, world_size):
    model = Net()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **OPTIONS)
    with comm.recording() as log:
        params = _loop(model, opt, rank, world_size)
    state = opt.state_dict()
    dist.barrier()
    return params, state, log.select(op="reduce_scatter").bytes_sent


@pytest.fixture(scope="module")
def runs():
    return launch(_on_rank, WORLD, quiet=True)


def test_equal_to_single_device_adamw(runs):
    want, _ = _single_device()
    assert not torch.equal(want["sometimes.weight"], Net().sometimes.weight)    # it did train
    for params, _, _ in runs:
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], atol=ATOL, rtol=0, msg=name)


def test_frozen_weights_never_move_and_skipped_steps_are_not_counted(runs):
    start = Net()
    params, state, _ = runs[0]
    assert torch.equal(params["frozen.weight"], start.frozen.weight)        # not decayed: 2·0.99¹⁰ was the bug
    _, want = _single_device()
    assert state["param_groups"] == want["param_groups"]
    assert state["state"].keys() == want["state"].keys()                    # nothing for the frozen ones
    for i, s in want["state"].items():
        for key, value in s.items():
            torch.testing.assert_close(state["state"][i][key], value, atol=ATOL, rtol=0)
    names = [n for n, _ in Net().named_parameters()]
    steps = {names[i]: float(s["step"]) for i, s in state["state"].items()}
    assert steps["sometimes.weight"] == STEPS // 2 and steps["body.weight"] == STEPS


def test_frozen_parameters_cost_no_bytes(runs):
    trainable = sum(p.numel() for p in Net().parameters() if p.requires_grad)
    padded = -(-trainable // WORLD) * WORLD
    sent = runs[0][2]
    # gloo's reduce-scatter is an all-reduce underneath: ring model 2(N-1)/N of the padded buffer, 8 B each
    assert sent == STEPS * comm.predicted_bytes_sent("reduce_scatter", padded * 8, WORLD)


def _unfrozen_late(rank, world_size):
    model = Net()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **OPTIONS)
    model.frozen.requires_grad_(True)
    model(torch.zeros(4, 8, dtype=torch.float64), 0, [99]).sum().backward()
    with pytest.raises(ValueError, match="frozen .* when the ShardedOptimizer was built"):
        opt.step()


def test_a_parameter_unfrozen_after_building_is_a_clear_error():
    launch(_unfrozen_late, 2, quiet=True)
