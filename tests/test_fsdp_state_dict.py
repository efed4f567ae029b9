"""``FSDP(...).state_dict()`` is the wrapped module's full state dict in all three designs (flat, use_orig_params,
per_parameter): every key of the module's own ``state_dict()``, full shapes, buffers (BatchNorm's statistics, a
registered buffer) and frozen parameters included, equal to one device's after the same AdamW steps (float64,
4 ranks); ``load_state_dict`` takes it back, and so does the unwrapped module. Freezing a parameter after
wrapping says so, instead of speaking of a read."""
import pytest
import torch
import torch.nn as nn

from minipar import launch
from minipar.data.fsdp import FSDP
from minipar.data.sharded_parameter import FrozenAfterWrappingError

STEPS, BATCH, WORLD, ATOL = 3, 16, 4, 1e-12
OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
MODES = {"flat": {}, "use_orig_params": dict(use_orig_params=True), "per_parameter": dict(per_parameter=True)}


class Net(nn.Module):
    """Two blocks (one with an eval-mode BatchNorm whose statistics are buffers), a frozen layer, a buffer."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.frozen = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)),
                                     nn.Sequential(nn.Linear(8, 8), nn.Tanh())])
        self.head = nn.Linear(8, 3)
        self.register_buffer("scale", torch.tensor(0.5))
        for t in [*self.parameters(), self.blocks[0][1].running_mean, self.blocks[0][1].running_var, self.scale]:
            with torch.no_grad():
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
        self.frozen.requires_grad_(False)
        self.blocks[0][1].eval()                    # statistics kept: the math is one device's on any rows
        self.double()

    def forward(self, x):
        h = self.frozen(x) * self.scale
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _train(model, rows):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPTIONS)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 8, generator=g, dtype=torch.float64)
        y = torch.randn(BATCH, 3, generator=g, dtype=torch.float64)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def _on_rank(rank, world_size):
    out, per = {}, BATCH // world_size
    for mode, options in MODES.items():
        model = FSDP(Net(), **options)
        _train(model, list(range(rank * per, (rank + 1) * per)))
        saved = model.state_dict()
        fresh = FSDP(Net(seed=1), **options)
        fresh.load_state_dict(saved)
        plain = Net(seed=1)
        plain.load_state_dict(saved)                            # a checkpoint the unwrapped model takes
        out[mode] = saved, fresh.state_dict(), plain.state_dict()
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_on_rank, WORLD, quiet=True, timeout=120)


@pytest.fixture(scope="module")
def one_device():
    model = Net()
    _train(model, list(range(BATCH)))
    return model.state_dict()


@pytest.mark.parametrize("mode", list(MODES))
def test_state_dict_has_every_key_whole_equal_to_one_device(runs, one_device, mode):
    """Was: flat and use_orig_params left out frozen.* , scale and the BatchNorm statistics; per_parameter gave
    this rank's (2, 8) shards under 'module.'-prefixed names."""
    for rank_out in runs:
        saved = rank_out[mode][0]
        assert list(saved) == list(one_device)
        for name, want in one_device.items():
            assert saved[name].shape == want.shape, name
            torch.testing.assert_close(saved[name], want, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("mode", list(MODES))
def test_load_state_dict_takes_back_what_state_dict_gave(runs, mode):
    for rank_out in runs:
        saved, reloaded, plain = rank_out[mode]
        for loaded in (reloaded, plain):
            assert loaded.keys() == saved.keys()
            assert all(torch.equal(loaded[n], saved[n]) for n in saved)


def _load_without(rank, world_size, key):
    try:
        FSDP(Net()).load_state_dict({k: v for k, v in Net().state_dict().items() if k != key})
    except RuntimeError as error:
        return str(error)
    return "loaded"


def test_a_state_dict_that_lacks_a_buffer_is_refused_naming_it():
    for message in launch(_load_without, 2, "scale", quiet=True, timeout=60):
        assert "missing keys ['scale']" in message


def _freeze_after_wrapping(rank, world_size):
    model = FSDP(Net(), use_orig_params=True)
    try:
        model.module.head.weight.requires_grad_(False)
    except FrozenAfterWrappingError as error:
        return str(error)
    return "no error"


def test_freezing_after_wrapping_says_what_happened_and_what_to_do():
    """Was: FreedParameterError, 'reading it would read released memory'."""
    for message in launch(_freeze_after_wrapping, 2, quiet=True, timeout=60):
        assert "'head.weight': requires_grad set to False after wrapping" in message
        assert "Set requires_grad before wrapping" in message
