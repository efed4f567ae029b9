"""DDP from scratch: equals one device on the global batch, equals torch's DDP on the same run, buckets
overlap backward, no_sync accumulates (and the pitfall of misusing it is caught), unused and frozen
parameters do not hang, a 16-bit wire halves the bytes.

Tolerances: float32 defaults of minipar.check (atol 2e-5, rtol 1e-4: the all-reduce sums the ranks' partial
gradients in another order than one device does); bit-exact (0, 0) with one rank; bf16 on the wire gets
minipar.check's bf16 tolerance (2e-2, 2e-2).
"""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar import comm, launch
from minipar.data.ddp_measure import REDUCER_PARTS, reducer_cpu, watch_buckets
from minipar.check import RunResult, check_equivalence, gpt_recipe, mlp_recipe, Recipe, compare, train_reference
from minipar.data import ddp
from minipar.loop import shard_batch
from minipar.course.ch02_data_parallelism.measure import ours_vs_torch

QUIET = dict(quiet=True)
BUCKET = 16 * 1024  # several buckets for the tiny GPT (~115 KiB of fp32 gradients)


def test_four_ranks_match_one_device_with_several_buckets():
    recipe = gpt_recipe(steps=2, batch_size=8)     # 2 steps: Adam's state is used from step 2
    grads = sum(p.numel() * 4 for p in recipe.model().parameters())
    assert grads > 4 * BUCKET  # the run really uses several buckets
    check_equivalence(ddp.parallel_train, 4, recipe, bucket_bytes=BUCKET, launch_kwargs=QUIET).assert_ok()


def test_one_rank_is_bit_exact():
    recipe = gpt_recipe(steps=2, batch_size=8)     # 2 steps: Adam's state is used from step 2
    c = check_equivalence(ddp.parallel_train, 1, recipe, atol=0, rtol=0, bucket_bytes=BUCKET, launch_kwargs=QUIET)
    assert c.matches and c.max_abs_diff == 0.0, str(c)


def _scrambled_start(rank, world_size, recipe):
    """Ranks other than 0 start from different weights: only the initial broadcast can save them."""
    original = recipe.model

    def model():
        m = original()
        if rank != 0:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.1 * (rank + 1))
        return m
    return ddp.parallel_train(rank, world_size, Recipe(model, recipe.batches, recipe.optimizer), bucket_bytes=BUCKET)


def test_initial_broadcast_makes_replicas_equal():
    check_equivalence(_scrambled_start, 2, mlp_recipe(steps=2), launch_kwargs=QUIET).assert_ok()


def test_equals_torch_ddp_on_the_same_run():
    # chapter 02's side-by-side: minipar's DDP and torch's on the same shards, gradients and parameters
    # Both average with a gloo all-reduce, but torch lays out its buckets differently (a 1 MiB first
    # bucket, rebuilt after step 1 in the order gradients arrived), and gloo's reduction order depends on
    # the layout: equal up to float summation order (~1e-8 here), not bit for bit.
    # 2 steps: step 2 already runs on torch's buckets as rebuilt after step 1
    recipe = gpt_recipe(steps=2, batch_size=8, optimizer="sgd")
    for worst_grad, worst_param in launch(ours_vs_torch, 4, recipe, BUCKET, **QUIET):
        assert worst_grad <= 1e-7 and worst_param <= 1e-6, (worst_grad, worst_param)


def _bytes_per_step(rank, world_size, recipe, **kwargs):
    log = comm.CommLog()
    ddp.parallel_train(rank, world_size, recipe, step_log=log, **kwargs)
    return log.bytes_sent / recipe.steps, log.count("all_reduce") / recipe.steps


def test_bytes_per_step_are_the_ring_formula_and_accumulation_does_not_add_any():
    recipe = gpt_recipe(steps=2, batch_size=8)
    grad_bytes = sum(p.numel() * 4 for p in recipe.model().parameters())
    n = 4
    formula = 2 * (n - 1) / n * grad_bytes
    for accum in (1, 2):
        results = launch(_bytes_per_step, n, recipe, bucket_bytes=BUCKET, accum_steps=accum, **QUIET)
        for sent, calls in results:
            assert sent == pytest.approx(formula, rel=1e-9)   # one bucket's rounding aside: exact
            assert calls > 1                                  # several buckets, once per optimizer step
    bf16 = launch(_bytes_per_step, n, recipe, bucket_bytes=BUCKET, comm_dtype=torch.bfloat16, **QUIET)
    assert bf16[0][0] == pytest.approx(formula / 2, rel=1e-9)


def test_no_sync_accumulation_matches_one_device():
    check_equivalence(ddp.parallel_train, 2, gpt_recipe(steps=2, batch_size=8), bucket_bytes=BUCKET,
                      accum_steps=2, launch_kwargs=QUIET).assert_ok()


def test_bf16_on_the_wire_stays_within_bf16_tolerance():
    recipe = mlp_recipe(steps=2)                   # 2 steps: the bf16-rounded average feeds Adam's state by step 2
    c = check_equivalence(ddp.parallel_train, 4, recipe, comm_dtype=torch.bfloat16, bucket_bytes=1024,
                          atol=2e-2, rtol=2e-2, launch_kwargs=QUIET)
    c.assert_ok()
    assert c.max_abs_diff > 0  # it is really rounded on the wire, not silently float32


def _grads_as_bucket_views(rank, world_size, recipe):
    """Two steps of two micro-batches (no_sync, then synced): the first after zero_grad(set_to_none=True),
    the second after zero_grad(set_to_none=False), which keeps the gradients and backward accumulates into
    them in place. Per step: is every .grad its bucket slot (same memory), and the largest difference from
    the global batch's gradient on one device; then the same for a bfloat16 wire."""
    out = []
    for comm_dtype in (None, torch.bfloat16):
        model, alone = recipe.model(), recipe.model()
        wrapped = ddp.DistributedDataParallel(model, bucket_bytes=1024, comm_dtype=comm_dtype)
        slots = {id(p): v for b in wrapped.reducer.buckets for p, v in zip(b.params, b.views)}
        for set_to_none, batch in zip((True, False), recipe.batches):
            model.zero_grad(set_to_none=set_to_none)
            alone.zero_grad(set_to_none=True)
            recipe.loss(alone, *batch).backward()                 # one device, the global batch
            x, y = shard_batch(batch, rank, world_size)
            for i, (mx, my) in enumerate(zip(x.chunk(2), y.chunk(2))):
                with wrapped.no_sync() if i == 0 else contextlib.nullcontext():
                    (recipe.loss(wrapped, mx, my) / 2).backward()
            views = [p.grad.data_ptr() == slots[id(p)].data_ptr() for p in model.parameters()]
            worst = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), alone.parameters()))
            out.append((comm_dtype, set_to_none, all(views), not any(views), worst))
    return out


def test_gradients_are_views_of_the_buckets_so_nothing_is_copied_back():
    """PyTorch's gradient_as_bucket_view: the reduced bucket is the gradient (no copy out after the
    all-reduce; a kept .grad is accumulated into in place, no copy in either), and it is the right
    gradient with and without set_to_none. With bfloat16 on the wire .grad stays float32, cast back."""
    for rank_rows in launch(_grads_as_bucket_views, 2, mlp_recipe(steps=2, batch_size=8), **QUIET):
        for comm_dtype, set_to_none, all_views, no_views, worst in rank_rows:
            if comm_dtype is None:
                assert all_views and worst <= 1e-6, (set_to_none, worst)
            else:
                assert no_views and worst <= 2e-2, (set_to_none, worst)


def _overlap(rank, world_size, recipe):
    model = ddp.DistributedDataParallel(recipe.model(), bucket_bytes=BUCKET)
    timeline = watch_buckets(model)
    x, y = shard_batch(recipe.batches[0], rank, world_size)
    recipe.loss(model, x, y).backward()
    grads = [t for kind, _, t, _ in timeline if kind == "grad"]
    launches = sorted(t0 for kind, _, t0, _ in timeline if kind == "comm")
    labels = sorted(label for kind, label, _, _ in timeline if kind == "comm")
    names = sorted(label for kind, label, _, _ in timeline if kind == "grad")
    return (len(model.reducer.buckets), launches[0] < max(grads), len(launches), labels,
            names == sorted(n for n, _ in model.module.named_parameters()),
            all(t0 <= t1 for kind, _, t0, t1 in timeline))


def test_first_bucket_is_launched_while_backward_is_still_running():
    """Watched from outside (minipar.data.ddp_measure.watch_buckets): one "grad" event per parameter, one
    "comm" event per bucket (launch <= completion), and the first launch before the last gradient."""
    for n_buckets, overlapped, launched, labels, every_grad, ordered in \
            launch(_overlap, 2, gpt_recipe(steps=1, batch_size=8), **QUIET):
        assert n_buckets > 1 and launched == n_buckets
        assert labels == sorted(f"bucket {i}" for i in range(n_buckets)) and every_grad and ordered
        assert overlapped  # launched before the last gradient was even computed


def _reducer_cpu(rank, world_size, recipe):
    """One backward through a plain DDP and one through a DDP whose reducer is timed by parts."""
    import time
    x, y = shard_batch(recipe.batches[0], rank, world_size)
    plain, timed = (ddp.DistributedDataParallel(recipe.model(), bucket_bytes=BUCKET) for _ in range(2))
    parts = reducer_cpu(timed)
    recipe.loss(plain, x, y).backward()
    start = time.thread_time()
    recipe.loss(timed, x, y).backward()
    backward = time.thread_time() - start
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.module.parameters(), timed.module.parameters()))
    return parts, backward, same, len(timed.reducer.buckets)


def test_reducer_cpu_splits_the_reducers_work_into_exclusive_parts_without_changing_a_gradient():
    """minipar.data.ddp_measure.reducer_cpu (``bench ddp --where``): every part was seen, the parts are
    exclusive (their sum is within the backward's CPU, which also holds the model's own backward), and the
    timed DDP's gradients equal the untimed one's bit for bit."""
    for parts, backward, same, n_buckets in launch(_reducer_cpu, 2, gpt_recipe(steps=1, batch_size=8), **QUIET):
        assert n_buckets > 1 and same
        assert list(parts) == list(REDUCER_PARTS)
        assert all(seconds > 0 for seconds in parts.values()), parts
        assert sum(parts.values()) < backward, (parts, backward)


def _accumulate(rank, world_size, recipe, wrong: bool):
    """Two micro-batches per step. Right: no_sync on the first, sync on the second. Wrong (a common slip):
    everything under no_sync, so the gradients are never averaged and the replicas drift apart."""
    model = recipe.model()
    wrapped = ddp.DistributedDataParallel(model, bucket_bytes=BUCKET)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        opt.zero_grad(set_to_none=True)
        local = torch.zeros(())
        for i, (mx, my) in enumerate(zip(x.chunk(2), y.chunk(2))):
            ctx = wrapped.no_sync() if (wrong or i == 0) else contextlib.nullcontext()
            with ctx:
                loss = recipe.loss(wrapped, mx, my) / 2
                loss.backward()
            local += loss.detach()
        opt.step()
        losses.append(comm.all_reduce(local).item() / world_size)
    in_sync = ddp.replicas_in_sync(model)
    return in_sync, RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def test_no_sync_pitfall_is_caught():
    recipe = mlp_recipe(steps=2, batch_size=16)
    ref = train_reference(recipe)
    right = launch(_accumulate, 2, recipe, False, **QUIET)
    wrong = launch(_accumulate, 2, recipe, True, **QUIET)
    # Nothing crashes and the losses even look plausible; replicas_in_sync sees the drift ...
    assert all(ok for ok, _ in right) and not any(ok for ok, _ in wrong)
    # ... and so does the harness, comparing every rank's parameters with one device.
    ok = compare(ref, [r for _, r in right])
    bad = compare(ref, [r for _, r in wrong])
    assert ok.matches, str(ok)
    assert not bad.matches and bad.max_abs_diff > 1e-3


class PartlyUsed(nn.Module):
    """A frozen parameter, a branch never used, a branch used only when asked (like CS336's toy models)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
            self.never_used = nn.Linear(16, 4)
            self.sometimes = nn.Linear(16, 4)
        self.frozen_scale = nn.Parameter(torch.full((4,), 2.0), requires_grad=False)
        self.use_sometimes = False

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        out = self.fc2(h) * self.frozen_scale
        return out + self.sometimes(h) if self.use_sometimes else out


def _partly_used_recipe():
    from minipar.datasets import regression_batches
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731 - Adam would move a zero-gradient parameter
    return Recipe(PartlyUsed, regression_batches(8, 8, 4, 3), adam)


def _sometimes_on_rank0(rank, world_size, steps=3):
    """The same steps with minipar's DDP and torch's (both find_unused_parameters=True): a branch only rank 0
    takes, one no rank takes, a frozen scale. Per step every gradient (None where there is none), then
    the parameters after Adam."""
    out = {}
    wrappers = {"ours": lambda m: ddp.DistributedDataParallel(m, bucket_bytes=256, find_unused_parameters=True),
                "torch": lambda m: nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)}
    for name, wrap in wrappers.items():
        model = PartlyUsed()
        model.use_sometimes = rank == 0
        wrapped, opt = wrap(model), torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        grads = []
        for step in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
            opt.zero_grad(set_to_none=True)
            wrapped(x).sum().backward()
            grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
        out[name] = grads, {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_unused_and_frozen_parameters_do_not_hang_and_match_one_device():
    recipe = _partly_used_recipe()
    c = check_equivalence(ddp.parallel_train, 2, recipe, bucket_bytes=256, find_unused_parameters=True,
                          launch_kwargs=QUIET)
    c.assert_ok()


def test_unused_parameters_get_what_torch_ddp_gives_them_none_where_no_rank_used_them():
    """Used on rank 0 only: the average (rank 1 counts zero); used on no rank: grad None, so Adam leaves it
    alone (a zero gradient would not: its moments move it); frozen: never touched. Equal to torch's DDP."""
    for rank_result in launch(_sometimes_on_rank0, 2, **QUIET):
        (ours, ours_params), (theirs, theirs_params) = rank_result["ours"], rank_result["torch"]
        for step_ours, step_theirs in zip(ours, theirs):
            assert {n for n, g in step_ours.items() if g is None} == {"never_used.weight", "never_used.bias",
                                                                      "frozen_scale"}
            assert {n for n, g in step_ours.items() if g is None} == {n for n, g in step_theirs.items() if g is None}
            for n, g in step_ours.items():
                if g is not None:
                    torch.testing.assert_close(g, step_theirs[n], atol=1e-6, rtol=1e-5)
        for n, t in ours_params.items():
            torch.testing.assert_close(t, theirs_params[n], atol=1e-6, rtol=1e-5)
        assert torch.equal(ours_params["never_used.weight"], PartlyUsed().never_used.weight)   # not moved


def _unused_without_the_flag(rank, world_size):
    wrapped = ddp.DistributedDataParallel(PartlyUsed(), bucket_bytes=256)
    wrapped(torch.randn(4, 8)).sum().backward()


def test_an_unused_parameter_without_find_unused_parameters_is_an_error_naming_it():
    from minipar.launcher import RankError
    with pytest.raises(RankError, match=r"never_used\.weight.*find_unused_parameters=True"):
        launch(_unused_without_the_flag, 2, **QUIET)


class Skippable(nn.Module):
    """A layer a rank may skip entirely: its backward then reaches no parameter at all."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)
        self.skip = False

    def forward(self, x):
        return x * 2.0 if self.skip else self.lin(x)


def _no_gradient_on_rank1(rank, world_size, find_unused):
    model = Skippable()
    model.skip = rank == 1
    wrapped = ddp.DistributedDataParallel(model, find_unused_parameters=find_unused)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    alone = Skippable()
    alone.skip = model.skip
    alone(x).sum().backward()
    local = alone.lin.weight.grad
    wrapped(x).sum().backward()
    return local, model.lin.weight.grad


def test_a_rank_whose_backward_reaches_no_parameter_still_takes_part_instead_of_hanging():
    """Before: rank 1 never started the buckets' all-reduce and rank 0 waited for it forever."""
    from minipar.launcher import RankError
    (local0, got0), (local1, got1) = launch(_no_gradient_on_rank1, 2, True, timeout=60, **QUIET)
    assert local1 is None
    torch.testing.assert_close(got0, local0 / 2)
    torch.testing.assert_close(got1, local0 / 2)
    with pytest.raises(RankError, match=r"rank 1: parameter\(s\) \['lin.bias', 'lin.weight'\]"):
        launch(_no_gradient_on_rank1, 2, False, timeout=60, **QUIET)


def test_bad_input_is_a_value_error_before_any_process_starts():
    with pytest.raises(ValueError, match="not divisible"):
        ddp.run(gpt_recipe(steps=1, batch_size=6), world_size=4)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ddp.run(gpt_recipe(steps=1, batch_size=8), world_size=4, bucket_bytes=0)
    with pytest.raises(ValueError, match="comm_dtype"):
        ddp.DistributedDataParallel(nn.Linear(2, 2), comm_dtype=torch.int8)


@pytest.mark.parametrize("n", [3, 4])
def test_a_bucket_divides_once_before_it_is_sent_bit_for_bit_as_each_gradient_over_n(n):
    from minipar.data.buckets import Bucket
    params = [nn.Parameter(torch.zeros(5, 3)), nn.Parameter(torch.zeros(7))]
    grads = [torch.randn(5, 3) * 1e3, torch.randn(7) * 1e-30]     # large and subnormal-bound values too
    for p, g in zip(params, grads):
        p.grad = g.clone()
    bucket = Bucket(0, params, divisor=n)
    assert not bucket.fill(params[0]) and bucket.fill(params[1])
    assert torch.equal(params[0].grad, grads[0])                     # copied in, not yet divided
    bucket.scale()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g / n) and p.grad.data_ptr() >= bucket.buffer.data_ptr()
