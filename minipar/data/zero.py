"""ZeRO stages 0-3: data parallelism that shards the model states over the N data-parallel ranks
(Rajbhandari, Rasley, Ruwase, He, 2020: "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", arXiv:1910.02054).

DDP keeps a full copy of the parameters, the gradients and the optimizer state on every rank. ZeRO keeps
one copy in total, cut into N shards, and communicates to assemble what each moment of the step needs::

  stage       sharded                    model-state bytes per rank        sent per rank per step
  0 (DDP)     nothing                    (b_p + b_g + K) Ψ                 all-reduce grads       2 b Ψ (N-1)/N
  1 (P_os)    optimizer state            b_p Ψ + b_g Ψ + K Ψ/N             reduce-scatter grads
  2 (P_os+g)  + gradients                b_p Ψ + (b_g + K) Ψ/N             + all-gather params    2 b Ψ (N-1)/N
  3 (P_os+g+p) + parameters              (b_p + b_g + K) Ψ/N               2 all-gathers + 1 r-s  3 b Ψ (N-1)/N

Ψ = parameter count; b_p, b_g, K = bytes per parameter of parameters, gradients, optimizer state (FP32
Adam: 4, 4, 8; mixed-precision Adam: 2, 2, 12 with the FP32 master copy inside K). The calculator is
:mod:`minipar.data.zero_memory`.

How it is built here: every *unit* (a module such as one transformer block; the root unit holds the rest)
keeps its parameters in one flat buffer padded to a multiple of N (a flat parameter, as in FSDP1), and the
module's parameters become views into it. Rank r owns elements ``[r·S, (r+1)·S)``, S = ⌈numel/N⌉: its
``master`` shard, the only thing the optimizer sees, so optimizer state exists for 1/N of the model. Adam
is element-wise, so stepping a flat shard is the same arithmetic as stepping the whole tensors.

* stage 1: full gradients accumulate in a flat buffer; at ``step`` one reduce-scatter leaves this rank
  the sum of its shard, the optimizer updates the shard, an all-gather rebuilds the full parameters.
* stage 2: a unit's gradients are reduce-scattered as soon as its backward is done (when the gradient reaches
  its inputs: the same moment on every rank, whichever parameters each used) and the full gradients are
  dropped: only the shard's gradient survives.
* stage 3: the full parameters exist only while their unit computes: all-gathered before its forward,
  freed after it, all-gathered again before its backward (when the gradient reaches the unit's output),
  freed after its gradients are reduce-scattered. The next unit's all-gather is started early (prefetch)
  in the order recorded during the first step.

Stages 2-3 thus order their collectives by where each rank's program reaches the units, so every rank must run
every unit's forward (as PyTorch's FSDP requires): before each such collective the ranks agree on its unit (an
8-byte all-gather), and a unit some ranks skipped stops every rank with an error naming it and them
(:class:`~minipar.data.units.UnitOrder`, whose docstring gives the cost).

On CPU, gloo's reduce-scatter is an all-reduce in disguise (2x the bytes on the wire); inside
``with comm.ring_algorithms():`` the reduce-scatters and all-gathers run on minipar's send/recv rings, so
that the table's last column is what the sockets carry (ZeRO-1/2 = 1x DDP, ZeRO-3 = 1.5x), observed.
The flat buffer itself — flatten, pad, shard, all-gather, free, reduce-scatter, each collective where it
happens — is :mod:`minipar.data.flat_unit`; this file decides *when* each unit does what.

Mixed precision plugs in with ``param_dtype``: the compute copies (full parameters, gradients, the
collectives) are in that dtype, the FP32 master shards and the optimizer state stay in FP32, and the
reduce-scattered gradient is upcast to FP32 before the optimizer sees it.
"""
from __future__ import annotations

import contextlib

import torch

from ..recipe import RunResult
from ..launcher import launch
from ..loop import backward_in_micro_batches, mean_over_ranks, shard_batch
from ..validation import positive_int
from .flat_unit import FlatUnit
from .units import UnitOrder, block_units, check_units

__all__ = ["ZeRO", "block_units", "check_units", "validate", "parallel_train", "run", "STAGES"]

STAGES = (0, 1, 2, 3)


class ZeRO:
    """Wrap ``model`` for ZeRO stage ``stage`` over ``group``; ``optimizer_factory(shards)`` builds the
    optimizer over this rank's master shards. Use: ``zero.zero_grad(); loss.backward(); zero.step()``.
    ``param_dtype`` / ``reduce_dtype``: the compute copies' and the gradient reduce-scatter's dtype (the
    master shards keep the model's); units whose module is in ``fp32_modules`` compute in the master dtype.

    ``once_per_step`` (for a pipeline, whose step runs m micro-batches' forwards and backwards): the gradients
    of all m accumulate in a full buffer and are reduce-scattered once, after the last; under stage 3 the full
    parameters are all-gathered once at the start of the step (:meth:`gather_for_step`) and freed after the
    optimizer step, instead of around every micro-batch's use of every unit — torchtitan's FSDP with
    ``reshard_after_forward=False`` under pipelining. Collectives per step: one reduce-scatter (+ one
    all-gather) per unit, not m; the price is memory: the full parameters (stage 3) and gradients (stages
    2–3) for the length of the step. Between steps a rank holds only its shards.

    ``replicate_group`` (HSDP, :mod:`minipar.data.hsdp`): ``group`` shards inside a node, and each shard's
    gradient is then averaged over the ranks holding the same shard on the other nodes (one all-reduce of
    Ψ/N_shard per unit, the only traffic that crosses nodes).

    ``async_reduce`` (stages 2–3): each unit's reduce-scatter is posted when its backward ends and waited for
    only before the optimizer step, so it runs while the next units compute their backward — what PyTorch's
    FSDP does on its separate stream; minipar's blocking default exposes every transfer. Same bytes, same
    numbers; under ``comm.ring_algorithms()`` the rings block, so it falls back to blocking."""

    def __init__(self, model, optimizer_factory, stage: int, group=None, units=None, param_dtype=None,
                 prefetch: bool = True, *, reduce_dtype=None, fp32_modules=(), once_per_step: bool = False,
                 replicate_group=None, async_reduce: bool = False):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        self.model, self.stage, self.group, self.prefetch = model, stage, group, prefetch
        self.once_per_step = once_per_step      # a pipeline's m micro-batches: see the class docstring
        self.on_alloc = None          # a measuring observer's callback (minipar.data.zero_measure), or None
        self.events = []                                        # (step, "all-gather"|"free"|..., unit label)
        self.steps_done, self.order = 0, None        # order: the ranks agree on each unit collective (stages 2-3)
        modules = list(units if units is not None else block_units(model))
        check_units(model, modules)
        names = {p: n for n, p in model.named_parameters()}
        claimed: set = set()
        self.units = []
        for module in modules:                                 # each parameter in the first unit that has it
            mine = [p for p in module.parameters() if p not in claimed and p.requires_grad]
            claimed.update(mine)
            if mine:
                dtype = None if any(module is m for m in fp32_modules) else param_dtype
                unit = FlatUnit([names[p] for p in mine], mine, group, stage, dtype, self._allocated,
                                self._on_event, reduce_dtype, accumulate=once_per_step,
                                replicate_group=replicate_group, async_reduce=async_reduce)
                unit.module = module
                self.units.append(unit)
        masters = [u.master for u in self.units]           # (no factory: the caller steps them, see fsdp.FSDP)
        self.optimizer = optimizer_factory(masters) if optimizer_factory is not None else None
        self.forward_order, self.backward_order, self._recording = [], [], True
        if stage >= 2 and not once_per_step:         # one order on every rank: see reduce_at_inputs
            self.order = UnitOrder(self.units, group, replicate_group)      # every rank runs every unit: checked
            for unit in self.units:
                unit.module.register_forward_pre_hook(lambda m, args, u=unit: u.reduce_at_inputs(args))
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda p, u=unit: u.on_param_grad(p))
        if stage == 3 and not once_per_step:
            for unit in self.units:
                unit.module.register_forward_pre_hook(lambda m, a, u=unit: self.before_forward(u))
                unit.module.register_forward_hook(lambda m, a, out, u=unit: self.after_forward(u, out))
        self.zero_grad()

    # --- stage 3: gather, compute, free ---------------------------------------------------------------
    def before_forward(self, unit) -> None:
        """Forward pre-hook of a unit: all-gather its full parameters (and start the next unit's)."""
        unit.gather()
        unit.wait()
        self._prefetch_after(unit, self.forward_order)

    def after_forward(self, unit, output) -> None:
        """Forward hook of a unit: free the gathered parameters; gather them again when the gradient
        reaches the unit's output (the start of its backward)."""
        unit.free()
        tensors = [output] if isinstance(output, torch.Tensor) else [t for t in output if torch.is_tensor(t)]
        for t in tensors:
            if t.requires_grad:
                t.register_hook(lambda grad, u=unit: self.before_backward(u))

    def before_backward(self, unit) -> None:
        unit.gather()
        unit.wait()
        self._prefetch_after(unit, self.backward_order)

    def _prefetch_after(self, unit, order) -> None:
        """Step 1 records the order the units run in; later steps start the next unit's all-gather now."""
        if self._recording:
            if unit not in order:
                order.append(unit)
        elif self.prefetch and unit in order and order.index(unit) + 1 < len(order):
            order[order.index(unit) + 1].gather(async_op=True)

    def _on_event(self, kind, unit) -> None:
        if self.order is not None:                             # before a unit collective: the ranks agree
            self.order.agree(kind, unit)
        self.events.append((self.steps_done, kind, unit.label))

    def _allocated(self, nbytes: int) -> None:
        # Storage resized by hand (gather/free) is invisible to torch's dispatcher: tell an observer.
        if self.on_alloc is not None:
            self.on_alloc(nbytes)

    # --- the step --------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.expect_backward()
        for unit in self.units:
            unit.master.grad = None
            if self.stage <= 1 or self.once_per_step:
                unit.attach_grads()

    def gather_for_step(self) -> None:
        """``once_per_step`` under stage 3: all-gather every unit's full parameters for the whole step."""
        for unit in self.units:
            unit.gather()
        for unit in self.units:
            unit.wait()

    def expect_backward(self) -> None:
        """A new backward is coming (every unit unreduced): after a step, by ``zero_grad``, by ``FSDP.forward``."""
        for unit in self.units:
            unit.reduced = False
        if self.order is not None:
            self.order.new_step()

    def finish_gradients(self, *, ends_step: bool = False) -> None:
        """Reduce what the backward has not reduced yet (stage 1: every full gradient; stages 2–3: the units
        whose inputs need no gradient, in the same order on every rank), so every shard holds its mean gradient.
        ``ends_step``: a caller that steps the optimizer itself (:class:`~minipar.data.fsdp.FSDP`) ends the step here, so ``events`` stay
        labelled by step."""
        for unit in self.units:
            if self.stage <= 1 or (self.once_per_step and not unit.reduced):
                unit.reduce_full_grad()
            elif not unit.reduced:                             # no gradient reached inputs of its own
                unit.gather()
                unit.reduce_grads_now()
        for unit in self.units:
            unit.wait_reduce()                                 # async_reduce: the posted reduce-scatters
        self._recording = False                                # the first backward recorded the order
        if ends_step:
            self.expect_backward()                             # ready for the next backward even without zero_grad()
            self.steps_done += 1

    def step(self) -> None:
        """Reduce what the backward has not reduced yet, update my shards, rebuild the full parameters."""
        self.finish_gradients()
        self.optimizer.step()
        self.expect_backward()
        for unit in self.units:
            if self.stage <= 2:
                unit.refresh_full()
            elif self.once_per_step:
                unit.free()                                    # gathered for the step: shards only now
        self.steps_done += 1

    @contextlib.contextmanager
    def gathered(self):
        """Stage 3: every unit's full parameters for the block, freed after (every rank enters it); between
        steps reading a parameter raises :class:`~minipar.data.sharded_parameter.FreedParameterError`."""
        was = [u.gathered for u in self.units]
        for unit in self.units:
            unit.gather()
        try:
            yield self.model
        finally:
            for unit, kept in zip(self.units, was):
                if not kept:
                    unit.free()

    def load_masters_from_parameters(self) -> None:
        """Copy the full parameters (gathered: every rank holds them) into this rank's master shards, after
        something wrote the parameters (a checkpoint's load); stages 0-2 in the master dtype share storage."""
        with torch.no_grad():
            for unit in self.units:
                unit.master.copy_(unit.my_shard([p.detach() for p in unit.params]))

    def full_parameters(self) -> dict:
        """{name: full tensor} in the master dtype, gathered from the shards (every rank calls this)."""
        return {name: full for unit in self.units
                for name, full in zip(unit.names, unit.full_tensors(unit.master))}

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded_numel for u in self.units)


def validate(recipe, *, world_size: int, stage: int, **config) -> None:
    """Raise ValueError for a configuration that cannot run, before any process starts."""
    if "collectives" in config:
        raise ValueError("ZeRO takes no collectives= flag: run it inside `with comm.ring_algorithms():` (in the "
                         "rank's function) for minipar's send/recv rings, outside it for gloo's")
    positive_int("world_size", world_size)
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
    accum = positive_int("accum_steps", config.get("accum_steps", 1))
    batch = len(recipe.batches[0][0])
    if batch % (world_size * accum):
        raise ValueError(f"global batch {batch} does not split evenly over {world_size} ranks x {accum} micro-batches")


def parallel_train(rank, world_size, recipe, *, stage, units=block_units, param_dtype=None, prefetch=True,
                   group=None, observe=None, accum_steps: int = 1):
    """Train ``recipe`` with ZeRO stage ``stage``; each rank takes its slice of every global batch, in
    ``accum_steps`` micro-batches a step (stage 1 reduce-scatters once a step, stages 2-3 after each). Called
    inside ``with comm.ring_algorithms():`` its bytes move on minipar's send/recv rings (the paper's byte
    counts, observed on CPU), else on torch.distributed's (see :mod:`minipar.data.flat_unit`).

    ``observe(zero, step)`` (optional) runs each step — how :mod:`minipar.data.zero_measure` watches the
    bytes and the memory without living inside the strategy."""
    validate(recipe, world_size=world_size, stage=stage, accum_steps=accum_steps)
    model = recipe.model().to(recipe.dtype)
    zero = ZeRO(model, recipe.optimizer, stage, group, units(model), param_dtype, prefetch)
    losses = []
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        zero.zero_grad()

        def step():
            loss = backward_in_micro_batches(recipe.loss, model, x, y, accum_steps)
            zero.step()
            return loss.float()
        loss = observe(zero, step) if observe is not None else step()
        losses.append(mean_over_ranks(loss, group))
    return RunResult(losses, zero.full_parameters())


def run(recipe, *, world_size: int, stage: int, quiet: bool = True, **config) -> list:
    """Check the configuration, then train on ``world_size`` ranks: per-rank RunResults."""
    validate(recipe, world_size=world_size, stage=stage, **config)
    return launch(parallel_train, world_size, recipe, stage=stage, quiet=quiet, **config)
