"""Per-parameter FSDP composed with replication, and its prefetch.

Replication: each ``Linear`` and ``Embedding`` a unit (``fully_shard`` on the big layers), the LayerNorms in none
(``replicate`` on the rest): the norms stay whole on every rank, their gradients averaged by one all-reduce, bit for
bit the same on every rank after each backward and equal to one device's (float64, 4 ranks, 3 AdamW steps: the
gradients and the trained parameters within 1e-12; only the order of the sums differs). Under a 16-bit policy the
norms in no unit are replicated too, not sharded as units of their own.

Prefetch: from the second step on, when a unit's forward begins, the next unit's all-gather is already posted and
not yet finished (its handle in flight while the unit computes), and the events show it posted before the unit's
forward ends; in the backward likewise. The first step (recording the order) and ``prefetch=False`` gather each
unit only when it is reached. Either way the run equals one device. A unit's reduce-scatter is posted when the
gradient reaches its inputs (as ``ZeRO(async_reduce=True)``), before the earlier units' backward runs."""
import torch
import torch.nn as nn

from minipar import launch
from minipar.data.fsdp import FSDP
from minipar.data.units import UnitOrderError
from minipar.course.ch03_zero_and_fsdp.composition import LM   # the chapter's model: embedding, norms, head
from minipar.loop import shard_batch

VOCAB, DIM, BATCH, SEQ, WORLD, STEPS, ATOL = 16, 8, 8, 4, 4, 3, 1e-12


def big_layers(model):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def _loss(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _train(model, rank=0, world_size=1):
    norms = [model.module.norm, model.module.norm2] if world_size > 1 else [model.norm, model.norm2]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for x, y in _batches():
        x, y = shard_batch((x, y), rank, world_size)
        _loss(model(x), y).backward()
        grads.append({f"{i}.{n}": p.grad.clone() for i, m in enumerate(norms) for n, p in m.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads


def _replicated_on_rank(rank, world_size):
    model = FSDP(LM(), per_parameter=True, units=big_layers)
    shapes = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
    optimized = {id(p) for p in model.parameters()}
    norms = [*model.module.norm.parameters(), *model.module.norm2.parameters()]
    norms_optimized = all(id(p) in optimized for p in norms)
    grads = _train(model, rank, world_size)
    policy = FSDP(LM().float(), per_parameter=True, units=big_layers, param_dtype=torch.bfloat16)
    _loss(policy(torch.randint(0, VOCAB, (2, SEQ))), torch.randint(0, VOCAB, (2, SEQ))).backward()
    bf16 = [tuple(p.shape) for p in policy.replicated], [(tuple(p.grad.shape), p.grad.dtype) for p in policy.replicated]
    return model.state_dict(), grads, shapes, norms_optimized, bf16


def test_norms_in_no_unit_are_replicated_and_train_as_one_device():
    reference = LM()
    want_grads = _train(reference)
    want = reference.state_dict()
    results = launch(_replicated_on_rank, WORLD, quiet=True)
    for params, grads, shapes, norms_optimized, (bf16_shapes, bf16_grads) in results:
        assert shapes["norm.weight"] == (DIM,) and shapes["mid.weight"] == (DIM // WORLD, DIM)   # whole; sharded
        assert norms_optimized
        assert bf16_shapes == [(DIM,)] * 4 and bf16_grads == [((DIM,), torch.float32)] * 4   # replicated, FP32
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], atol=ATOL, rtol=0, msg=name)
        for step, (got, expected) in enumerate(zip(grads, want_grads)):
            for name, g in got.items():
                torch.testing.assert_close(g, expected[name], atol=ATOL, rtol=0, msg=f"step {step} {name}")
                assert torch.equal(g, results[0][1][step][name]), f"step {step} {name}: differs between ranks"


def _prefetch_on_rank(rank, world_size, prefetch):
    model = FSDP(LM(), per_parameter=True, units=big_layers, prefetch=prefetch)
    in_flight = []                                       # at each unit's forward: is the next one's gather posted?
    for i, unit in enumerate(model.units[:-1]):
        unit.module.register_forward_pre_hook(
            lambda m, a, i=i: in_flight.append((model.steps_done, i, model.units[i + 1].in_flight is not None)))
    _train(model, rank, world_size)
    return model.state_dict(), model.events, in_flight, [u.label for u in model.units]


def _position(events, step, what, label):
    return events.index((step, what, label))


def test_the_next_units_all_gather_is_in_flight_while_a_unit_computes():
    reference = LM()
    _train(reference)
    want = reference.state_dict()
    on, off = launch(_prefetch_on_rank, 2, True, quiet=True), launch(_prefetch_on_rank, 2, False, quiet=True)
    for params, events, in_flight, labels in on + off:
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], atol=ATOL, rtol=0, msg=name)
    _, events, in_flight, labels = on[0]
    assert labels == ["emb", "mid", "head"]                       # the forward order
    assert in_flight == [(0, 0, False), (0, 1, False)] + [(s, i, True) for s in range(1, STEPS) for i in (0, 1)]
    for step in range(1, STEPS):
        for this, after in zip(labels, labels[1:]):               # forward: posted before this unit's forward ends
            assert _position(events, step, "all-gather posted", after) < _position(events, step, "forward done", this)
        for this, after in zip(labels[::-1], labels[-2::-1]):     # backward: before this unit's backward ends
            posted = [i for i, e in enumerate(events) if e == (step, "all-gather posted", after)][-1]
            assert posted < _position(events, step, "backward done", this)
            assert posted < _position(events, step, "backward", after)
        for unit in ("head", "mid"):                             # reduce-scatters posted inside the backward,
            posted = _position(events, step, "reduce-scatter posted", unit)          # while emb's is to come
            assert posted < _position(events, step, "backward", "emb")
        emb = _position(events, step, "reduce-scatter posted", "emb")    # its input (the tokens) needs no
        assert emb > _position(events, step, "backward done", "emb")      # gradient: reduced at the end
    _, events, in_flight, _ = off[0]
    assert not any(flying for _, _, flying in in_flight)
    for step in range(STEPS):
        for this, after in zip(labels, labels[1:]):
            assert _position(events, step, "forward done", this) < _position(events, step, "all-gather posted", after)


class SkipsLater(nn.Module):
    """Three blocks and a head; ``skip``: block 1 does not run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks, self.out = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 1)

    def forward(self, x, skip):
        for i, block in enumerate(self.blocks):
            x = x if skip and i == 1 else torch.tanh(block(x))
        return self.out(x)


def _skips_at_step_three(rank, world_size):
    model = FSDP(SkipsLater(), per_parameter=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(3):
            model(torch.randn(2, 4), skip=step == 2 and rank == 1).sum().backward()
            opt.step()
            opt.zero_grad()
    except UnitOrderError as error:
        return str(error)


def test_a_unit_skipped_after_the_prefetch_order_is_recorded_is_still_named():
    """Step 3, prefetching the order step 1 recorded: rank 1 skips block 1; both ranks stop, naming it."""
    for error in launch(_skips_at_step_three, 2, quiet=True, timeout=60):
        assert error is not None and "unit 'blocks.1' ran its forward on rank 0 only: rank 1 skipped it" in error
