"""Where the memory goes, measured from the tensors that really exist.

* :func:`measured_model_state_bytes` — bytes of parameters, gradients and optimizer state held by this rank,
  counted once per storage (a tied weight or a view is not counted twice).
* :class:`LiveTensorTracker` — a ``TorchDispatchMode`` that sees every tensor an operator creates and a
  weak-reference finalizer on its storage, so it knows the bytes alive at every moment and their peak.
  It works the same on CPU and GPU (on CUDA, ``torch.cuda.max_memory_allocated`` is the cross-check).
* :func:`saved_activation_bytes` — bytes that autograd keeps for the backward pass (the activations),
  via ``torch.autograd.graph.saved_tensors_hooks``; parameters saved by reference are not counted.
* :func:`measure_step` — a :class:`MemoryAccount` for one training step: model state before the step, and
  the peak during it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["measured_model_state_bytes", "tensors_in", "LiveTensorTracker", "saved_activation_bytes", "measure_step", "MemoryAccount",
           "tensor_bytes"]


def _storage_key(t: torch.Tensor):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared weights counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            ptr, n = _storage_key(t)
            seen[ptr] = n
    return sum(seen.values())


def measured_model_state_bytes(params, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """{"params", "grads", "optimizer"} bytes held by this rank (each storage counted once)."""
    params = list(params)
    opt_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": tensor_bytes(params),
            "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": tensor_bytes(opt_tensors)}


_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def tensors_in(tree) -> list:
    """The tensors among ``tree``'s leaves, as ``tree_flatten`` finds them: plain tuples and lists of tensors and
    scalars are read directly (tree_flatten, in Python, cost more than the operator it was asked about: most of
    a tracked step's overhead), anything else (a dict, a named tuple, another pytree node) goes through it."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if type(tree) in (tuple, list):
        out = []
        for x in tree:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif type(x) in (tuple, list):
                out.extend(tensors_in(x))
            elif not isinstance(x, _LEAVES):
                break
        else:
            return out
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class LiveTensorTracker(TorchDispatchMode):
    """Track the bytes of tensors created inside the ``with`` block: ``current``, ``peak`` and a
    ``timeline`` of (event index, live bytes, operator) for plotting."""

    def __init__(self, keep_timeline: bool = False):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.timeline: list = []
        self._keep_timeline = keep_timeline
        self._live: dict = {}

    def _freed(self, ptr: int, nbytes: int) -> None:
        if self._live.pop(ptr, None) is not None:
            self.current -= nbytes
            if self._keep_timeline:
                self.timeline.append((len(self.timeline), self.current, "free"))

    def adopt(self, tensors) -> None:
        """Count tensors that exist already as live (each storage once), and see them freed: a step that
        drops a gradient made before it (``zero_grad(set_to_none=True)``) then lowers ``current``."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.numel():
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n and ptr not in self._live:
                self._live[ptr] = weakref.finalize(st, self._freed, ptr, n)
                self.current += n
                self.peak = max(self.peak, self.current)

    def settle(self, at_most: int, timeout: float = 2.0) -> int:
        """Wait (up to ``timeout`` s) until at most ``at_most`` bytes are alive, and return what is.

        A collective can return while gloo's worker thread still holds its buffers for a moment; they are
        freed from that thread shortly after, so "what is left behind" is read once things settle."""
        import time
        deadline = time.monotonic() + timeout
        while self.current > at_most and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.current

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this says no; then every
        # Python frame run inside it passes dynamo's frame hook, and tracking a step cost 2.2 times as much.
        # This mode is never compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tensors_in(out):
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n == 0 or ptr in self._live:
                continue
            if inputs is None:      # an output sharing an input's storage (in place, view, out=) is not new
                inputs = {a.untyped_storage().data_ptr()
                          for a in tensors_in(args) + (tensors_in(list(kwargs.values())) if kwargs else [])}
            if ptr in inputs:
                continue
            self._live[ptr] = weakref.finalize(st, self._freed, ptr, n)
            self.current += n
            self.peak = max(self.peak, self.current)
            if self._keep_timeline:
                self.timeline.append((len(self.timeline), self.current, str(func.__name__)))
        return out


def saved_activation_bytes(fn, *args, exclude=(), **kwargs):
    """Run ``fn(*args, **kwargs)`` and return (its result, bytes autograd saved for backward).

    Tensors in ``exclude`` (e.g. the parameters, which autograd saves by reference, not by copy) and
    storages already counted are left out. ``exclude`` may also be a callable returning those tensors
    (``model.parameters``): it is asked at each save, for parameters that change storage during the forward
    (ZeRO-3 and FSDP gather them there).
    """
    fixed = None if callable(exclude) else {_storage_key(t)[0] for t in exclude}
    saved: dict = {}

    def pack(t):
        ptr, n = _storage_key(t)
        excluded = fixed if fixed is not None else {_storage_key(p)[0] for p in exclude()}
        if n and ptr not in excluded:
            saved[ptr] = n
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args, **kwargs)
    return result, sum(saved.values())


@dataclass
class MemoryAccount:
    """Bytes on one rank. ``peak`` = model state at the start of the step + the peak of what the step
    allocated on top of it (activations, gradients, optimizer state, communication buffers)."""
    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    extra: dict = field(default_factory=dict)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "peak": self.peak, **self.extra}


def measure_step(step_fn, params, optimizer=None) -> MemoryAccount:
    """Run ``step_fn()`` (forward, backward, optimizer step) under a :class:`LiveTensorTracker`.

    Model-state bytes are read after the step (so lazily created gradients and optimizer state count);
    activations are the bytes autograd saved during the step. The peak starts from the state that existed
    before (adopted by the tracker, so a gradient the step frees and re-creates is counted once, not twice).
    """
    params = list(params)
    tracker = LiveTensorTracker()
    tracker.adopt(_state_tensors(params, optimizer))
    with tracker:
        _, activations = saved_activation_bytes(step_fn, exclude=params)
    after = measured_model_state_bytes(params, optimizer)
    return MemoryAccount(after["params"], after["grads"], after["optimizer"], activations, tracker.peak)


def _state_tensors(params: list, optimizer=None) -> list:
    """Parameters, their gradients and the optimizer's state tensors (what measured_model_state_bytes counts)."""
    out = params + [p.grad for p in params if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out
