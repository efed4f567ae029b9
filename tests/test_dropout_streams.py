"""Tensor-parallel dropout masks are a function of (seed, step, stream, tp rank), as GPU generators are
counter-based: a run resumed from a checkpoint draws the masks the uninterrupted run drew (the streams need
no place in the checkpoint), and an activation checkpoint's recomputation replays its forward's masks
(torch.utils.checkpoint restores torch's global generator only: before, a 3D run with dropout 0.2 and full
recomputation ended 4e-2 away from the same run without it) — in the pipeline runtime's stages and in
minipar.recompute's selective and full modes of tensor-parallel blocks alike. Float64, bit for bit."""
import torch

from minipar import launch
from minipar.check import gpt_recipe
from minipar.hybrid import checkpoint
from minipar.hybrid.parallel3d import Trainer3D
from minipar.rng import DropoutStreams, megatron_seeds

LAYOUT = dict(dp=1, pp=2, tp=2, micro_batches=2)


def recipe():
    r = gpt_recipe(steps=3, batch_size=4, seq_len=16, dropout=0.2)
    r.dtype = torch.float64
    return r


def _train(rank, world_size, rec, layout, steps, directory=None, resume=False):
    t = Trainer3D(rank, world_size, rec, **layout)
    start = checkpoint.load(t, directory) if resume else 0
    for i in range(start, steps):
        t.step(*rec.batches[i], i)
    if directory is not None and not resume:
        checkpoint.save(t, directory, steps)
    return t.full_params()


def _assert_equal(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for name in x:
            assert torch.equal(x[name], y[name]), name


def test_full_recomputation_draws_the_forwards_masks():
    plain = launch(_train, 4, recipe(), LAYOUT, 3, quiet=True)
    recomputed = launch(_train, 4, recipe(), {**LAYOUT, "recompute": "full"}, 3, quiet=True)
    _assert_equal(plain, recomputed)


def test_a_resumed_run_draws_the_uninterrupted_runs_masks(tmp_path):
    straight = launch(_train, 4, recipe(), LAYOUT, 3, quiet=True)
    launch(_train, 4, recipe(), LAYOUT, 2, str(tmp_path), quiet=True)
    resumed = launch(_train, 4, recipe(), LAYOUT, 3, str(tmp_path), True, quiet=True)
    _assert_equal(straight, resumed)


def _draws(rank, world_size):
    streams = DropoutStreams(7, None)
    out = []
    for step in (0, 1, 0):
        streams.start_step(step)
        out.append((torch.rand(4, generator=streams.replicated), torch.rand(4, generator=streams.per_rank)))
    return out


def test_each_step_draws_other_masks_and_the_streams_differ_where_they_must():
    (rep0, per0), (rep1, per1), (rep0_again, per0_again) = (r0 := launch(_draws, 2, quiet=True))[0]
    assert torch.equal(rep0, rep0_again) and torch.equal(per0, per0_again)      # a function of the step
    assert not torch.equal(rep0, rep1) and not torch.equal(per0, per1) and not torch.equal(rep0, per0)
    (other_rep0, other_per0), *_ = r0[1]
    assert torch.equal(rep0, other_rep0) and not torch.equal(per0, other_per0)   # replicated agrees, per-rank not


def _first_draws(rank, world_size):
    streams = DropoutStreams(7, None)
    want = megatron_seeds(7, tp_rank=rank)
    replicated, per_rank = torch.Generator().manual_seed(want["default"]), torch.Generator().manual_seed(
        want["tensor_parallel"])
    return (torch.equal(torch.rand(4, generator=streams.replicated), torch.rand(4, generator=replicated)),
            torch.equal(torch.rand(4, generator=streams.per_rank), torch.rand(4, generator=per_rank)))


def test_the_streams_follow_megatrons_seed_rule_on_every_rank():
    """Step 0's two streams are seeded by minipar.rng.megatron_seeds: seed, and seed + 2718 + tp_rank (one
    rule for the streams and the chapter-13 tools; the streams once added 1000 · rank)."""
    assert launch(_first_draws, 3, quiet=True) == [(True, True)] * 3


def _tp_grads(rank, world_size, mode):
    from minipar.mesh import Mesh
    from minipar.recompute import apply_recompute
    from minipar.tensor.gpt import TensorParallelGPT
    rec = recipe()
    model = TensorParallelGPT(rec.model().to(rec.dtype), Mesh(world_size, tp=world_size).build(rank).group("tp"))
    if mode != "none":
        apply_recompute(model, mode)
    inputs, targets = rec.batches[0]
    model.loss(inputs, targets).backward()
    model.finish_backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_selective_and_full_recomputation_of_tensor_parallel_blocks_draw_the_forwards_masks():
    plain = launch(_tp_grads, 2, "none", quiet=True)
    for mode in ("selective", "full"):
        _assert_equal(plain, launch(_tp_grads, 2, mode, quiet=True))
