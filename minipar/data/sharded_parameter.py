"""The guard on a ZeRO-3/FSDP parameter whose storage is freed between uses.

Between its unit's uses a stage-3 parameter is a view of a flat buffer whose storage has been resized to
zero (:meth:`minipar.data.flat_unit.FlatUnit.free`). Reading it would read released memory — a SIGSEGV that
kills the rank — so :class:`ShardedParameter` checks, on every torch operation, that its unit is gathered,
and otherwise raises :class:`FreedParameterError` saying what to do. Metadata (shape, dtype, ``.grad``,
hooks) stays readable. Inside the unit's own forward and backward it is an ordinary parameter.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

__all__ = ["FreedParameterError", "FrozenAfterWrappingError", "FreedGradientWarning", "ShardedParameter"]


class FreedParameterError(RuntimeError):
    """A ZeRO-3/FSDP parameter was read while its unit's full storage is freed (between uses)."""


class FrozenAfterWrappingError(RuntimeError):
    """``requires_grad`` of a ZeRO-3/FSDP parameter was changed after wrapping: its unit cannot follow."""


class FreedGradientWarning(UserWarning):
    """``.grad`` of a ZeRO-3/FSDP parameter was read after its gradient was reduce-scattered into a shard."""


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter: a view into its unit's (``flat_unit``) flat buffer, freed between uses; reading
    it then raises :class:`FreedParameterError` instead of crashing (see the module docstring)."""

    _METADATA = frozenset({
        torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
        torch.Tensor.requires_grad.__get__, torch.Tensor.requires_grad.__set__, torch.Tensor.grad.__get__,
        torch.Tensor.grad.__set__, torch.Tensor.data.__set__, torch.Tensor.is_leaf.__get__,
        torch.Tensor.grad_fn.__get__, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.dim,
        torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.__hash__,
        torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.storage_offset, torch.Tensor.stride,
        torch.Tensor.element_size, torch.Tensor.is_contiguous, torch.Tensor.is_floating_point,
        torch.Tensor.layout.__get__, torch.Tensor.nbytes.__get__, torch.Tensor.itemsize.__get__})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__):
            _refuse_a_freeze(args[0], args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
        if func not in cls._METADATA:
            for arg in tree_leaves((args, kwargs)):
                if isinstance(arg, ShardedParameter) and not arg.flat_unit.gathered:
                    raise FreedParameterError(
                        f"{arg.sharded_name!r} is sharded over {arg.flat_unit.n} ranks and its full storage is "
                        f"freed between uses (ZeRO-3/FSDP); reading it would read released memory. Gather "
                        f"first, on every rank: `with zero.gathered(): ...`, or take full copies with "
                        f"`zero.full_parameters()` (FSDP: `with model.gathered(): ...`, `model.full_state_dict()`).")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func == torch.Tensor.grad.__get__ and result is None and _reduced_away(args[0]):
            unit = args[0].flat_unit
            warnings.warn(
                f"the gradient of {args[0].sharded_name!r} was reduce-scattered, so its .grad is None: this rank "
                f"keeps its 1/{unit.n} of the unit's flat gradient as the .grad of the flat shard the optimizer "
                f"steps (`fsdp_model.parameters()`, or `zero.units[i].master`); full gradients, on every rank: "
                f"`fsdp_model.full_gradients()`.", FreedGradientWarning, stacklevel=2)
        return result


def _refuse_a_freeze(param, requires_grad) -> None:
    if bool(requires_grad) != param.requires_grad:
        raise FrozenAfterWrappingError(
            f"{param.sharded_name!r}: requires_grad set to {bool(requires_grad)} after wrapping (ZeRO-3/FSDP over "
            f"{param.flat_unit.n} ranks); its elements stay in unit {param.flat_unit.label}'s flat shard, which the "
            f"optimizer (use_orig_params: its piece) would go on stepping. Set requires_grad before wrapping: frozen "
            f"parameters are left out of the units, whole on every rank, as on one device.")


def _reduced_away(param) -> bool:
    return not param.flat_unit.gathered and param.flat_unit.master.grad is not None
