"""The first operator that produced a non-finite value (inf or NaN), in the forward or the backward.

A NaN loss is the end of a chain: one operator overflowed (float16's largest number is 65504, so
``exp(12)`` is already ``inf``), the next turned ``inf`` into ``NaN`` (``inf − inf``, ``inf / inf``,
``0 · inf``), and a gradient all-reduce copied it to every rank. Reading the loss says *that*; this module
says *where*: :func:`first_nonfinite` runs the block under a ``TorchDispatchMode`` — every ATen operator,
forward and backward, passes through it — and records the first operator whose output holds a non-finite
value while none of its inputs did: that is where the value was born, not where it was copied to.
:func:`module_hooks` adds the module whose forward was running (forward pre-hooks keep a stack of names).

Sources: ``torch.autograd.detect_anomaly`` (names the backward function that returned NaN, forward trace
attached; slow, backward only); ``torch.utils._python_dispatch.TorchDispatchMode`` (the mechanism, as in
PyTorch's ``FlopCounterMode`` and the "debug mode" helpers built on it); Micikevicius et al. 2018, "Mixed
Precision Training", on float16's range and why loss scaling exists.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["NonFinite", "NonfiniteWatch", "first_nonfinite", "module_hooks"]


def _bad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0 and not bool(x.isfinite().all())


def _describe(tensors) -> str:
    parts = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            finite = t[t.isfinite()]
            top = f"max |x| {float(finite.abs().max()):.4g}" if finite.numel() else "no finite value"
            parts.append(f"{str(t.dtype)[6:]}{list(t.shape)} ({top})")
    return ", ".join(parts)


@dataclass
class NonFinite:
    """Where the first non-finite value was born: the operator, its inputs and output, the module (if
    :func:`module_hooks` ran), the index of the operator among those seen, and the rank (set by the caller)."""
    op: str
    inputs: str
    output: str
    index: int
    module: str = ""
    rank: int | None = None
    largest_input: float = 0.0                    # the largest |x| among its inputs' finite values

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        who = f"rank {self.rank}: " if self.rank is not None else ""
        return (f"{who}operator #{self.index} {self.op}{where} produced {self.output}; "
                f"its inputs were finite: {self.inputs}")


class NonfiniteWatch(TorchDispatchMode):
    """Every operator's outputs, as PyTorch dispatches them: the first whose inputs were all finite and whose
    output is not is kept in ``found`` (:class:`NonFinite`); ``count`` operators seen; ``modules``: the stack of
    module names the forward hooks keep (:func:`module_hooks`). What :func:`first_nonfinite` runs its block under."""

    def __init__(self, modules: list):
        super().__init__()
        self.found, self.count, self.modules = None, 0, modules

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False    # never compiled; torch's dynamo-disabling wrapper slows every Python frame inside (memory.py)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += 1
        if self.found is None:
            outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
            if any(_bad(x) for x in outs):
                ins = [x for x in tree_flatten((args, kwargs or {}))[0] if isinstance(x, torch.Tensor)]
                if not any(_bad(x) for x in ins):
                    bad = [x for x in outs if _bad(x)][0]
                    kind = "NaN" if bool(bad.isnan().any()) else "inf"
                    floats = [x for x in ins if x.is_floating_point() and x.numel()]
                    self.found = NonFinite(str(func.overloadpacket.__name__), _describe(ins),
                                           f"{kind} in {str(bad.dtype)[6:]}{list(bad.shape)}", self.count,
                                           self.modules[-1] if self.modules else "",
                                           largest_input=max((float(x.abs().max()) for x in floats), default=0.0))
        return out


@contextlib.contextmanager
def module_hooks(model: torch.nn.Module, stack: list):
    """While open, ``stack[-1]`` names the module whose forward is running (``stack`` is the caller's list)."""
    def enter(label):
        def hook(module, args):
            stack.append(label)               # a hook returns None: it must not replace the input
        return hook

    def leave(module, args, output):
        stack.pop()                           # nor the output

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name or type(module).__name__)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


class _Result:
    found: NonFinite | None = None


@contextlib.contextmanager
def first_nonfinite(model: torch.nn.Module | None = None):
    """Run the block watching every operator; yields a holder whose ``found`` is the first
    :class:`NonFinite` (or None) when the block ends. With ``model``, the module running is named too
    (in the backward, the module is not known: its field stays empty)."""
    result, stack = _Result(), []
    watch = NonfiniteWatch(stack)
    with module_hooks(model, stack) if model is not None else contextlib.nullcontext():
        with watch:
            try:
                yield result
            finally:
                result.found = watch.found
