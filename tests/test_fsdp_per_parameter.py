"""FSDP with per-parameter sharding (FSDP2's design, ``FSDP(module, per_parameter=True)``): every trainable
parameter sharded on dim 0 and padded, the shard's gradient in its own ``.grad`` (local shape and dtype), a frozen
parameter left whole and a parameter no rank used left with ``.grad`` None; equal to one device after real AdamW
steps in float64 (a toy with a frozen, an every-other-step and a rank-0-only layer; the tiny GPT over its block
units), bytes as the formula. The flat design (``FSDP(module)``) in the same situations: frozen parameters are in no
unit and stay put, but a parameter no rank used is stepped inside the flat shard (what this design cannot avoid)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minipar import comm, launch
from minipar.check import gpt_recipe, train_reference
from minipar.data.fsdp import FSDP, is_norm
from minipar.loop import shard_batch

from test_sharded_optimizer_frozen import BATCH, OPTIONS, Net, _data, _single_device

WORLD, ATOL = 4, 1e-12


def toy_units(model):
    """``sometimes`` a unit of its own (every rank skips it at even steps); ``first_rows`` in the root's unit:
    a unit is gathered by a collective when it runs, so one that only rank 0 runs would wait forever."""
    return [model.sometimes, model]


def _toy_loop(model, opt, rank, world_size, odd_steps_only=False, check=None, everywhere=False):
    """``everywhere``: ``first_rows`` on every row of every rank (else on rank 0's rows only)."""
    per = BATCH // world_size
    rows = list(range(rank * per, (rank + 1) * per))
    for step, (x, y) in enumerate(_data()):
        step = 1 if odd_steps_only else step
        nn.functional.mse_loss(model(x[rows], step, [0] * per if everywhere else rows), y[rows]).backward()
        if check is not None:
            check(step)
        opt.step()
        opt.zero_grad()


def _toy_on_rank(rank, world_size):
    out = {}
    model = FSDP(Net(), per_parameter=True, units=toy_units)
    named = dict(model.module.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in named.items()}
    seen = []

    def check(step):                                      # right after backward, before the optimizer
        seen.append({n: (None if p.grad is None else (tuple(p.grad.shape), p.grad.dtype))
                     for n, p in named.items()})
    _toy_loop(model, torch.optim.AdamW(model.parameters(), **OPTIONS), rank, world_size, check=check)
    out["per-parameter"], out["shapes"], out["grads"] = model.full_state_dict(), shapes, seen
    flat = FSDP(Net(), units=toy_units)
    _toy_loop(flat, torch.optim.AdamW(flat.parameters(), **OPTIONS), rank, world_size, everywhere=True)
    out["flat"] = flat.full_state_dict()
    flat = FSDP(Net(), units=toy_units)         # every trainable layer used at every step, first_rows by rank 0 only
    _toy_loop(flat, torch.optim.AdamW(flat.parameters(), **OPTIONS), rank, world_size, odd_steps_only=True)
    out["flat, all used"] = flat.full_state_dict()
    pieces = FSDP(Net(), units=toy_units, use_orig_params=True)      # FSDP1's answer: per-parameter pieces
    names = [n for n, _ in pieces.named_parameters()]
    seen_pieces = []
    _toy_loop(pieces, torch.optim.AdamW(pieces.parameters(), **OPTIONS), rank, world_size,
              check=lambda step: seen_pieces.append([p.grad is not None for p in pieces.parameters()]))
    out["pieces"], out["piece names"], out["piece grads"] = pieces.full_state_dict(), names, seen_pieces
    out["frozen"] = {n: p.detach().clone() for n, p in flat.module.named_parameters() if n.startswith("frozen")}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def toy():
    return launch(_toy_on_rank, WORLD, quiet=True)


def _everywhere_reference(odd_steps_only, everywhere=True):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), **OPTIONS)
    for step, (x, y) in enumerate(_data()):
        rows = [0] * BATCH if everywhere else list(range(BATCH))
        nn.functional.mse_loss(model(x, 1 if odd_steps_only else step, rows), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_per_parameter_equals_single_device_with_frozen_and_unused_parameters(toy):
    want, _ = _single_device()
    for rank_out in toy:
        assert rank_out["per-parameter"].keys() == want.keys()
        for name, p in rank_out["per-parameter"].items():
            torch.testing.assert_close(p, want[name], atol=ATOL, rtol=0, msg=name)


def test_every_trainable_parameter_has_a_grad_of_its_local_shape_and_dtype(toy):
    full = dict(Net().named_parameters())
    for rank_out in toy:
        for name, shape in rank_out["shapes"].items():
            p = full[name]
            want = p.shape if not p.requires_grad else (-(-p.shape[0] // WORLD), *p.shape[1:])
            assert shape == tuple(want), name                   # dim 0 sharded (padded), frozen kept whole
        for step, grads in enumerate(rank_out["grads"]):
            for name, got in grads.items():
                used = full[name].requires_grad and (step % 2 or not name.startswith("sometimes"))
                assert got == ((rank_out["shapes"][name], torch.float64) if used else None), (step, name)


def test_the_flat_design_leaves_frozen_parameters_but_steps_unused_ones(toy):
    reference = _everywhere_reference(odd_steps_only=True, everywhere=False)
    for rank_out in toy:
        for name, p in rank_out["flat, all used"].items():
            torch.testing.assert_close(p, reference[name], atol=ATOL, rtol=0, msg=name)
        assert torch.equal(rank_out["frozen"]["frozen.weight"], Net().frozen.weight)
    want = _everywhere_reference(odd_steps_only=False)    # "sometimes" unused at even steps: stepped anyway
    assert (toy[0]["flat"]["sometimes.weight"] - want["sometimes.weight"]).abs().max() > 1e-4


# --- the tiny GPT over its block units: equal to one device, and its bytes ---------------------------------

def gpt():
    recipe = gpt_recipe(steps=3, batch_size=8, seq_len=8, n_layer=2, n_embd=20, n_head=2)
    recipe.dtype = torch.float64
    return recipe


def _gpt_on_rank(rank, world_size, recipe):
    model = FSDP(recipe.model().to(recipe.dtype), per_parameter=True)
    opt = recipe.optimizer(model.parameters())
    with comm.recording() as log:
        for inputs, targets in recipe.batches:
            x, y = shard_batch((inputs, targets), rank, world_size)
            recipe.loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    units = [sum(p.numel for p in u.params) for u in model.units]         # T per unit, padded rows included
    return model.full_state_dict(), units, log.by_op()


def test_the_tiny_gpt_equals_one_device_and_moves_the_formulas_bytes():
    recipe = gpt()
    reference = train_reference(recipe).params
    results = launch(_gpt_on_rank, WORLD, recipe, quiet=True)
    for params, _, _ in results:
        for name, p in params.items():
            torch.testing.assert_close(p, reference[name], atol=1e-10, rtol=0, msg=name)
    _, units, ops = results[0]
    assert len(units) == 3                                                # two blocks + the root
    steps, b = len(recipe.batches), 8
    gathers = steps * 2 * len(units)                     # before forward and again before backward
    assert ops["all_gather"][0] == gathers and ops["reduce_scatter"][0] == steps * len(units)
    per_step = sum(comm.predicted_bytes_sent("all_gather", WORLD * t * b, WORLD) for t in units)
    assert ops["all_gather"][1] == pytest.approx(2 * steps * per_step)
    assert ops["reduce_scatter"][1] == pytest.approx(
        steps * sum(comm.predicted_bytes_sent("reduce_scatter", WORLD * t * b, WORLD) for t in units))


def test_norms_are_recognised_by_what_they_are():
    class RMSNorm(nn.Module):                 # a learner's own
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
    marked = Scale()
    marked.is_norm = True
    assert is_norm(RMSNorm()) and is_norm(nn.LayerNorm(4)) and is_norm(marked) and is_norm(Scale(), (Scale,))
    assert not is_norm(Scale()) and not is_norm(nn.Linear(4, 4)) and not is_norm(nn.LayerNorm(4, elementwise_affine=False))


class LearnerRMSNorm(nn.Module):
    """x / rms(x) · w (Zhang & Sennrich 2019), as a learner writes it: not a torch.nn class."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        self.seen_dtype = x.dtype
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _norm_on_rank(rank, world_size):
    model = nn.Sequential(nn.Linear(8, 8), LearnerRMSNorm(8), nn.Linear(8, 4))
    wrapped = FSDP(model, units=lambda m: [m], param_dtype=torch.bfloat16)
    out = wrapped(torch.randn(2, 8, dtype=torch.bfloat16))       # the input in the compute dtype
    dtypes = {u.label: u.full.dtype for u in wrapped.zero.units}
    flat = dtypes, model[1].seen_dtype, out.dtype
    model = nn.Sequential(nn.Linear(8, 8), LearnerRMSNorm(8), nn.Linear(8, 4))
    wrapped = FSDP(model, units=lambda m: [m], param_dtype=torch.bfloat16, per_parameter=True)
    out = wrapped(torch.randn(2, 8, dtype=torch.bfloat16))
    out.float().sum().backward()
    dtypes = [[(p.full.dtype, p.shard.grad.dtype) for p in u.params] for u in wrapped.units]
    return flat, (dtypes, model[1].seen_dtype, out.dtype)


def test_a_learners_rmsnorm_computes_in_fp32_under_a_16_bit_policy():
    for flat, per_parameter in launch(_norm_on_rank, 2, quiet=True):
        dtypes, seen, out = flat
        assert dtypes == {"1": torch.float32, "(root)": torch.bfloat16}
        assert seen == torch.float32 and out == torch.bfloat16
        dtypes, seen, out = per_parameter                   # the norm a unit of its own, gathered in FP32
        f32, b16 = (torch.float32, torch.float32), (torch.bfloat16, torch.float32)   # (compute, .grad = shard's)
        assert dtypes == [[f32], [b16] * 4]
        assert seen == torch.float32 and out == torch.bfloat16


def test_flat_shards_with_use_orig_params_skip_what_no_rank_used_as_one_device(toy):
    want, _ = _single_device()                            # sometimes: unused at even steps; first_rows: rank 0's rows
    trainable = [n for n, p in Net().named_parameters() if p.requires_grad]
    for rank_out in toy:
        assert sorted(rank_out["piece names"]) == sorted(trainable)      # the module's names, frozen left out
        for name, p in rank_out["pieces"].items():
            torch.testing.assert_close(p, want[name], atol=ATOL, rtol=0, msg=name)
        for step, has_grad in enumerate(rank_out["piece grads"]):
            expect = [step % 2 == 1 or not n.startswith("sometimes") for n in rank_out["piece names"]]
            assert has_grad == expect, step
