"""What both FSDP designs (:mod:`minipar.data.fsdp`'s flat units, :mod:`minipar.data.fsdp2`'s per-parameter
shards) do the same way: a norm computed in its own dtype under a 16-bit policy, the full state dict under the
wrapped module's names and its loading, and finishing the gradients when the backward ends."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["compute_in_own_dtype", "module_state_dict", "load_module_state_dict", "finish_at_backward_end"]


def compute_in_own_dtype(module: nn.Module, param_dtype) -> None:
    """A layer kept in its parameters' dtype under a 16-bit policy (a norm): its inputs cast up to that dtype,
    its output back to ``param_dtype``."""
    own = next(module.parameters()).dtype
    module.register_forward_pre_hook(lambda m, args: tuple(
        a.to(own) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    module.register_forward_hook(lambda m, args, out: out.to(param_dtype))


def module_state_dict(module: nn.Module, full_by_param: dict, prefix: str = "") -> dict:
    """``module.state_dict()``'s keys in its order, each value whole (PyTorch FSDP's full state dict): a sharded
    parameter's full tensor ``full_by_param[id(p)]``, a buffer or a frozen parameter copied as it is. Used by
    both FSDP designs; ``keep_vars`` so that nothing reads a freed parameter."""
    return {prefix + name: full_by_param[id(v)] if id(v) in full_by_param else v.detach().clone()
            for name, v in module.state_dict(keep_vars=True).items()}


def load_module_state_dict(module: nn.Module, state_dict: dict, sharded: set, strict: bool = True):
    """Check ``state_dict``'s keys against ``module.state_dict()``'s (``strict``: RuntimeError unless equal) and
    copy the values of what is not sharded (buffers, frozen parameters; ``sharded``: ids of the others, which
    the caller loads into its shards). Returns torch's (missing_keys, unexpected_keys)."""
    own = module.state_dict(keep_vars=True)
    missing, unexpected = [k for k in own if k not in state_dict], [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(f"the state dict does not fit the wrapped module: missing keys {missing[:3]}, "
                           f"unexpected keys {unexpected[:3]} (a full state dict has the module's own names)")
    with torch.no_grad():
        for name, value in own.items():
            if name in state_dict and id(value) not in sharded:
                value.copy_(state_dict[name])
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def finish_at_backward_end(wrapper, out):
    """``out``, hooked so that ``wrapper.finish_gradient_synchronization()`` runs once when the backward
    through it ends (autograd's ``queue_callback``: after every gradient of that pass) — so a plain training
    loop never calls it. Used by both FSDP designs."""
    wrapper._finish_queued = False

    def queue(grad):
        if not wrapper._finish_queued:
            wrapper._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(wrapper.finish_gradient_synchronization)
    for t in [out] if torch.is_tensor(out) else [t for t in out if torch.is_tensor(t)]:
        if t.requires_grad:
            t.register_hook(queue)
    return out
