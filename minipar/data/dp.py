"""DataParallel in one process with threads, the way ``torch.nn.DataParallel`` works.

One Python process drives N devices. Every step makes five exchanges, all through device 0:

====  ===========================================  ==============================  =====================
 #    exchange                                     direction                       bytes moved
====  ===========================================  ==============================  =====================
 1    scatter the input batch                      device 0 → others               (N-1)/N · |x|
 2    replicate the model (every step!)            device 0 → others               (N-1) · P
 3    gather the outputs (the loss is on device 0) others → device 0               (N-1)/N · |y|
 4    scatter ∂loss/∂outputs (gather's backward)   device 0 → others               (N-1)/N · |y|
 5    reduce the replicas' gradients               others → device 0               (N-1) · P
====  ===========================================  ==============================  =====================

(P: parameter bytes, x: inputs, y: outputs.) Device 0's traffic grows with N and device 0 does more work
(the loss, the optimizer), while the others wait. The replicas' forwards run in Python threads
(``parallel_apply``): the GIL serializes the Python parts, only the kernels (which release it) overlap.
Exchange 4 is the gradient of the loss with respect to the outputs, not the loss itself, as sources
sometimes say. On CPU every "device" is the same memory; the copies are still made and counted, so the
code and the bytes are those of a GPU run.

Paszke et al. 2019 (PyTorch); the design ``torch.nn.DataParallel`` documents.
"""
from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.func import functional_call

from .. import comm
from ..loop import lm_loss
from ..recipe import RunResult

__all__ = ["DataParallel", "Replicate", "Gather", "ExchangeLog", "predicted_exchange_bytes", "step_on_ranks",
           "validate", "run"]


@dataclass
class ExchangeLog:
    """Device-to-device copies made by :class:`DataParallel`: [(exchange, bytes)], and thread spans."""
    copies: list = field(default_factory=list)
    spans: list = field(default_factory=list)      # (replica, start, end) of each forward thread

    def add(self, exchange: str, nbytes: int) -> None:
        self.copies.append((exchange, int(nbytes)))

    def by_exchange(self) -> dict:
        table: dict = {}
        for name, n in self.copies:
            table[name] = table.get(name, 0) + n
        return table

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.copies)


def predicted_exchange_bytes(n: int, param_bytes: int, input_bytes: int, output_bytes: int) -> dict:
    """The table above: bytes each exchange moves in one step on ``n`` devices."""
    return {"scatter inputs": (n - 1) / n * input_bytes, "replicate model": (n - 1) * param_bytes,
            "gather outputs": (n - 1) / n * output_bytes, "scatter output grads": (n - 1) / n * output_bytes,
            "reduce grads": (n - 1) * param_bytes}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Replicate(torch.autograd.Function):
    """Forward: copy device 0's parameters to every device (exchange 2).
    Backward: sum every replica's gradient into device 0 (exchange 5)."""

    @staticmethod
    def forward(ctx, devices, log, *params):
        ctx.devices, ctx.log, ctx.n_params = devices, log, len(params)
        log.add("replicate model", (len(devices) - 1) * _nbytes(params))
        return tuple(p.detach().to(d, copy=True) for d in devices for p in params)

    @staticmethod
    def backward(ctx, *grads):
        n, home = ctx.n_params, ctx.devices[0]
        per_replica = [grads[i * n:(i + 1) * n] for i in range(len(ctx.devices))]
        ctx.log.add("reduce grads", (len(ctx.devices) - 1) * _nbytes(per_replica[0]))
        summed = [sum(g[j].to(home) for g in per_replica) for j in range(n)]
        return (None, None, *summed)


class Gather(torch.autograd.Function):
    """Forward: concatenate the replicas' outputs on device 0 (exchange 3).
    Backward: split ∂loss/∂output and send each piece back to its replica (exchange 4)."""

    @staticmethod
    def forward(ctx, log, *outputs):
        ctx.log, ctx.rows = log, [o.shape[0] for o in outputs]
        ctx.devices = [o.device for o in outputs]
        log.add("gather outputs", _nbytes(outputs[1:]))
        return torch.cat([o.to(ctx.devices[0], copy=True) for o in outputs])

    @staticmethod
    def backward(ctx, grad):
        pieces = grad.split(ctx.rows)
        ctx.log.add("scatter output grads", _nbytes(pieces[1:]))
        return (None, *(p.to(d, copy=True) for p, d in zip(pieces, ctx.devices)))


class DataParallel(nn.Module):
    """``DataParallel(module, devices)``: ``forward(x)`` scatters ``x`` on dim 0 over ``devices``, runs a
    fresh replica per device in its own thread, and returns the gathered output on ``devices[0]``.
    Compute the loss on that output; ``backward`` leaves the summed gradient in ``module``'s parameters,
    and the optimizer steps there. ``module`` must live on ``devices[0]``."""

    def __init__(self, module: nn.Module, devices: list):
        super().__init__()
        if len(devices) < 1:
            raise ValueError("DataParallel needs at least one device")
        self.module, self.devices = module, [torch.device(d) for d in devices]
        self.log = ExchangeLog()
        # One module object per thread (functional_call swaps weights into a module: threads sharing one
        # would race). Their own weights are never used; each step's replicated weights are passed in.
        self._shells = [copy.deepcopy(module).to(d) for d in self.devices]

    def forward(self, x):
        n = len(self.devices)
        if x.shape[0] % n:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split evenly over {n} devices")
        # 1. scatter the batch (inputs need no gradient: plain copies)
        chunks = [c.to(d, copy=True) for c, d in zip(x.chunk(n), self.devices)]
        self.log.add("scatter inputs", _nbytes(chunks[1:]))
        # 2. replicate: differentiable copies, so backward sums the replicas' gradients into the module
        names = [name for name, _ in self.module.named_parameters()]
        copies = Replicate.apply(self.devices, self.log, *self.module.parameters())
        replicas = [dict(zip(names, copies[i * len(names):(i + 1) * len(names)])) for i in range(n)]
        # 3. parallel_apply (one thread per replica), then gather to device 0 (exchange 3)
        outputs = self._parallel_apply(replicas, chunks)
        return Gather.apply(self.log, *outputs)

    def _parallel_apply(self, replicas, chunks) -> list:
        outputs, errors = [None] * len(chunks), []
        grad_enabled = torch.is_grad_enabled()  # grad mode is per thread: carry it over

        def run(i):
            try:
                with torch.set_grad_enabled(grad_enabled):
                    start = time.perf_counter()
                    outputs[i] = functional_call(self._shells[i], replicas[i], (chunks[i],))
                    self.log.spans.append((i, start, time.perf_counter()))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chunks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return outputs


def step_on_ranks(rank, world_size, model, opt, x, y, loss=lm_loss) -> None:
    """One DataParallel step as N processes: the five exchanges above, through rank 0 (scatter the batch,
    broadcast the weights, gather the outputs, scatter ∂loss/∂outputs, reduce the gradients), ``loss(outputs,
    targets)`` and the optimizer on rank 0 alone. ``x``, ``y``: the global batch (read on rank 0). The same
    program as :class:`DataParallel`, but each device a process: its compute and messages are traced as DDP's
    are (chapter 02's timing), which threads in one process hide."""
    mine = torch.empty_like(x.chunk(world_size)[0])
    comm.scatter(mine, list(x.chunk(world_size)) if rank == 0 else None, src=0)      # 1 scatter inputs
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    comm.broadcast(flat, src=0)                                                       # 2 replicate model
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    opt.zero_grad(set_to_none=True)
    logits = model(mine)
    out = [torch.empty_like(logits) for _ in range(world_size)] if rank == 0 else None
    comm.gather(logits.detach().contiguous(), out, dst=0)                            # 3 gather outputs
    grad = torch.empty_like(logits)
    pieces = None
    if rank == 0:                                     # the loss lives on device 0
        full = torch.cat(out).requires_grad_()
        loss(full, y).backward()
        pieces = list(full.grad.chunk(world_size))
    comm.scatter(grad, pieces, src=0)                                                 # 4 scatter ∂loss/∂y
    logits.backward(grad)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    comm.reduce(grads, dst=0)                                                         # 5 reduce grads
    if rank == 0:
        offset = 0
        for p in model.parameters():
            p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()


def validate(recipe, *, devices) -> None:
    """ValueError unless every global batch splits evenly over the devices."""
    devices = ["cpu"] * devices if isinstance(devices, int) else devices
    for step, (inputs, _) in enumerate(recipe.batches):
        if inputs.shape[0] % len(devices):
            raise ValueError(f"global batch {step} has {inputs.shape[0]} rows: not divisible by "
                             f"{len(devices)} devices")


def run(recipe, *, devices, step_logs: list | None = None):
    """Train ``recipe`` with :class:`DataParallel` over ``devices`` (a list, or a count of CPU "devices") in
    this one process (threads, no launch); returns a :class:`minipar.recipe.RunResult`. Each step's
    :class:`ExchangeLog` goes to ``step_logs``."""
    validate(recipe, devices=devices)
    devices = ["cpu"] * devices if isinstance(devices, int) else devices
    # The replica threads are the parallelism: a multi-threaded kernel in each of them would oversubscribe
    # the cores (30x slower on a 2-core machine), so kernels run single-threaded, as on every minipar rank.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(recipe, devices, step_logs)
    finally:
        torch.set_num_threads(threads)


def _train(recipe, devices, step_logs):
    model = recipe.model().to(recipe.dtype).to(devices[0])
    dp = DataParallel(model, devices)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for inputs, targets in recipe.batches:
        dp.log = ExchangeLog()
        opt.zero_grad(set_to_none=True)
        loss = recipe.loss(dp, inputs.to(devices[0]), targets.to(devices[0]))
        loss.backward()
        opt.step()  # on device 0 only: the next forward replicates the new weights
        losses.append(loss.item())
        if step_logs is not None:
            step_logs.append(dp.log)
    return RunResult(losses, {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()})
