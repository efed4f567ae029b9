"""Checks for chapter 05's exercises: a column-parallel linear layer's forward and backward by hand, the
vocabulary-parallel cross-entropy's three reductions, and placing f and g in the tensor-parallel MLP.

Each check runs the learner's code on 2 and 4 ranks with :func:`minipar.checks.run_on_ranks`, compares it
with one device (float64, tolerance 1e-9), reads the communication log (right values with the wrong
traffic are not right), refuses traffic the log did not see (a collective called straight through
``torch.distributed`` shows on the wire, :mod:`minipar.wire`, not in the log), and names the likely mistake
when the answer matches a known wrong one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minipar import comm
from minipar.course.checks import close, fail, run_on_ranks, tp_group
from minipar.course.checks import refuse_unlogged, unlogged_bytes

__all__ = ["check_column_parallel_linear", "check_vocab_parallel_loss", "check_tp_mlp"]

RANKS = (2, 4)


def _data(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _max_diff(a, b) -> str:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return f"shape {tuple(a.shape) if isinstance(a, torch.Tensor) else a!r}, expected {tuple(b.shape)}"
    return f"max |Δ| = {float((a - b).abs().max()):.3g}"


# ----------------------------------------------------------------------------------------------------
# 1. Column-parallel linear, forward and backward
# ----------------------------------------------------------------------------------------------------

def _run_column(rank, world_size, function):
    group = tp_group(rank, world_size)
    x, w, b = _data((3, 5, 8), (12, 8), (12,))
    w_i, b_i = w.chunk(world_size)[rank].clone(), b.chunk(world_size)[rank].clone()
    x_mine, w_i, b_i = x.clone().requires_grad_(True), w_i.requires_grad_(True), b_i.requires_grad_(True)
    with comm.recording() as fwd:
        y_i = function.apply(x_mine, w_i, b_i, group)
    with comm.recording() as bwd:
        y_i.backward(torch.ones_like(y_i) * (1 + torch.arange(y_i.shape[-1], dtype=y_i.dtype)))
    return (y_i.detach(), x_mine.grad, w_i.grad, b_i.grad, fwd.by_op(), bwd.by_op(),
            [unlogged_bytes(fwd), unlogged_bytes(bwd)], bwd.observed_bytes_sent)


def check_column_parallel_linear(function) -> None:
    """``function.apply(x, w_i, b_i, group)`` -> ``x @ w_iᵀ + b_i`` (this rank's output features); its
    backward returns the whole dX (all-reduced over ``group``), dW_i and db_i."""
    for n in RANKS:
        x, w, b = _data((3, 5, 8), (12, 8), (12,))
        xf, wf, bf = (t.clone().requires_grad_(True) for t in (x, w, b))
        y = F.linear(xf, wf, bf)
        full_grad = torch.ones_like(y) * (1 + torch.arange(12, dtype=y.dtype)).chunk(n)[0].repeat(n)
        y.backward(full_grad)
        results = run_on_ranks(_run_column, n, function, what="ColumnParallelLinear", timeout=20)
        for r, (y_i, dx, dw_i, db_i, fwd, bwd, unlogged, _) in enumerate(results):
            where = f"column-parallel linear on {n} ranks, rank {r}"
            refuse_unlogged(f"{where}: forward", unlogged[0])
            refuse_unlogged(f"{where}: backward", unlogged[1])
            if not close(y_i, y.detach().chunk(n, -1)[r]):
                mistake = ("the output must be this rank's slice x @ w_iᵀ + b_i: no collective in forward"
                           if fwd else "y_i = x @ w_i.T + b_i (PyTorch stores w as (out, in))")
                fail(f"{where}: forward", "x @ w_i.T + b_i", _max_diff(y_i, y.detach().chunk(n, -1)[r]), mistake)
            if fwd:
                fail(f"{where}: forward communication", "none (f is the identity forward)", fwd,
                     "every rank already has the whole x: the forward needs no collective")
            if not close(db_i, bf.grad.chunk(n)[r]):
                fail(f"{where}: db_i", "grad_y summed over every dimension but the last", _max_diff(db_i, bf.grad.chunk(n)[r]),
                     "the bias is broadcast over batch and sequence: sum grad_y over all leading dimensions")
            if not close(dw_i, wf.grad.chunk(n)[r]):
                fail(f"{where}: dW_i", "grad_yᵀ @ x (over all tokens)", _max_diff(dw_i, wf.grad.chunk(n)[r]),
                     "dW_i = grad_y.reshape(-1, out_i).T @ x.reshape(-1, in); no communication needed")
            if not close(dx, xf.grad):
                partial = grad_partial = None
                if isinstance(dx, torch.Tensor) and dx.shape == xf.grad.shape:
                    grad_partial = full_grad.chunk(n, -1)[r] @ w.chunk(n)[r]
                    partial = close(dx, grad_partial)
                fail(f"{where}: dX", "the whole dX = Σ_i grad_y_i @ w_i", _max_diff(dx, xf.grad),
                     "this is only your rank's part grad_y_i @ w_i: all-reduce it over the group (f's backward)"
                     if partial else "dX_i = grad_y_i @ w_i, then comm.all_reduce(dX_i, group=group)")
            if bwd.get("all_reduce", (0, 0))[0] != 1 or set(bwd) != {"all_reduce"}:
                fail(f"{where}: backward communication", "exactly one all-reduce (of dX)", bwd,
                     "only dX needs communication; dW_i and db_i are this rank's own")
    observed = results[0][7]
    print("column-parallel linear: y_i, dX, dW_i, db_i equal one device on 2 and 4 ranks; "
          f"no collective forward, one all-reduce of dX backward (measured on rank 0 of 4: "
          f"{results[0][5]['all_reduce'][1]} B in the log, {'-' if observed is None else observed} B written "
          f"to the sockets, gloo's headers included)")


# ----------------------------------------------------------------------------------------------------
# 2. Vocabulary-parallel cross-entropy: three reductions
# ----------------------------------------------------------------------------------------------------

def _loss_problem(vocab=12, offset=0.0, b=16, s=32):
    """b·s = 512 tokens: 4 KiB per reduction, so that a reduction hidden from the log (torch.distributed
    called directly) stands well above gloo's headers on the wire."""
    logits, = _data((b, s, vocab), seed=1)
    targets = torch.randint(vocab, (b, s), generator=torch.Generator().manual_seed(2))
    return logits * 4 + offset, targets


def _run_loss(rank, world_size, loss_fn, offset):
    group = tp_group(rank, world_size)
    logits, targets = _loss_problem(offset=offset)
    shard = logits.chunk(world_size, -1)[rank].clone()
    start = rank * shard.shape[-1]
    with comm.recording() as log:
        loss = loss_fn(shard, targets, start, group)
    dist.barrier()
    return loss, [(r.op, r.payload_bytes) for r in log.records], unlogged_bytes(log), log.observed_bytes_sent


def check_vocab_parallel_loss(loss_fn) -> None:
    """``loss_fn(logits_shard, targets, vocab_start, group)`` -> per-token cross-entropy (shape of
    ``targets``) from this rank's vocabulary columns, with three reductions of b·s numbers: a MAX, then two
    SUMs (which may be fused into one all-reduce of 2·b·s numbers: the same bytes, one call fewer)."""
    for n in RANKS:
        for offset in (0.0, 1000.0):        # large logits: exp overflows without subtracting the max
            logits, targets = _loss_problem(offset=offset)
            want = F.cross_entropy(logits.reshape(-1, 12), targets.reshape(-1), reduction="none").view(targets.shape)
            results = run_on_ranks(_run_loss, n, loss_fn, offset, what="vocab_parallel_loss", timeout=20)
            for r, (got, ops, unlogged, _) in enumerate(results):
                where = f"vocab-parallel loss on {n} ranks, rank {r}, logits around {offset:g}"
                refuse_unlogged(where, unlogged)
                token_bytes = targets.numel() * 8
                big = [op for op, size in ops if size > 2 * token_bytes]
                if big:
                    fail(f"{where}: communication", "reductions of per-token numbers (b·s each, or 2·b·s fused)",
                         f"{ops} (payload bytes)", "never gather or reduce the b·s × V logits: reduce "
                         "only per-token numbers (max, target logit, sum of exp)")
                if not close(got, want):
                    _diagnose_loss(where, got, want, ops, logits, targets, n, offset)
                total = sum(size for _, size in ops)
                if {op for op, _ in ops} != {"all_reduce"} or len(ops) not in (2, 3) or total != 3 * token_bytes:
                    fail(f"{where}: communication", f"3 reductions of b·s numbers ({3 * token_bytes} B of "
                         "payload) in 3 all-reduces, or 2 with the two SUMs fused", ops,
                         "one MAX all-reduce of the per-token max, then SUM the target logit and the sum of exp "
                         "(two all-reduces, or one of both stacked); skip nothing, reduce nothing more")
    ops, observed = results[0][1], results[0][3]
    print(f"vocab-parallel cross-entropy: equals F.cross_entropy on 2 and 4 ranks (also with logits ~1000); "
          f"measured on rank 0 of 4: {len(ops)} all-reduces of {[size for _, size in ops]} B (b·s = "
          f"{targets.numel()} numbers), {'-' if observed is None else observed} B written to the sockets "
          f"(gloo's headers included)")


def _diagnose_loss(where, got, want, ops, logits, targets, n, offset):
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        fail(where, f"per-token losses of shape {tuple(want.shape)}", got if not isinstance(got, torch.Tensor)
             else f"shape {tuple(got.shape)}", "return one loss per token (no mean)")
    if not torch.isfinite(got).all():
        fail(where, "finite losses", "inf or nan", "subtract the global max (all-reduce with "
             "ReduceOp.MAX) before exp: exp(1000) overflows")
    if close(got, want * n) or close(got, want / n):
        fail(where, "the loss", _max_diff(got, want), "scaled by the number of ranks: SUM, not AVG, and no "
             "division by world_size")
    if sum(size for _, size in ops) < 3 * targets.numel() * 8:
        fail(where, "log Σ_j exp(z_j - m) - (z_target - m)", _max_diff(got, want),
             "m must be the global max (all-reduce with ReduceOp.MAX), the same on every rank: with each "
             "rank's own max the ranks' exp(z - m) are on different scales and cannot be added")
    fail(where, "log Σ_j exp(z_j - m) - (z_target - m)", _max_diff(got, want),
         "the target logit is on one rank only: the others must contribute 0 (mask ids outside "
         "[vocab_start, vocab_start + V/t)) before the SUM all-reduce")


# ----------------------------------------------------------------------------------------------------
# 3. Placing f and g in the MLP
# ----------------------------------------------------------------------------------------------------

def _run_mlp(rank, world_size, mlp_forward):
    from minipar.tensor.operators import copy_to_tp, reduce_from_tp
    group = tp_group(rank, world_size)
    x, a, a_b, b, b_b = _data((2, 5, 8), (32, 8), (32,), (8, 32), (8,), seed=3)
    a_i, ab_i, b_i = a.chunk(world_size)[rank], a_b.chunk(world_size)[rank], b.chunk(world_size, 1)[rank]
    params = [t.clone().requires_grad_(True) for t in (a_i, ab_i, b_i, b_b)]
    x = x.clone().requires_grad_(True)
    with comm.recording() as fwd:
        z = mlp_forward(x, *params, group, lambda t: copy_to_tp(t, group), lambda t: reduce_from_tp(t, group))
    with comm.recording() as bwd:
        z.backward(torch.ones_like(z))
    return z.detach(), x.grad, [p.grad for p in params], fwd.count("all_reduce"), bwd.count("all_reduce")


def check_tp_mlp(mlp_forward) -> None:
    """``mlp_forward(x, fc_w_i, fc_b_i, proj_w_i, proj_b, group, f, g)`` -> GeLU(x A_i + a_i) B_i summed
    over ranks + proj bias, with f and g placed so that z, dX and every gradient equal one device."""
    x, a, a_b, b, b_b = _data((2, 5, 8), (32, 8), (32,), (8, 32), (8,), seed=3)
    full = [t.clone().requires_grad_(True) for t in (x, a, a_b, b, b_b)]
    z = F.linear(F.gelu(F.linear(full[0], full[1], full[2])), full[3], full[4])
    z.backward(torch.ones_like(z))
    for n in RANKS:
        for r, (got, dx, grads, n_fwd, n_bwd) in enumerate(run_on_ranks(_run_mlp, n, mlp_forward,
                                                                        what="mlp_forward", timeout=20)):
            where = f"tensor-parallel MLP on {n} ranks, rank {r}"
            if not close(got, z.detach()):
                biased_t_times = isinstance(got, torch.Tensor) and close(got, z.detach() + (n - 1) * b_b)
                fail(f"{where}: output", "the whole z on every rank", _max_diff(got, z.detach()),
                     "the bias of the row-parallel layer was added before g: every rank added it, so it "
                     "counts t times — add it after the all-reduce" if biased_t_times else
                     "g (all-reduce) must sum the partial products x_i B_i after the second linear, not before "
                     "GeLU (GeLU of a sum is not the sum of GeLUs)" if n_fwd else
                     "no g: each rank holds only its partial product; sum them with g after the second linear")
            if n_fwd != 1 or n_bwd != 1:
                fail(f"{where}: all-reduces", "one forward (g), one backward (f)",
                     f"{n_fwd} forward, {n_bwd} backward",
                     "f goes on the input of the column-parallel layer, g on the output of the row-parallel "
                     "layer, once each" if n_bwd == 0 else "use f and g exactly once each")
            if not close(dx, full[0].grad):
                fail(f"{where}: dX", "the whole dX", _max_diff(dx, full[0].grad),
                     "f must wrap x itself (before the first linear): its backward all-reduces dX")
            wants = [full[1].grad.chunk(n)[r], full[2].grad.chunk(n)[r], full[3].grad.chunk(n, 1)[r], full[4].grad]
            for name, g_, w_ in zip(("fc_w_i", "fc_b_i", "proj_w_i", "proj_b"), grads, wants):
                if not close(g_, w_):
                    fail(f"{where}: gradient of {name}", "one device's (this rank's slice)", _max_diff(g_, w_),
                         "place f before the first linear and g right after the second linear's matmul; the "
                         "bias after g")
    print("tensor-parallel MLP: output, dX and every gradient equal one device on 2 and 4 ranks, "
          "with one all-reduce forward (g) and one backward (f)")
