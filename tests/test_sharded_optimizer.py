"""The drop-in ZeRO-1 optimizer in a plain user loop (param groups, AdamW, an LR scheduler), float64 on 4
ranks: equal to single-device AdamW, to itself under DDP with average_gradients=False, and to PyTorch's
ZeroRedundancyOptimizer; its state_dict is AdamW's on one device and loads back."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minipar import comm, launch
from minipar.data.sharded_optimizer import ShardedOptimizer
from minipar.models import MLP

STEPS, BATCH, SIZES = 4, 16, (16, 48, 40, 8)
ATOL = 1e-12          # float64: only the order of the gradient sum differs; a wrong mean is off by ~1e-3
OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, SIZES[0], generator=g, dtype=torch.float64),
             torch.randn(BATCH, SIZES[-1], generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _groups(model):
    """Weight decay on the matrices only: two parameter groups, as most training scripts have."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]


def _loop(model, opt, rank=0, world_size=1, steps=STEPS, data=None):
    """The loop a learner writes: forward, backward, step, zero_grad, scheduler."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for x, y in (data or _data())[:steps]:
        per = BATCH // world_size
        loss = torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model


def _single_device():
    model = MLP(SIZES, seed=0).double()
    opt = torch.optim.AdamW(_groups(model), **OPTIONS)
    _loop(model, opt)
    return model, opt


def _params(model):
    module = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _on_rank(rank, world_size):
    out = {}
    model = MLP(SIZES, seed=0).double()
    ours = ShardedOptimizer(_groups(model), torch.optim.AdamW, **OPTIONS)
    with comm.recording() as log:
        out["ours"] = _params(_loop(model, ours, rank, world_size))
    out["ops"] = log.by_op()
    out["state"] = ours.state_dict()
    model = TorchDDP(MLP(SIZES, seed=0).double())
    opt = ShardedOptimizer(_groups(model.module), torch.optim.AdamW, average_gradients=False, **OPTIONS)
    with comm.recording() as log:                        # torch's DDP is not in minipar's log: only ours
        out["ours under DDP"] = _params(_loop(model, opt, rank, world_size))
    out["ops under DDP"] = log.by_op()
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = TorchDDP(MLP(SIZES, seed=0).double())
    opt = ZeroRedundancyOptimizer(_groups(model.module), optimizer_class=torch.optim.AdamW, **OPTIONS)
    out["torch ZeroRedundancyOptimizer"] = _params(_loop(model, opt, rank, world_size))
    # A checkpoint of single-device AdamW after 2 steps loads into the sharded optimizer, which goes on.
    ref_model = MLP(SIZES, seed=0).double()
    ref_opt = torch.optim.AdamW(_groups(ref_model), **OPTIONS)
    _loop(ref_model, ref_opt, steps=2)
    model = MLP(SIZES, seed=0).double()
    model.load_state_dict(ref_model.state_dict())
    resumed = ShardedOptimizer(_groups(model), torch.optim.AdamW, **OPTIONS)
    resumed.load_state_dict(ref_opt.state_dict())
    out["resumed"] = _params(_loop(model, resumed, rank, world_size, data=_data()[2:]))
    out["lr after the schedule"] = [g["lr"] for g in ours.inner.param_groups]
    assert [g["lr"] for g in ours.param_groups] == [1e-2 / (STEPS + 1)] * 2     # the scheduler's own view
    out["state numel on this rank"] = sum(v.numel() for s in ours.inner.state.values() for v in s.values()
                                          if torch.is_tensor(v) and v.dim())
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_on_rank, 4, quiet=True)


@pytest.fixture(scope="module")
def reference():
    return _single_device()


@pytest.mark.parametrize("run", ["ours", "ours under DDP", "torch ZeroRedundancyOptimizer"])
def test_equal_to_single_device_adamw(runs, reference, run):
    want = _params(reference[0])
    for rank_out in runs:
        for name, p in rank_out[run].items():
            torch.testing.assert_close(p, want[name], atol=ATOL, rtol=0, msg=f"{run}: {name}")


def test_equal_to_torch_zero_redundancy_optimizer(runs):
    for name, p in runs[0]["ours"].items():
        torch.testing.assert_close(p, runs[0]["torch ZeroRedundancyOptimizer"][name], atol=ATOL, rtol=0)


def test_state_dict_is_single_device_adamw_state(runs, reference):
    want = reference[1].state_dict()
    got = runs[0]["state"]
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][i][key], value, atol=ATOL, rtol=0)


def test_a_single_device_checkpoint_loads_and_training_goes_on(runs, reference):
    # The resumed run restarts its scheduler at step 0, so compare with a reference that does the same.
    ref_model = MLP(SIZES, seed=0).double()
    ref_opt = torch.optim.AdamW(_groups(ref_model), **OPTIONS)
    _loop(ref_model, ref_opt, steps=2)
    _loop(ref_model, ref_opt, data=_data()[2:])
    for name, p in runs[0]["resumed"].items():
        torch.testing.assert_close(p, _params(ref_model)[name], atol=ATOL, rtol=0)


def test_the_scheduler_reached_the_inner_optimizer_and_state_is_a_quarter(runs, reference):
    # The inner optimizer takes the outer groups' options at each step: the last step ran at lr 1e-2 / 4.
    assert runs[0]["lr after the schedule"] == [pytest.approx(1e-2 / STEPS)] * 2
    group_numels = [sum(p.numel() for p in g["params"]) for g in reference[1].param_groups]
    per_rank = 2 * sum(-(-n // 4) for n in group_numels)           # exp_avg + exp_avg_sq of one shard
    held = [r["state numel on this rank"] for r in runs]
    assert sum(held) == 2 * sum(group_numels)                       # every element's moments, once
    assert all(per_rank - 2 * 2 * 3 <= h <= per_rank for h in held)   # a quarter each (less the padding)


def test_under_ddp_it_does_not_average_again(runs):
    # Averaging gradients that DDP already averaged gives the same numbers, so only the log can tell:
    # alone, one reduce-scatter and one all-gather per group per step (and one all-reduce of a flag per
    # parameter: which have a gradient on some rank); under DDP, the all-gathers only.
    calls = STEPS * 2
    assert {op: n for op, (n, _) in runs[0]["ops"].items()} == {"reduce_scatter": calls,
                                                                "all_gather": calls, "all_reduce": STEPS}
    assert {op: n for op, (n, _) in runs[0]["ops under DDP"].items()} == {"all_gather": calls}


def test_bad_optimizer_class_is_a_clear_error():
    with pytest.raises(ValueError, match="torch.optim.Optimizer class"):
        ShardedOptimizer([torch.zeros(1, requires_grad=True)], "adamw")
