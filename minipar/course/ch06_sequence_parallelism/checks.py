"""Checks for chapter 06's exercises: the sequence-parallel operator g (Korthikanti et al. 2022; all-gather along the sequence
forward, reduce-scatter backward) as an autograd function, the gradient sum of the replicated parameters
that run on sequence shards (LayerNorm), and the bytes one layer sends under TP and TP+SP.

The distributed checks run the learner's code on 2 and 4 ranks with :func:`minipar.course.checks.run_on_ranks`,
compare it with one device (float64, tolerance 1e-9), read the communication log (right values with the
wrong traffic are not right), refuse traffic the log did not see (:func:`minipar.course.checks.refuse_unlogged`)
and name the likely mistake when the answer matches a known wrong one. The bytes check compares the
learner's formula with one layer run on 2 and 4 ranks and its bytes read from the log.
"""
from __future__ import annotations

import functools

import torch

from minipar import comm
from minipar.course.checks import close, fail, refuse_unlogged, run_on_ranks, tp_group, unlogged_bytes
from minipar.course.tp_layer import measure_layer_on_wire
from minipar.models import GPTConfig

__all__ = ["check_gather_sequence", "check_sync_sp_grads", "check_layer_bytes"]

RANKS = (2, 4)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _max_diff(a, b) -> str:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return f"shape {tuple(a.shape) if isinstance(a, torch.Tensor) else a!r}, expected {tuple(b.shape)}"
    return f"max |Δ| = {float((a - b).abs().max()):.3g}"


# ----------------------------------------------------------------------------------------------------
# 1. g (Korthikanti et al. 2022): all-gather along the sequence forward, reduce-scatter backward
# ----------------------------------------------------------------------------------------------------

SHAPE = (4, 8, 16)      # (batch, sequence, hidden): 4 KiB in float64, well above gloo's headers


def _run_gather(rank, world_size, function):
    group = tp_group(rank, world_size)
    x_shard = _randn(*SHAPE).chunk(world_size, dim=1)[rank].clone().requires_grad_(True)
    with comm.recording() as fwd:
        y = function.apply(x_shard, group)
    grad = _randn(*SHAPE, seed=10 + rank)     # each rank's column shard sends back its own partial dX
    error = None
    with comm.recording() as bwd:
        try:            # a wrong forward may break the backward: the forward's mistake is named first
            y.backward(grad if y.shape == grad.shape else torch.ones_like(y))
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
    return (y.detach(), x_shard.grad, [(r.op, r.sent_bytes) for r in fwd.records],
            [(r.op, r.sent_bytes) for r in bwd.records], [unlogged_bytes(fwd), unlogged_bytes(bwd)],
            fwd.observed_bytes_sent, bwd.observed_bytes_sent, error)


def check_gather_sequence(function) -> None:
    """``function.apply(x_shard, group)`` -> the whole sequence (b, s, h) from every rank's (b, s/t, h), in
    rank order; backward: the gradients of the ranks summed, this rank's tokens kept (b, s/t, h)."""
    x = _randn(*SHAPE)
    payload = x.numel() * 8
    for n in RANKS:
        grads = [_randn(*SHAPE, seed=10 + r) for r in range(n)]
        results = run_on_ranks(_run_gather, n, function, what="GatherSequence", timeout=20)
        for r, (y, dx, fwd, bwd, unlogged, _, _, error) in enumerate(results):
            where = f"GatherSequence on {n} ranks, rank {r}"
            refuse_unlogged(f"{where}: forward", unlogged[0])
            refuse_unlogged(f"{where}: backward", unlogged[1])
            if not close(y, x):
                batch_dim = isinstance(y, torch.Tensor) and y.shape == (n * SHAPE[0], SHAPE[1] // n, SHAPE[2])
                fail(f"{where}: forward", f"the whole sequence, shape {tuple(x.shape)}, shards in rank order",
                     _max_diff(y, x),
                     "gathered along the batch (dim 0): all_gather_into_tensor stacks along dim 0, so move "
                     "the sequence dimension to the front first (movedim(1, 0).contiguous()) and back after"
                     if batch_dim else "all-gather every rank's shard along dim 1 (the sequence), rank 0's "
                     "tokens first")
            ops = [op for op, _ in fwd]
            if ops != ["all_gather"]:
                fail(f"{where}: forward communication", "exactly one all-gather ((t-1)/t · S per rank)", fwd,
                     "an all-reduce of a zero-padded sequence gives the same values for 2(t-1)/t · S: twice "
                     "the bytes" if "all_reduce" in ops else "one comm.all_gather_into_tensor, nothing else")
            if error:
                fail(f"{where}: backward", "the gradient of the shard", error,
                     "backward gets the gradient of the whole sequence (b, s, h) and returns (dX_shard, None)")
            want = sum(grads).chunk(n, dim=1)[r]
            if not close(dx, want):
                own = grads[r].chunk(n, dim=1)[r]
                hint = ("this is only your rank's own gradient: every rank's column shard contributed a "
                        "partial dX for every token, so sum them over the group (reduce-scatter)"
                        if close(dx, own) else
                        "summed, not averaged: the partial dX of the ranks add up (no division by t)"
                        if close(dx, want / n) else
                        "return only this rank's tokens (b, s/t, h): the input was a sequence shard"
                        if isinstance(dx, torch.Tensor) and dx.shape == x.shape else
                        "reduce-scatter along the sequence (dim 1): rank i keeps tokens [i·s/t, (i+1)·s/t)")
                fail(f"{where}: backward (dX of the shard)", "Σ_ranks grad, this rank's tokens", _max_diff(dx, want),
                     hint)
            ops = [op for op, _ in bwd]
            if ops != ["reduce_scatter"]:
                fail(f"{where}: backward communication", "exactly one reduce-scatter ((t-1)/t · S per rank)", bwd,
                     "right values, but an all-reduce sends 2(t-1)/t · S and keeps every token on every rank; "
                     "each rank needs only its own tokens: reduce-scatter" if "all_reduce" in ops else
                     "one comm.reduce_scatter_tensor, nothing else")
        if fwd[0][1] != comm.predicted_bytes_sent("all_gather", payload, n):
            fail(f"GatherSequence on {n} ranks: forward bytes", comm.predicted_bytes_sent("all_gather", payload, n),
                 fwd[0][1], "gather the (b, s/t, h) shards into one (b, s, h) tensor, nothing more")
    rank0 = results[0]
    line = (f"GatherSequence: the whole sequence forward, Σ dX on this rank's tokens backward, on 2 and 4 ranks; "
            f"one all-gather forward and one reduce-scatter backward, {rank0[2][0][1]:.0f} B each in the log on "
            f"rank 0 of 4 ((t-1)/t · {payload} B)")
    if rank0[5] is not None:
        line += (f"; written to the sockets: {rank0[5]} B forward, {rank0[6]} B backward (gloo's "
                 "reduce-scatter is an all-reduce: about twice; its headers on top)")
    print(line)


# ----------------------------------------------------------------------------------------------------
# 2. The gradients of the replicated parameters that run on sequence shards
# ----------------------------------------------------------------------------------------------------

H = 64


def _layer_norm(h=H):
    ln = torch.nn.LayerNorm(h, dtype=torch.float64)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.1 * _randn(h, seed=2))
        ln.bias.copy_(0.1 * _randn(h, seed=3))
    return ln


def _problem(n_tokens=16):
    return _randn(2, n_tokens, H, seed=4), _randn(2, n_tokens, H, seed=5)   # input, weights of the loss


def _run_sync(rank, world_size, sync_fn):
    group = tp_group(rank, world_size)
    ln, unused = _layer_norm(), torch.nn.Parameter(torch.zeros(H, dtype=torch.float64))
    x, w = (t.chunk(world_size, dim=1)[rank] for t in _problem())
    (ln(x) * w).sum().backward()                  # this rank's tokens only: a partial gradient
    params = [ln.weight, unused, ln.bias]
    with comm.recording() as log:
        sync_fn(params, group)
    return ([None if p.grad is None else p.grad.clone() for p in params],
            [(r.op, r.payload_bytes) for r in log.records], unlogged_bytes(log))


def check_sync_sp_grads(sync_fn) -> None:
    """``sync_fn(params, group)``: every ``p.grad`` that is not None summed over ``group`` in place, with
    one all-reduce for all of them; a ``None`` grad stays None."""
    ln = _layer_norm()
    x, w = _problem()
    (ln(x) * w).sum().backward()
    want = [ln.weight.grad, ln.bias.grad]
    for n in RANKS:
        for r, (grads, ops, unlogged) in enumerate(run_on_ranks(_run_sync, n, sync_fn, what="sync_sp_grads",
                                                                timeout=20)):
            where = f"sync_sp_grads on {n} ranks, rank {r}"
            refuse_unlogged(where, unlogged)
            if grads[1] is not None:
                fail(f"{where}: the parameter without a gradient", "its grad left None", "a tensor",
                     "skip parameters whose grad is None (here one the loss never used)")
            xs, ws = (t.chunk(n, dim=1)[r] for t in _problem())
            ln_r = _layer_norm()
            (ln_r(xs) * ws).sum().backward()
            partial = [ln_r.weight.grad, ln_r.bias.grad]
            for name, got, full, mine in zip(("LayerNorm weight", "LayerNorm bias"), (grads[0], grads[2]), want,
                                            partial):
                if not close(got, full):
                    fail(f"{where}: gradient of the {name}", "the one-device gradient, Σ over the ranks' tokens",
                         _max_diff(got, full),
                         "still this rank's partial gradient (its s/t tokens only): all-reduce (SUM) it over "
                         "the group, and copy the summed values back into p.grad" if close(got, mine) else
                         "summed, not averaged: each rank's gradient is a partial sum over its own tokens, "
                         "and the whole gradient is their sum" if close(got, full / n) else
                         "sum each gradient over the group (all-reduce, SUM) and put the result in p.grad")
            payload = sum(g.numel() * 8 for g in want)
            if [op for op, _ in ops] != ["all_reduce"] or ops[0][1] != payload:
                fail(f"{where}: communication", f"one all-reduce of both gradients flattened together "
                     f"({payload} B of payload)", f"{ops} (payload bytes)",
                     "one all-reduce per parameter pays the latency once per tensor (and a model has "
                     "hundreds of them): concatenate the gradients into one flat tensor, all-reduce it once, "
                     "copy the pieces back" if len(ops) > 1 else
                     "all-reduce only the gradients (flattened together), nothing else")
    print(f"sync_sp_grads: LayerNorm gradients equal one device on 2 and 4 ranks after one all-reduce of "
          f"{payload} B (2·h float64 values); the parameter without a gradient left alone")


# ----------------------------------------------------------------------------------------------------
# 3. The bytes of one layer: TP against TP+SP, from the formula and from the log
# ----------------------------------------------------------------------------------------------------

LAYER = dict(b=2, s=8, h=16, a=4)             # float32; not the chapter's numbers
CASES = ((False, True), (True, True), (True, False))   # (sequence_parallel, regather)


def _measure_layer(rank, world_size):
    cfg = GPTConfig(n_embd=LAYER["h"], n_head=LAYER["a"])
    return {(sp, regather): measure_layer_on_wire(rank, world_size, cfg, sp, not regather, LAYER["b"], LAYER["s"])
            for sp, regather in CASES}


@functools.lru_cache(maxsize=1)
def measured_layer_bytes() -> dict:
    """{(t, sequence_parallel, regather): (bytes in the log, bytes written to the sockets)} on rank 0, for
    one layer's forward and backward, t = 2 and 4 (one launch per degree, cached)."""
    out = {}
    for t in RANKS:
        rank0 = run_on_ranks(_measure_layer, t, what="one layer", timeout=30)[0]
        for (sp, regather), (logged, observed, _, _) in rank0.items():
            out[t, sp, regather] = (logged, observed)
    return out


def check_layer_bytes(layer_bytes) -> None:
    """``layer_bytes(b, s, h, t, sequence_parallel, regather)`` -> bytes one rank sends for one transformer
    layer's forward and backward in float32: TP, TP+SP re-gathering the column-parallel inputs in backward,
    and TP+SP keeping them (``regather=False``), against one layer run on 2 and 4 ranks."""
    b, s, h = LAYER["b"], LAYER["s"], LAYER["h"]
    layer_bytes(b, s, h, 2, False, True)        # the stub fails here, before anything is launched
    measured = measured_layer_bytes()
    sbh = b * s * h * 4
    for (t, sp, regather), (logged, _) in measured.items():
        got = layer_bytes(b, s, h, t, sp, regather)
        where = (f"layer_bytes(b={b}, s={s}, h={h}, t={t}, sequence_parallel={sp}, regather={regather})"
                 if sp else f"layer_bytes(b={b}, s={s}, h={h}, t={t}, sequence_parallel=False)")
        if not isinstance(got, (int, float)) or abs(got - logged) > 1e-6 * logged:
            ag = (t - 1) / t * sbh
            hint = ("four all-reduces per layer (g after attention and after the MLP forward, f before each "
                    "backward), each 2(t-1)/t · b·s·h·4 bytes on a ring" if not sp else
                    "the two re-gathers are missing: the QKV and fc layers keep only their input's shard and "
                    "all-gather it again in backward, 2 × (t-1)/t · b·s·h·4 bytes" if abs(got - (logged - 2 * ag)) < 1e-6 else
                    "with the gathered inputs kept there is no re-gather: the same bytes as TP"
                    if abs(got - (logged + 2 * ag)) < 1e-6 else
                    "an all-gather or a reduce-scatter of the whole b·s·h tensor sends (t-1)/t of it, half an "
                    "all-reduce: 4 all-gathers + 4 reduce-scatters (+ 2 re-gathers) per layer")
            fail(where, f"{logged:.0f} B (measured: the log of one layer on {t} ranks)", got, hint)
    tp4, sp4, kept4 = (measured[4, sp, regather] for sp, regather in CASES)
    line = (f"layer_bytes: equals the log of one layer (b={b}, s={s}, h={h}, float32) on 2 and 4 ranks; at t=4: "
            f"TP {tp4[0]:.0f} B, TP+SP {sp4[0]:.0f} B, TP+SP inputs kept {kept4[0]:.0f} B")
    if tp4[1] is not None:
        line += (f"; written to the sockets on rank 0: {tp4[1]}, {sp4[1]}, {kept4[1]} B (gloo's headers, and "
                 "its reduce-scatter is an all-reduce)")
    print(line)
