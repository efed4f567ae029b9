"""Chapter 13's planted failures, each a small program run on ranks, and the runs the chapter reads.

Every function here plants one bug (a skipped call, another shape, a slow rank, a missing all-reduce, a
wrong divisor, a wrong seed, an overflow) into code of the library, runs it, and returns what the tools
said, so that the chapter's cells stay short.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import multiprocessing
import time

import torch
import torch.distributed as dist

from minipar import RankError, comm, launch
from minipar.check import gpt_recipe, train_steps
from minipar.debug.first_departure import StepRecorder, reference_steps
from minipar.debug.desync import desync_check
from minipar.machine.fidelity import with_ops
from minipar.observe.measure import gather_steps, timed_steps

__all__ = ["skip_one_all_reduce", "planted_hang", "never_issued", "mismatched_shapes", "desync_failure",
           "first_error_line", "straggler_trace", "departure_recipe", "ddp_steps", "tp_steps", "ring_steps",
           "rounding_study", "planted_gradient_bugs", "dropout_replicas", "split_region_masks", "resumed_losses",
           "NaiveSoftmaxNet", "overflow_run", "anomaly_on"]


# 1. A hang and a desync ------------------------------------------------------------------------------

def skip_one_all_reduce(rank, world_size, skipper=2):
    """Five data-parallel steps, each all-reducing a gradient; rank ``skipper``'s third batch is empty (uneven
    data: its shard ran short), and the loop skips an empty batch — and with it that step's all-reduce."""
    batch_sizes = [8, 8, 0 if rank == skipper else 8, 8, 8]
    for step, size in enumerate(batch_sizes, start=1):
        if size == 0:
            continue                          # nothing to train on, so no gradient to all-reduce: the bug
        grad = torch.full((1024,), float(step))   # this step's gradient: every element = the step number
        comm.all_reduce(grad)                 # summed over the ranks: world_size × step if all are in step
        print(f"step {step}: sum {grad[0]:g}")


def planted_hang(program=skip_one_all_reduce, world_size: int = 4, timeout: float = 3.0):
    """Run ``program`` under the launcher with a ``timeout`` s collective timeout: (the error, seconds taken,
    processes left running afterwards)."""
    start = time.monotonic()
    try:
        launch(program, world_size, timeout=timeout, quiet=True)
        error = None
    except RankError as exc:                  # LaunchTimeout is a RankError
        error = exc
    return error, time.monotonic() - start, len(multiprocessing.active_children())


def mismatched_shapes(rank, world_size, checked=True):
    """Two all-reduces; on the second, rank 0 sends 4 numbers and the others 8 (a shape that depends on
    the rank: a remainder, an uneven shard). ``checked``: under the desync check."""
    import faulthandler
    faulthandler.disable()                    # gloo may abort the process on the mismatch itself
    with desync_check() if checked else contextlib.nullcontext():
        comm.all_reduce(torch.ones(3))
        comm.all_reduce(torch.ones(4 if rank == 0 else 8))


def desync_failure(world_size: int = 2, timeout: float = 3.0):
    """The mismatch under the desync check: (error, seconds)."""
    start = time.monotonic()
    try:
        launch(mismatched_shapes, world_size, timeout=timeout, quiet=True)
        return None, time.monotonic() - start
    except RankError as exc:
        return exc, time.monotonic() - start


def first_error_line(error: RankError) -> str:
    """The rank's exception, one line: what the rank raised (from its traceback's last line)."""
    lines = [line for line in error.rank_traceback.strip().splitlines() if line.strip()]
    return lines[-1] if lines else str(error).splitlines()[0]


# 2. Stragglers -----------------------------------------------------------------------------------------

def _work(n: int) -> None:
    a = torch.ones(96, 96)
    for _ in range(n):
        a = (a @ a).clamp_(-1, 1)


def _straggling_rank(rank, world_size, slow_rank, work, extra, steps):
    runs = []
    for counted in (False, True):                     # timed, then once more with its operators counted
        with timed_steps(rank, ops=counted) as run:
            run.tick()
            for _ in range(steps):
                _work(work * (extra if rank == slow_rank else 1))
                comm.all_reduce(torch.ones(4096))     # the gradients' all-reduce: every rank waits here
                run.tick()
        runs.append(run)
    return runs


def straggler_trace(world_size: int = 2, slow_rank: int = 1, work: int = 60, extra: int = 20, steps: int = 5):
    """A traced run in which every rank does ``work`` matmuls a step and ``slow_rank`` does ``extra`` times as
    many (a bigger shard), then all-reduce: the :class:`minipar.observe.measure.Steps` (its ``trace``: the timed
    run, each compute segment with the operators a second, counted run ran:
    :func:`~minipar.machine.fidelity.with_ops`)."""
    ranks = launch(_straggling_rank, world_size, slow_rank, work, extra, steps, quiet=True, timeout=60)
    timed, counted = (gather_steps([r[i] for r in ranks], {"planted": f"rank {slow_rank} does {extra}x the work"})
                      for i in (0, 1))
    return dataclasses.replace(timed, trace=with_ops(timed.trace, counted.trace))


# 3. Silent wrong gradients -------------------------------------------------------------------------------

def departure_recipe(dtype=torch.float64, steps: int = 3):
    """The tiny GPT, 2 layers, SGD, 3 steps, in ``dtype``: small enough to run three ways in seconds."""
    recipe = gpt_recipe(steps=steps, batch_size=8, seq_len=16, optimizer="sgd", n_layer=2, n_embd=32, n_head=4)
    recipe.dtype = dtype
    recipe.batches = [(x, y) for x, y in recipe.batches]
    return recipe


class _Recording:
    """An optimizer factory whose ``step()`` records the model's parameters afterwards, under ``names``."""

    def __init__(self, make, names, recorder):
        self.make, self.names, self.recorder = make, names, recorder

    def __call__(self, params):
        params = list(params)
        opt = self.make(params)
        step, names, recorder = opt.step, self.names, self.recorder

        def recorded_step(*args, **kwargs):
            out = step(*args, **kwargs)
            recorder.record(dict(zip(names, params)))
            return out
        opt.step = recorded_step
        return opt


def _ddp_rank(rank, world_size, recipe, bucket_bytes, wrong_bucket, divisor, from_step):
    from minipar.data import ddp
    if wrong_bucket is not None:              # the planted bug: one bucket divided by the wrong number
        plain, launched = ddp.Reducer.launch, [0]   # launches of that bucket so far = the step

        def launch_bucket(self, bucket):
            if bucket.index == wrong_bucket:
                if launched[0] >= from_step:  # a bug that appears late: the search must walk the steps
                    bucket.buffer.div_(divisor / dist.get_world_size(self.group))
                launched[0] += 1
            plain(self, bucket)
        ddp.Reducer.launch = launch_bucket
    recorder = StepRecorder()
    names = [n for n, _ in recipe.model().named_parameters()]
    recipe.optimizer = _Recording(recipe.optimizer, names, recorder)
    ddp.parallel_train(rank, world_size, recipe, bucket_bytes=bucket_bytes)
    return recorder.steps


def ddp_steps(recipe, world_size: int = 4, bucket_bytes: int = 16 * 1024, wrong_bucket=None, divisor=None,
              from_step: int = 0):
    """Each rank's parameters after every step of minipar's DDP (``wrong_bucket``: that bucket divided by
    ``divisor`` instead of the world size, from step ``from_step`` on, counting from 0)."""
    return launch(_ddp_rank, world_size, recipe, bucket_bytes, wrong_bucket, divisor, from_step, quiet=True,
                  timeout=60)


def _tp_rank(rank, world_size, recipe, missing_f, control=False):
    from minipar.tensor import gpt, layers

    def train():
        recorder = StepRecorder()
        gpt.parallel_train(rank, world_size, recipe, after_step=lambda model: recorder.record(model.full_state_dict()))
        return recorder.steps
    clean = train() if control else None      # the control: the same launch, before the bug is planted
    if missing_f:                             # the planted bug: f's backward all-reduce left out
        layers.copy_to_tp = lambda x, group: x
    return (clean, train()) if control else train()


def tp_steps(recipe, world_size: int = 2, missing_f: bool = False, control: bool = False):
    """Each rank's full parameters after every step of Megatron tensor parallelism (``missing_f``: the
    column-parallel layers' input f, identity forward / all-reduce backward, replaced by identity). ``control``:
    (correct run's, this run's), both from one launch."""
    return _split(launch(_tp_rank, world_size, recipe, missing_f, control, quiet=True, timeout=60), control)


def _split(ranks, control):
    """(control steps per rank, steps per rank) from ranks that returned both pairs, else ``ranks``."""
    return ([r[0] for r in ranks], [r[1] for r in ranks]) if control else ranks


def _ring_rank(rank, world_size, recipe, drop_block, control=False):
    from minipar.sequence import context_parallel, ring_attention
    names = [n for n, _ in recipe.model().named_parameters()]
    make_optimizer = recipe.optimizer

    def train():
        recorder = StepRecorder()
        recipe.optimizer = _Recording(make_optimizer, names, recorder)
        context_parallel.parallel_train(rank, world_size, recipe, method="ring")
        return recorder.steps
    clean = train() if control else None      # the control: the same launch, before the bug is planted
    if drop_block:                            # the planted bug: the backward forgets the dK, dV of one block
        exact = ring_attention.flash_backward

        def backward(q, k, v, d_out, lse, delta, diagonal=False, **kw):
            dq, dk, dv = exact(q, k, v, d_out, lse, delta, diagonal, **kw)
            return (dq, dk, dv) if diagonal else (dq, torch.zeros_like(dk), torch.zeros_like(dv))
        ring_attention.flash_backward = backward
    return (clean, train()) if control else train()


def ring_steps(recipe, world_size: int = 2, drop_block: bool = False, control: bool = False):
    """Each rank's parameters after every step of ring attention (context parallelism); ``drop_block``: the
    backward drops the dK, dV of every block that came from another rank (one block per layer on 2 ranks).
    ``control``: (correct run's, this run's), both from one launch."""
    return _split(launch(_ring_rank, world_size, recipe, drop_block, control, quiet=True, timeout=60), control)


# 5. NaN: the first operator that overflowed ------------------------------------------------------------

class NaiveSoftmaxNet(torch.nn.Module):
    """Linear → softmax written as exp(z) / Σ exp(z) (no max subtracted) → linear, in float16."""

    def __init__(self, width: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up = torch.nn.Linear(width, width).half()
        self.down = torch.nn.Linear(width, 1).half()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)

    def forward(self, x):
        z = self.up(x)
        e = torch.exp(z)                              # float16: exp(z) = inf once z > 11.09
        return self.down(e / e.sum(-1, keepdim=True))


def _overflow_rank(rank, world_size, spike_rank, spike):
    from minipar.debug.nonfinite import first_nonfinite
    model = NaiveSoftmaxNet()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).half()
    if rank == spike_rank:
        x = x * spike                                 # one rank's batch holds a few large inputs
    with first_nonfinite(model) as watch:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        for p in model.parameters():                  # data parallelism: average the gradients
            comm.all_reduce(p.grad)
    found = watch.found
    if found is not None:
        found.rank = rank
    return found, float(loss), all(bool(p.grad.isfinite().all()) for p in model.parameters())


def overflow_run(world_size: int = 2, spike_rank: int = 1, spike: float = 8.0):
    """Every rank trains one step of :class:`NaiveSoftmaxNet`; rank ``spike_rank``'s inputs are ``spike``
    times larger. Per rank: (the first non-finite value born there, its loss, whether its gradients are finite)."""
    return launch(_overflow_rank, world_size, spike_rank, spike, quiet=True, timeout=60)


def anomaly_on(spike: float = 8.0) -> str:
    """PyTorch's ``torch.autograd.detect_anomaly`` on the spiked rank's step, in this process: its message."""
    import warnings
    model = NaiveSoftmaxNet()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).half() * spike
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")               # its forward traceback arrives as a warning
        try:
            with torch.autograd.detect_anomaly():
                model(x).float().pow(2).mean().backward()
        except RuntimeError as exc:
            return str(exc).splitlines()[0]
    return "no error"


# 4. Randomness across ranks ----------------------------------------------------------------------------

def _dropout_rank(rank, world_size, recipe, wrong_rule, steps, seeds=None):
    from minipar.debug.seeds import replica_spread
    from minipar.mesh import Mesh
    from minipar.tensor.gpt import TensorParallelGPT
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    model = TensorParallelGPT(recipe.model().to(recipe.dtype), group)
    if wrong_rule:                            # the planted bug: the replicated regions' stream seeded by rank
        model.streams.replicated.manual_seed(1000 + dist.get_rank())
    if seeds is not None:                     # seeds(seed, tp_rank) -> (replicated, split)
        replicated, split = seeds(0, rank)
        model.streams.replicated.manual_seed(replicated)
        model.streams.per_rank.manual_seed(split)
    opt = recipe.optimizer(model.parameters())
    for inputs, targets in recipe.batches[:steps]:
        opt.zero_grad(set_to_none=True)
        model.loss(inputs, targets).backward()
        model.finish_backward()
        opt.step()
    replicated = {n: p for n, p in model.named_parameters() if n.startswith(("ln_f", "blocks.0.ln1", "pos_emb"))}
    return replica_spread(replicated, group)


def dropout_replicas(wrong_rule: bool = False, world_size: int = 2, steps: int = 2, seeds=None):
    """Tensor parallelism with dropout 0.1: how far the replicated parameters' copies on the TP ranks are
    apart after ``steps`` steps, by Megatron's rule or with the replicated stream seeded per rank
    (``seeds(seed, tp_rank) -> (replicated, split)``: the streams seeded by that function instead)."""
    recipe = gpt_recipe(steps=steps, batch_size=8, seq_len=16, n_layer=2, n_embd=32, n_head=4, dropout=0.1)
    return launch(_dropout_rank, world_size, recipe, wrong_rule, steps, seeds, quiet=True, timeout=60)[0]


def resumed_losses(restore_rng: bool, steps: int = 4, stop: int = 2):
    """TinyGPT with dropout 0.1 (drawing from torch's default generator): the losses of steps ``stop``..
    after a restart at ``stop`` that restores the model and Adam's state, and the RNG state or not —
    beside the losses of the run that never stopped."""
    from minipar.debug.seeds import rng_state, set_rng_state
    recipe = gpt_recipe(steps=steps, batch_size=8, seq_len=16, n_layer=2, n_embd=32, n_head=4, dropout=0.1)

    def train(model, opt, batches):
        return train_steps(recipe, model, opt, batches).losses
    torch.manual_seed(0)
    model = recipe.model()
    opt = recipe.optimizer(model.parameters())
    train(model, opt, recipe.batches[:stop])
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": copy.deepcopy(opt.state_dict()), "rng": rng_state()}
    straight = train(model, opt, recipe.batches[stop:])
    torch.manual_seed(1234)                       # a new process: its generator is wherever it is
    model = recipe.model()
    model.load_state_dict(saved["model"])
    opt = recipe.optimizer(model.parameters())
    opt.load_state_dict(saved["opt"])
    if restore_rng:
        set_rng_state(saved["rng"])
    return straight, train(model, opt, recipe.batches[stop:])


def split_region_masks(p: float = 0.1, shape=(64, 64), seed: int = 1234) -> dict:
    """The dropout masks two TP ranks draw for their halves of a split tensor (their own heads): agreement
    between rank 0's and rank 1's mask by Megatron's rule (tensor-parallel seeds, different per rank) and by
    the wrong one (both from the default seed, the same on every TP rank); ``n`` positions, and ``sd``: the
    standard deviation of independent masks' agreement over n positions, √(q(1 − q)/n), q = (1 − p)² + p²."""
    from minipar.debug.seeds import mask_agreement
    from minipar.rng import megatron_seeds

    def mask(s):
        return torch.empty(shape).bernoulli_(1 - p, generator=torch.Generator().manual_seed(s))
    right = [megatron_seeds(seed, tp_rank=r)["tensor_parallel"] for r in (0, 1)]
    q, n = (1 - p) ** 2 + p ** 2, shape[0] * shape[1]
    wrong = [megatron_seeds(seed, tp_rank=r)["default"] for r in (0, 1)]
    return {"right": mask_agreement(mask(right[0]), mask(right[1])),
            "wrong": mask_agreement(mask(wrong[0]), mask(wrong[1])), "independent": q, "n": n,
            "sd": (q * (1 - q) / n) ** 0.5}


def rounding_study(world_size: int = 4):
    """A correct DDP run against one device in float32 and in float64: the largest departure of each, i.e.
    what rounding alone does when the ranks' gradients are summed in another order."""
    from minipar.debug.first_departure import max_departure
    out = {}
    for dtype in (torch.float32, torch.float64):
        recipe = departure_recipe(dtype)
        out[dtype] = max_departure(reference_steps(recipe), ddp_steps(recipe, world_size))
    return out


def planted_gradient_bugs(tolerance: float) -> tuple:
    """The three planted bugs, each searched against one device in float64 at ``tolerance``; and, from the TP
    and ring launches, a correct run's largest departure (the control: DDP's is :func:`rounding_study`)."""
    from minipar.debug.first_departure import first_departure, max_departure
    recipe = departure_recipe(torch.float64)
    ref = reference_steps(recipe)
    tp_clean, tp_bug = tp_steps(recipe, missing_f=True, control=True)
    ring_clean, ring_bug = ring_steps(recipe, drop_block=True, control=True)
    found = {"TP: f's backward all-reduce missing": first_departure(ref, tp_bug, tolerance),
             "DDP: bucket 1 divided by 2, not 4, from step 2": first_departure(
                 ref, ddp_steps(recipe, wrong_bucket=1, divisor=2, from_step=2), tolerance),
             "ring attention: one block's dK, dV dropped": first_departure(ref, ring_bug, tolerance)}
    return found, {"TP 2": max_departure(ref, tp_clean), "ring attention 2": max_departure(ref, ring_clean)}


def never_issued(flight_text: str):
    """(rank, call number) from the flight recorder's "rank R never issued call #K" line."""
    import re
    m = re.search(r"rank (\d+) never issued call #(\d+)", flight_text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)
