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
* stage 2: a unit's gradients are reduce-scattered as soon as its backward is done and the full gradients
  are dropped: only the shard's gradient survives.
* stage 3: the full parameters exist only while their unit computes: all-gathered before its forward,
  freed after it, all-gathered again before its backward (when the gradient reaches the unit's output),
  freed after its gradients are reduce-scattered. The next unit's all-gather is started early (prefetch)
  in the order recorded during the first step.

Mixed precision plugs in with ``param_dtype``: the compute copies (full parameters, gradients, the
collectives) are in that dtype, the FP32 master shards and the optimizer state stay in FP32, and the
reduce-scattered gradient is upcast to FP32 before the optimizer sees it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..check import RunResult
from ..memory import LiveTensorTracker, tensor_bytes

__all__ = ["FlatUnit", "ZeRO", "block_units", "parallel_train", "measure_stages", "validate", "ZeroRunResult",
           "STAGES"]

STAGES = (0, 1, 2, 3)


class FlatUnit:
    """One unit's parameters as one padded flat buffer; this rank owns (and the optimizer updates) 1/N."""

    def __init__(self, names, params, group, stage, param_dtype=None, on_alloc=None, on_event=None):
        self.names, self.params, self.group, self.stage = names, params, group, stage
        self.label = _common_prefix(names)
        self.on_event = on_event or (lambda kind, unit: None)
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = -(-self.numel // self.n)            # S = ceil(numel / N)
        self.padded_numel = self.shard_numel * self.n          # the last shard carries the padding
        self.on_alloc = on_alloc or (lambda nbytes: None)
        master_dtype = params[0].dtype
        flat = torch.zeros(self.padded_numel, dtype=master_dtype, device=params[0].device)
        flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in params])
        mine = self.owned()
        compute_dtype = param_dtype or master_dtype
        if compute_dtype == master_dtype and stage < 3:
            self.full = flat                                   # FP32: the master shard is a view of it
            self.master = nn.Parameter(flat[mine])
        else:
            self.full = flat.to(compute_dtype)                 # compute copy; FP32 master kept apart
            self.master = nn.Parameter(flat[mine].clone())
        offset = 0
        for p in params:                                       # the module now computes with views of `full`
            p.data = self.full[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.full_grad = torch.zeros_like(self.full) if stage <= 1 else None
        self.gathered, self.work, self.sending, self.grads_ready, self.reduced = True, None, None, 0, False
        if stage == 3:
            self.free()

    def owned(self) -> slice:
        """This rank's elements of the flat buffer (everything under stage 0)."""
        if self.stage == 0:
            return slice(0, self.padded_numel)
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)

    # --- parameters: gather / free (stage 3) and rebuild after the update (stages 0-2) ---------------
    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into the full buffer (re-allocating its storage first)."""
        if self.gathered:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.full.numel() * self.full.element_size())
        self.on_alloc(storage.nbytes())
        self.on_event("all-gather", self)
        self.sending = self.master.detach().to(self.full.dtype)    # (kept alive until the gather is done)
        work = comm.all_gather_into_tensor(self.full, self.sending, group=self.group, async_op=async_op)
        self.work = work if async_op else None                # (the blocking call returns the tensor)
        self.gathered = True
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work = self.sending = None

    def free(self) -> None:
        """Give the full parameters' memory back; the views (and autograd's saved ones) stay, storage-less."""
        if not self.gathered:
            return
        self.wait()
        storage = self.full.untyped_storage()
        self.on_alloc(-storage.nbytes())
        self.on_event("free", self)
        storage.resize_(0)
        self.gathered = False

    def refresh_full(self) -> None:
        """After the optimizer step (stages 0-2): put the updated shards back into every rank's full copy."""
        if self.stage == 0:
            if self.full.data_ptr() != self.master.data_ptr():
                self.full.copy_(self.master.detach())
            return
        mine = self.full[self.owned()]
        if mine.data_ptr() != self.master.data_ptr():
            mine.copy_(self.master.detach())                   # cast to the compute dtype
        comm.all_gather_into_tensor(self.full, mine, group=self.group)   # in place: my shard is my piece

    # --- gradients -----------------------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Stages 0-1: the module's .grad are views of one persistent flat gradient buffer."""
        self.full_grad.zero_()
        offset = 0
        for p in self.params:
            p.grad = self.full_grad[offset: offset + p.numel()].view_as(p)
            offset += p.numel()

    def reduce_full_grad(self) -> None:
        """Stage 0: all-reduce the whole buffer. Stage 1: reduce-scatter it, in place, into my shard."""
        if self.stage == 0:
            comm.all_reduce(self.full_grad, group=self.group)
            mine = self.full_grad
        else:
            mine = self.full_grad[self.owned()]
            comm.reduce_scatter_tensor(mine, self.full_grad, group=self.group)
        self._set_master_grad(mine)

    def reduce_grads_now(self) -> None:
        """Stages 2-3, when the unit's backward is done: reduce-scatter its gradients, keep only my shard."""
        pieces = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in self.params]
        pad = self.padded_numel - self.numel
        flat = torch.cat(pieces + [pieces[0].new_zeros(pad)])
        mine = flat.new_empty(self.shard_numel)
        comm.reduce_scatter_tensor(mine, flat, group=self.group)
        self.on_event("reduce-scatter", self)
        for p in self.params:
            p.grad = None
        self._set_master_grad(mine)
        self.reduced = True
        if self.stage == 3:
            self.free()

    def _set_master_grad(self, summed) -> None:
        grad = summed.to(self.master.dtype).div_(self.n)       # mean over ranks = gradient of the global batch
        if self.master.grad is None or self.stage <= 1:
            self.master.grad = grad
        else:
            self.master.grad += grad

    def on_param_grad(self, _param) -> None:
        self.grads_ready += 1
        if self.grads_ready == len(self.params):
            self.reduce_grads_now()


def _common_prefix(names) -> str:
    """'blocks.0' for a block's parameters; '(root)' when they share no module."""
    module_paths = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*module_paths):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) or "(root)"


def block_units(model: nn.Module) -> list:
    """The default wrapping: one unit per transformer block (``model.blocks``), then the root (the rest)."""
    return [*getattr(model, "blocks", []), model]


class ZeRO:
    """Wrap ``model`` for ZeRO stage ``stage`` over ``group``; ``optimizer_factory(shards)`` builds the
    optimizer over this rank's master shards. Use: ``zero.zero_grad(); loss.backward(); zero.step()``."""

    def __init__(self, model, optimizer_factory, stage: int, group=None, units=None, param_dtype=None,
                 prefetch: bool = True):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        self.model, self.stage, self.group, self.prefetch = model, stage, group, prefetch
        self.tracker = None                                     # a LiveTensorTracker while measuring
        self.events = []                                        # (step, "all-gather"|"free"|..., unit label)
        self.steps_done = 0
        names = {p: n for n, p in model.named_parameters()}
        claimed: set = set()
        self.units = []
        for module in (units if units is not None else block_units(model)):
            mine = [p for p in module.parameters() if p not in claimed and p.requires_grad]
            claimed.update(mine)
            if mine:
                unit = FlatUnit([names[p] for p in mine], mine, group, stage, param_dtype, self._note_alloc,
                                lambda kind, u: self.events.append((self.steps_done, kind, u.label)))
                unit.module = module
                self.units.append(unit)
        left = [n for p, n in names.items() if p not in claimed and p.requires_grad]
        if left:
            raise ValueError(f"parameters in no unit: {left[:3]}; include the root module in `units`")
        self.optimizer = optimizer_factory([u.master for u in self.units])
        self.forward_order, self.backward_order, self._recording = [], [], True
        if stage >= 2:
            for unit in self.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda p, u=unit: u.on_param_grad(p))
        if stage == 3:
            for unit in self.units:
                unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._before_forward(u))
                unit.module.register_forward_hook(lambda m, a, out, u=unit: self._after_forward(u, out))
        self.zero_grad()

    # --- stage 3: gather, compute, free ---------------------------------------------------------------
    def _before_forward(self, unit) -> None:
        unit.gather()
        unit.wait()
        self._prefetch_after(unit, self.forward_order)

    def _after_forward(self, unit, output) -> None:
        unit.free()
        tensors = [output] if isinstance(output, torch.Tensor) else [t for t in output if torch.is_tensor(t)]
        for t in tensors:
            if t.requires_grad:
                t.register_hook(lambda grad, u=unit: self._before_backward(u))

    def _before_backward(self, unit) -> None:
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

    def _note_alloc(self, nbytes: int) -> None:
        """Storage resized by hand is invisible to the dispatcher: tell the tracker about it."""
        if self.tracker is not None:
            self.tracker.current += nbytes
            self.tracker.peak = max(self.tracker.peak, self.tracker.current)

    # --- the step --------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for unit in self.units:
            unit.master.grad, unit.grads_ready, unit.reduced = None, 0, False
            if self.stage <= 1:
                unit.attach_grads()

    def step(self) -> None:
        """Reduce what the backward has not reduced yet, update my shards, rebuild the full parameters."""
        for unit in self.units:
            if self.stage <= 1:
                unit.reduce_full_grad()
            elif not unit.reduced:                             # a unit with unused parameters
                unit.gather()
                unit.reduce_grads_now()
        self.optimizer.step()
        if self.stage <= 2:
            for unit in self.units:
                unit.refresh_full()
        self._recording = False
        self.steps_done += 1

    def full_parameters(self) -> dict:
        """{name: full tensor} in the master dtype, gathered from the shards (every rank calls this)."""
        out = {}
        for unit in self.units:
            full = unit.master.new_empty(unit.padded_numel)
            if self.stage == 0:
                full.copy_(unit.master.detach())
            else:
                comm.all_gather_into_tensor(full, unit.master.detach(), group=self.group)
            offset = 0
            for name, p in zip(unit.names, unit.params):
                out[name] = full[offset: offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return out

    def model_state_bytes(self) -> dict:
        """Live bytes on this rank: compute parameters, gradients, optimizer state (FP32 masters count
        as parameters when they are the compute copy, as optimizer state under mixed precision)."""
        params, grads, opt = [], [], []
        for u in self.units:
            params.append(u.full)
            (params if u.master.dtype == u.full.dtype else opt).append(u.master)
            grads += [g for g in [u.master.grad, u.full_grad, *(p.grad for p in u.params)] if g is not None]
        for state in self.optimizer.state.values():
            opt += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(opt)}

    def measure(self, step_fn):
        """Run ``step_fn()`` and return (its result, peak live bytes = model states at the start + the
        peak of what the step allocated, gathered parameters included)."""
        baseline = sum(self.model_state_bytes().values())
        self.tracker = LiveTensorTracker()
        try:
            with self.tracker:
                result = step_fn()
        finally:
            peak, self.tracker = self.tracker.peak, None
        return result, baseline + peak

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded_numel for u in self.units)


@dataclass
class ZeroRunResult(RunResult):
    """A :class:`RunResult` plus what was measured on this rank."""
    bytes_sent: list = field(default_factory=list)     # per step, from the minipar.comm log
    memory: dict = field(default_factory=dict)         # model-state bytes after the last step + "peak"
    numel: int = 0                                     # Ψ
    padded_numel: int = 0                              # Ψ with each unit padded to a multiple of N


def validate(recipe, world_size: int, stage: int) -> None:
    """Raise ValueError for a configuration that cannot run, before any process starts."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
    batch = len(recipe.batches[0][0])
    if batch % world_size:
        raise ValueError(f"the global batch of {batch} does not split evenly over {world_size} ranks")


def parallel_train(rank, world_size, recipe, stage, units=block_units, param_dtype=None, prefetch=True,
                   measure=False, group=None):
    """Train ``recipe`` with ZeRO stage ``stage``; each rank takes its slice of every global batch."""
    validate(recipe, world_size, stage)
    model = recipe.model().to(recipe.dtype)
    zero = ZeRO(model, recipe.optimizer, stage, group, units(model), param_dtype, prefetch)
    losses, sent, peak = [], [], 0
    for inputs, targets in recipe.batches:
        per = len(inputs) // world_size
        x, y = inputs[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]
        zero.zero_grad()

        def step():
            loss = recipe.loss(model, x, y)
            loss.backward()
            zero.step()
            return loss.detach().float()
        with comm.recording() as log:
            loss, step_peak = zero.measure(step) if measure else (step(), 0)
        sent.append(log.bytes_sent)
        peak = max(peak, step_peak)
        losses.append(comm.all_reduce(loss.clone(), group=group).item() / world_size)
    memory = {**zero.model_state_bytes(), "peak": peak} if measure else {}
    return ZeroRunResult(losses, zero.full_parameters(), sent, memory, zero.numel, zero.padded_numel)


def measure_stages(rank, world_size, recipe, stages=STAGES, units=block_units, param_dtype=None) -> dict:
    """Every stage in one launch, measured (for tests, tables and figures): {stage: ZeroRunResult}."""
    return {s: parallel_train(rank, world_size, recipe, s, units, param_dtype, measure=True) for s in stages}
