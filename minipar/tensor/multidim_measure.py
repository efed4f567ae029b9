"""What the 1D / 2D / 2.5D / 3D tensor-parallel MLP costs per rank, measured beside the strategy
(:mod:`minipar.tensor.multidim_mlp`) and fed by the communication log, with the closed forms beside it.

* :func:`measure` (on every rank: :func:`measure_all`) runs one forward + backward (+ gradient sums) of a
  bias-free MLP and returns parameter and saved-activation bytes, bytes sent (the log's model,
  ``log.bytes_sent``, and what the sockets saw, ``log.observed_bytes_sent``), messages sent
  (:meth:`minipar.comm_log.CommLog.messages`, from the log's records) and the calls per operation;
* :func:`formula_bytes` is the closed form of the same step's bytes, :func:`counts` its bytes, messages and
  collectives to wait in; :func:`link_time` turns counts into seconds on an α-β link (a model, labelled).
"""
from __future__ import annotations

import torch

from .. import comm
from ..launcher import launch
from ..memory import saved_activation_bytes, tensor_bytes
from ..models import MLP
from . import tp2d, tp2p5d, tp3d
from .multidim_mlp import MultiDimMLP, build_group, make_grid

__all__ = ["measure", "measure_all", "formula_bytes", "counts", "link_time"]


def measure(rank, world_size, layout: str, sizes=(32, 128, 32), tokens: int = 32, depth: int = 2,
            dtype=torch.float32) -> dict:
    """One forward + backward (+ gradient sums) of the bias-free MLP ``sizes`` on ``tokens`` rows."""
    g = build_group(rank, world_size, layout, depth)
    model = MultiDimMLP(MLP(sizes, seed=0, bias=False).to(dtype), layout, g)
    x = torch.randn(tokens, sizes[0], generator=torch.Generator().manual_seed(1), dtype=dtype)

    def step(log=None):
        xp = model.input_part(x).clone().requires_grad_(True)
        y, act = saved_activation_bytes(model, xp, exclude=list(model.parameters()))
        y.pow(2).sum().backward()
        model.sync_grads()
        return act

    step()                                           # warm-up: gloo connects each pair on first use
    model.zero_grad(set_to_none=True)
    with comm.recording() as log:
        act = step()
    return {"params": tensor_bytes(model.parameters()), "activations": act, "bytes_model": log.bytes_sent,
            "bytes_observed": log.observed_bytes_sent, "messages": log.messages(), "calls": log.count(),
            "by_op": log.by_op()}


def measure_all(world_size: int, layout: str, **kwargs) -> list:
    """:func:`measure` on every rank (a launch)."""
    return launch(measure, world_size, layout, quiet=True, **kwargs)


def formula_bytes(layout: str, world_size: int, sizes=(32, 128, 32), tokens: int = 32, depth: int = 2,
                  value_bytes: int = 4) -> float:
    """Closed-form bytes one rank sends for :func:`measure`'s step (mean over ranks)."""
    pairs = list(zip(sizes[:-1], sizes[1:]))
    if layout == "1d":
        p = world_size
        # g after every row-parallel layer, f before every column-parallel one (dX of the input included)
        ar = lambda features: 2 * (p - 1) / p * tokens * features * value_bytes  # noqa: E731
        total = sum(ar(pairs[i][1]) for i in range(len(pairs)) if i % 2 == 1)
        total += sum(ar(pairs[i][0]) for i in range(len(pairs)) if i % 2 == 0)
        if len(pairs) % 2:   # last layer column-parallel with gather_output: one all-gather of Y
            total += (p - 1) / p * tokens * pairs[-1][1] * value_bytes
        return total
    mesh = make_grid(layout, world_size, depth)
    q = mesh.size(mesh.dims[-1])
    if layout == "2d":
        per = [tp2d.bytes_per_linear(tokens, a, b, q, value_bytes) for a, b in pairs]
    elif layout == "2.5d":
        per = [tp2p5d.bytes_per_linear(tokens, a, b, q, depth, value_bytes) for a, b in pairs]
    else:
        per = [tp3d.bytes_per_linear(tokens, a, b, q, value_bytes) for a, b in pairs]
    return sum(p["forward"] + p["backward"] for p in per)


def counts(layout: str, world_size: int, sizes=(32, 128, 32), tokens: int = 32, depth: int = 2,
           value_bytes: int = 4) -> dict:
    """Per rank for one forward + backward of the bias-free MLP: ``bytes`` (:func:`formula_bytes`),
    ``messages`` sent (ring steps, direct sends; as ``CommLog.messages`` counts them) and ``syncs`` —
    collective operations the rank must wait in (1D: one all-reduce per layer; 2D: 6q broadcasts or
    reduces per layer, SUMMA's q steps × 3 products × 2 operands; 2.5D: the same + one depth all-reduce;
    3D: 6 collectives per layer)."""
    layers = len(sizes) - 1
    out = {"bytes": formula_bytes(layout, world_size, sizes, tokens, depth, value_bytes)}
    if layout == "1d":
        p = world_size
        gather = layers % 2
        out.update(messages=layers * 2 * (p - 1) + gather * (p - 1), syncs=layers + gather)
        return out
    mesh = make_grid(layout, world_size, depth)
    q = mesh.size(mesh.dims[-1])
    if layout == "2d":
        out.update(messages=layers * 6 * (q - 1), syncs=layers * 6 * q)
    elif layout == "2.5d":
        out.update(messages=layers * (6 * (q - 1) + 2 * (depth - 1)), syncs=layers * (6 * q + (depth > 1)))
    else:
        out.update(messages=layers * 6 * (q - 1), syncs=layers * 6)
    return out


def link_time(c: dict, alpha_sync: float = 20e-6, alpha_msg: float = 5e-6, beta: float = 25e9) -> float:
    """Seconds of communication for :func:`counts` ``c`` on an α-β link (a model, not a measurement):
    ``syncs · α_sync + messages · α_msg + bytes / β`` — α_sync: the fixed cost of starting and finishing a
    collective, α_msg: the latency of one message on the link, β: the link's bandwidth in bytes/s."""
    return c["syncs"] * alpha_sync + c["messages"] * alpha_msg + c["bytes"] / beta
