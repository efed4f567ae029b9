"""minipar's FSDP as a drop-in nn.Module wrapper in the loop a learner writes (``model = FSDP(model)``,
``opt = torch.optim.X(model.parameters())``, backward, step, zero_grad): equal to one device and to
PyTorch's ``fully_shard`` in the same loop (float64, 4 ranks); the mixed-precision policy; the messages."""
import io

import pytest
import torch
import torch.distributed as dist

from minipar import comm, launch
from minipar.check import gpt_recipe
from minipar.data.sharded_parameter import FreedGradientWarning, FreedParameterError
from minipar.data.fsdp import FSDP
from minipar.loop import lm_loss

# 2 steps: SGD momentum's buffer is used from step 2, so a wrong mean or state still shows
RECIPE = gpt_recipe(steps=2, batch_size=8, seq_len=16)
ATOL = 1e-10        # float64: only the order of the gradient sums differs


def _model():
    return RECIPE.model().double()


def _loop(model, opt, rank=0, world_size=1):
    """The user's loop; returns the losses and the first step's gradients (read before the step)."""
    losses, first_grads = [], None
    for inputs, targets in RECIPE.batches:
        per = len(inputs) // world_size
        loss = lm_loss(model(inputs[rank * per:(rank + 1) * per]), targets[rank * per:(rank + 1) * per])
        loss.backward()
        if first_grads is None:
            first_grads = model.full_gradients() if isinstance(model, FSDP) else _torch_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first_grads


def _torch_grads(model):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)        # not scale-invariant: a wrong mean shows


def _on_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    out = {}
    model = FSDP(_model())
    losses, grads = _loop(model, _sgd(model.parameters()), rank, world_size)
    out["ours"] = (losses, grads, model.state_dict())
    out["event steps"] = sorted({step for step, _, _ in model.zero.events})
    # the trained model above is the one the messages and the load-back read: no second or third training
    out["clip and load"] = _clip_and_load(model, rank, world_size)
    out["messages"] = _messages(model)
    model = _model()
    for unit in [*model.blocks, model]:
        fully_shard(unit, mesh=init_device_mesh("cpu", (world_size,)))
    losses, grads = _loop(model, _sgd(model.parameters()), rank, world_size)
    out["torch fully_shard"] = (losses, grads, {n: p.full_tensor().detach().clone()
                                                for n, p in model.named_parameters()})
    out["mixed"] = _mixed(rank, world_size)
    dist.barrier()
    return out


def _messages(model):
    """``model``: trained in the user's loop."""
    lm_loss(model(RECIPE.batches[0][0][:2]), RECIPE.batches[0][1][:2]).backward()
    w = model.module.blocks[0].attn.qkv.weight
    found = {}
    try:
        w.sum()
    except FreedParameterError as e:
        found["sum"] = str(e)
    with pytest.warns(FreedGradientWarning) as caught:
        assert w.grad is None
    found["grad"] = str(caught[0].message)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    found["saved bytes"] = buffer.tell()
    found["shards"] = [tuple(p.shape) for p in model.parameters()]
    return found


def _clip_and_load(trained, rank, world_size):
    """``trained``: trained in the user's loop."""
    model = FSDP(_model())
    inputs, targets = RECIPE.batches[0]
    per = len(inputs) // world_size
    lm_loss(model(inputs[rank * per:(rank + 1) * per]), targets[rank * per:(rank + 1) * per]).backward()
    norm = model.clip_grad_norm_(0.1)
    clipped = model.full_gradients()
    fresh = FSDP(_model())
    fresh.load_state_dict(trained.state_dict())
    return norm, clipped, fresh.state_dict(), trained.state_dict()


def _mixed(rank, world_size):
    model = FSDP(RECIPE.model(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dtypes = {u.label: (u.full.dtype, u.master.dtype) for u in model.zero.units}
    losses, _ = _loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), rank, world_size)
    reduced_bytes = {}
    for reduce_dtype in (torch.float32, None):                  # None: reduce in the compute dtype (bf16)
        model = FSDP(RECIPE.model(), param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        with comm.recording() as log:
            lm_loss(model(RECIPE.batches[0][0][:2]), RECIPE.batches[0][1][:2]).backward()
        reduced_bytes[reduce_dtype] = sum(r.payload_bytes for r in log.records if "reduce_scatter" in r.op)
    return dtypes, losses, reduced_bytes


@pytest.fixture(scope="module")
def runs():
    return launch(_on_rank, 4, quiet=True)


@pytest.fixture(scope="module")
def reference():
    model = _model()
    losses, grads = _loop(model, _sgd(model.parameters()))
    return losses, grads, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("run", ["ours", "torch fully_shard"])
def test_user_loop_equals_one_device(runs, reference, run):
    want_losses, want_grads, want_params = reference
    for rank_out in runs:
        losses, grads, params = rank_out[run]
        mean_loss = sum(r[run][0][0] for r in runs) / len(runs)
        assert mean_loss == pytest.approx(want_losses[0], abs=ATOL)    # the ranks' mean = the batch's
        for name, want in want_grads.items():
            torch.testing.assert_close(grads[name], want, atol=ATOL, rtol=0, msg=f"{run}: grad {name}")
        for name, want in want_params.items():
            torch.testing.assert_close(params[name], want, atol=ATOL, rtol=0, msg=f"{run}: {name}")


def test_events_are_labelled_by_step_in_the_users_loop(runs):
    """The user's optimizer steps the shards, so each backward's end closes a step: the gather/free events
    of the 2 steps carry step labels 0, 1 (before, ZeRO's counter never advanced here)."""
    assert runs[0]["event steps"] == list(range(len(RECIPE.batches)))


def test_ours_equals_torch_fully_shard(runs):
    for rank_out in runs:
        assert rank_out["ours"][0] == pytest.approx(rank_out["torch fully_shard"][0], abs=ATOL)
        for name, p in rank_out["torch fully_shard"][2].items():
            torch.testing.assert_close(rank_out["ours"][2][name], p, atol=ATOL, rtol=0)


def test_parameters_are_the_flat_shards_and_state_dict_is_full(runs, reference):
    found = runs[0]["messages"]
    numel = sum(p.numel() for p in reference[2].values())
    assert sum(n for (n,) in found["shards"]) * 4 >= numel          # one shard per unit, 1/4 of it
    assert found["saved bytes"] > 8 * numel                          # float64, every parameter whole


def test_reading_a_freed_parameter_or_its_gradient_says_what_to_do(runs):
    found = runs[1]["messages"]
    assert "'blocks.0.attn.qkv.weight' is sharded over 4 ranks" in found["sum"]
    assert "reduce-scattered" in found["grad"] and "full_gradients()" in found["grad"]


def test_mixed_precision_policy_keeps_norms_and_masters_in_fp32(runs):
    dtypes, losses, reduced_bytes = runs[0]["mixed"]
    norms = {label: d for label, d in dtypes.items() if ".ln" in label or label == "ln_f"}
    assert norms and all(d == (torch.float32, torch.float32) for d in norms.values())
    others = [d for label, d in dtypes.items() if label not in norms]
    assert others and all(d == (torch.bfloat16, torch.float32) for d in others)
    assert losses[-1] < losses[0]                                    # it trains
    # reduce_dtype=float32 reduce-scatters 4 bytes per element where bf16 would send 2 (norms: 4 in both)
    assert 1.9 < reduced_bytes[torch.float32] / reduced_bytes[None] < 2.0


def test_units_must_cover_the_model():
    model = RECIPE.model()
    with pytest.raises(ValueError, match="in no unit"):
        FSDP(model, units=lambda m: list(m.blocks))


def test_clip_grad_norm_uses_the_global_norm(runs):
    model = _model()
    inputs, targets = RECIPE.batches[0]
    lm_loss(model(inputs), targets).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    for rank_out in runs:
        norm, clipped, _, _ = rank_out["clip and load"]
        assert norm.item() == pytest.approx(want_norm.item(), abs=ATOL)
        for name, p in model.named_parameters():
            torch.testing.assert_close(clipped[name], p.grad, atol=ATOL, rtol=0)


def test_a_full_state_dict_loads_back(runs):
    for rank_out in runs:
        _, _, loaded, saved = rank_out["clip and load"]
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[n], saved[n]) for n in saved)
