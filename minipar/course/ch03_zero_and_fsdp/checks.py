"""Checks for chapter 03's exercises: the ZeRO-1 optimizer step on a shard, the gather-compute-free
pattern of a ZeRO-3 unit, and owner-compute Muon (one matrix's Newton–Schulz on its owner). Each runs the
learner's function on 4 ranks through :mod:`minipar.comm`, compares the numbers with one process doing the
same maths, and compares the traffic with what the pattern should cost: the collectives the log saw must be
the expected ones with the expected bytes (not merely at most), and the bytes each rank really wrote to its
sockets (:mod:`minipar.wire`) must all be explained by those logged calls — a collective called straight
through ``torch.distributed`` is seen there and refused. For the unit, the bytes still alive afterwards are
checked too.
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.memory import LiveTensorTracker
from minipar.optim.muon import MuonConfig, newton_schulz
from minipar.course.checks import fail, run_on_ranks
from minipar.course.checks import refuse_unlogged, unlogged_bytes

__all__ = ["zero1_problem", "check_zero1_step", "unit_problem", "check_gather_compute_free", "muon_problem",
           "check_owner_muon"]

WORLD_SIZE = 4


def zero1_problem(world_size: int = WORLD_SIZE, numel: int = 24, seed: int = 0):
    """(initial flat parameters, [local gradient of rank r] per rank), numel a multiple of world_size."""
    g = torch.Generator().manual_seed(seed)
    params = torch.randn(numel, generator=g)
    grads = [torch.randn(numel, generator=g) for _ in range(world_size)]
    return params, grads


def _zero1_rank(rank, world_size, zero1_step, params, grads, runs):
    """Each (optimizer, steps) in ``runs`` from the same start: [(final full params, bytes in the log per
    step, {op: calls} per step, bytes observed on the wire per step, unlogged bytes per step)]."""
    out = []
    for optimizer_name, steps in runs:
        full = params.clone()
        shard_numel = full.numel() // world_size
        shard = torch.nn.Parameter(full[rank * shard_numel:(rank + 1) * shard_numel].clone())
        optimizer = _optimizer(optimizer_name, [shard])
        with comm.recording() as log:
            for _ in range(steps):
                zero1_step(full, grads[rank].clone(), shard, optimizer)
        unlogged = unlogged_bytes(log)
        observed = log.observed_bytes_sent
        out.append((full, log.bytes_sent / steps, {op: c / steps for op, (c, _) in log.by_op().items()},
                    None if observed is None else observed / steps, None if unlogged is None else unlogged / steps))
    return out


def _optimizer(name, params):
    return torch.optim.SGD(params, lr=0.1) if name == "sgd" else torch.optim.Adam(params, lr=0.1)


def _zero1_reference(params, grads, optimizer_name, steps):
    p = torch.nn.Parameter(params.clone())
    optimizer = _optimizer(optimizer_name, [p])
    for _ in range(steps):
        p.grad = sum(grads) / len(grads)
        optimizer.step()
    return p.detach()


def check_zero1_step(zero1_step) -> None:
    """``zero1_step(full_params, local_grads, shard, optimizer)`` on 4 ranks, SGD then Adam. 4096 parameters
    (16 KiB), so that gloo's headers (~2 KiB per call) are small beside a collective left out of the log."""
    params, grads = zero1_problem(numel=4096)
    n, nbytes = WORLD_SIZE, params.numel() * params.element_size()
    runs = (("sgd", 1), ("adam", 3))
    per_rank = run_on_ranks(_zero1_rank, n, zero1_step, params, grads, runs, what="zero1_step", timeout=45)
    for i, (name, steps) in enumerate(runs):
        got = [r[i] for r in per_rank]
        want = _zero1_reference(params, grads, name, steps)
        for rank, (full, *_) in enumerate(got):
            if torch.allclose(full, want, atol=1e-5):
                continue
            lo, hi = rank * (params.numel() // n), (rank + 1) * (params.numel() // n)
            mine_right = torch.allclose(full[lo:hi], want[lo:hi], atol=1e-5)
            if mine_right:
                mistake = ("only your own shard is updated: after the optimizer step, all-gather the shards "
                           "into full_params so every rank has every updated parameter")
            elif name == "sgd" and torch.allclose(full, params - 0.1 * sum(grads), atol=1e-5):
                mistake = ("the gradient is the sum over ranks, not the mean: divide the reduce-scattered "
                           "shard by the number of ranks")
            elif name == "sgd" and torch.allclose(full[lo:hi], (params - 0.1 * grads[rank])[lo:hi], atol=1e-5):
                mistake = "each rank used its own gradient: reduce-scatter the local gradients first"
            else:
                mistake = ("reduce-scatter local_grads into a shard-sized tensor, divide by N, set it as "
                           "shard.grad, optimizer.step(), then all-gather shard into full_params")
            fail(f"zero1_step with {name.upper()}: the parameters on rank {rank} after {steps} step(s)",
                 want[:6].tolist(), full[:6].tolist(), mistake)
        want_bytes = 2 * (n - 1) / n * nbytes
        for rank, (_, sent, ops, _, unlogged) in enumerate(got):
            refuse_unlogged(f"zero1_step on rank {rank}", unlogged, limit=nbytes / 4)
            if ops.get("all_reduce"):
                fail("zero1_step: the collectives per step", "a reduce-scatter and an all-gather "
                     f"({want_bytes:.0f} B in all, the same as DDP's all-reduce)", f"{ops}, {sent:.0f} B",
                     "an all-reduce of the whole gradient costs 2(N-1)/N·S by itself; ZeRO-1 needs only "
                     "a reduce-scatter (each rank gets the sum of its own shard) before the all-gather")
            rings = ops.get("send", 0) > 0
            wanted = rings or (ops.get("reduce_scatter") == 1 and ops.get("all_gather") == 1)
            if not wanted or abs(sent - want_bytes) > 0.01 * want_bytes:
                fail(f"zero1_step on rank {rank}: the collectives per step and their bytes",
                     f"one reduce-scatter + one all-gather, {want_bytes:.0f} B", f"{ops}, {sent:.0f} B",
                     "reduce-scatter local_grads into a shard-sized tensor (comm.reduce_scatter_tensor), then "
                     "all-gather the updated shard into full_params (comm.all_gather_into_tensor), once each")
    sent, observed = got[0][1], got[0][3]
    print(f"zero1_step: right on {n} ranks with SGD and Adam; measured on rank 0 per step: {sent:.0f} B in "
          f"the log (reduce-scatter + all-gather = DDP's all-reduce, {want_bytes:.0f} B), "
          f"{'-' if observed is None else f'{observed:.0f}'} B written to the sockets (gloo's reduce-scatter "
          f"all-reduces, so ~1.5x on this backend; headers included)")


def unit_problem(out_features: int = 5, in_features: int = 7, world_size: int = WORLD_SIZE, seed: int = 0):
    """(weight (out, in), x (3, in), the shards: weight flattened, padded to a multiple of N, cut in N)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(3, in_features, generator=g)
    shard_numel = -(-weight.numel() // world_size)
    flat = torch.zeros(shard_numel * world_size)
    flat[: weight.numel()] = weight.reshape(-1)
    return weight, x, list(flat.chunk(world_size))


def _unit_rank(rank, world_size, unit_forward, shards, out_features, in_features, x):
    tracker = LiveTensorTracker()
    with comm.recording() as log, tracker:
        y = unit_forward(shards[rank].clone(), out_features, in_features, x)
    out_bytes = y.numel() * y.element_size() if isinstance(y, torch.Tensor) else 0
    alive = tracker.settle(at_most=out_bytes)    # after the call: what the function left behind
    ops = {op: c for op, (c, _) in log.by_op().items()}
    return y, log.bytes_sent, alive, tracker.peak, ops, log.observed_bytes_sent, unlogged_bytes(log)


def check_gather_compute_free(unit_forward) -> None:
    """``unit_forward(weight_shard, out_features, in_features, x)`` -> x @ Wᵀ, gathering W and freeing it."""
    weight, x, shards = unit_problem()
    n = WORLD_SIZE
    full_bytes = sum(s.numel() for s in shards) * 4
    got = run_on_ranks(_unit_rank, n, unit_forward, shards, *weight.shape, x, what="unit_forward",
                       timeout=45)
    want = x @ weight.t()
    gather_bytes = (n - 1) / n * full_bytes
    for rank, (y, sent, alive, _, ops, _, unlogged) in enumerate(got):
        if not (isinstance(y, torch.Tensor) and y.shape == want.shape and torch.allclose(y, want, atol=1e-5)):
            fail(f"unit_forward on rank {rank}", want[0].tolist(),
                 y[0].tolist() if isinstance(y, torch.Tensor) and y.dim() == 2 else repr(y)[:200],
                 "all-gather the shards into one flat tensor of N·len(shard), drop the padding "
                 "([:out_features * in_features]), view it as (out_features, in_features), return x @ w.t()")
        refuse_unlogged(f"unit_forward on rank {rank}", unlogged)
        if sent > gather_bytes * 1.01:
            fail("unit_forward: bytes sent per rank", f"{gather_bytes:.0f} (one all-gather)",
                 f"{sent:.0f}", "rebuilding the weight with an all-reduce of a zero-padded buffer costs twice "
                 "an all-gather: use comm.all_gather_into_tensor")
        if not (ops.get("all_gather") == 1 or ops.get("send")) or abs(sent - gather_bytes) > 0.01 * gather_bytes:
            fail(f"unit_forward on rank {rank}: the collectives and their bytes",
                 f"one all-gather, {gather_bytes:.0f} B", f"{ops}, {sent:.0f} B",
                 "gather the shards with comm.all_gather_into_tensor (one call), nothing else")
        leftover = alive - y.numel() * y.element_size()
        if leftover >= full_bytes // 2:
            fail("unit_forward: bytes still alive after it returned (besides the output)",
                 "≈ 0: the gathered weight is freed once the output is computed", f"{leftover}",
                 "the full weight is kept somewhere (a global, a cache, an attribute): ZeRO-3's point is "
                 "that only the shard survives the unit")
    observed = got[0][5]
    print(f"unit_forward: right on {n} ranks; measured on rank 0: one all-gather, {got[0][1]:.0f} B in the "
          f"log (formula {gather_bytes:.0f} B), {'-' if observed is None else observed} B written to the "
          f"sockets (gloo's headers included); gathered weight freed after use (peak {got[0][3]} B, left "
          f"behind {got[0][2]} B = the output)")


def muon_problem(seed: int = 0):
    """(Muon's config: Newton–Schulz in float64, [whole update U of each matrix]): a wide one owned by rank 0
    and a tall one owned by rank 1, rows a multiple of 4 ranks."""
    g = torch.Generator().manual_seed(seed)
    return MuonConfig(ns_dtype=None), [torch.randn(shape, generator=g, dtype=torch.float64)
                                       for shape in ((32, 48), (64, 24))]


def _muon_rank(rank, world_size, owner_muon_step, cfg, updates):
    """Per matrix m (owner m mod N): (this rank's rows of the result, bytes in the log, {op: calls}, unlogged)."""
    out = []
    for m, update in enumerate(updates):
        with comm.recording() as log:
            rows = owner_muon_step(update.chunk(world_size)[rank].clone(), m % world_size, cfg)
        ops = {op: c for op, (c, _) in log.by_op().items()}
        out.append((rows, log.bytes_sent, ops, unlogged_bytes(log)))
    return out


def check_owner_muon(owner_muon_step) -> None:
    """``owner_muon_step(rows, owner, cfg)`` -> this rank's rows of NS(U), U the matrix whose rows each rank
    holds, computed on ``owner``: the numbers against one process's Newton–Schulz of the whole matrix (float64,
    1e-12), the bytes against a gather to the owner and a scatter back."""
    cfg, updates = muon_problem()
    n = WORLD_SIZE
    got = run_on_ranks(_muon_rank, n, owner_muon_step, cfg, updates, what="owner_muon_step", timeout=45)
    for m, update in enumerate(updates):
        want, size, owner = newton_schulz(update, cfg).chunk(n), update.numel() * update.element_size(), m % n
        for rank, per_matrix in enumerate(got):
            rows, sent, ops, unlogged = per_matrix[m]
            mine = update.chunk(n)[rank]
            if not (isinstance(rows, torch.Tensor) and rows.shape == mine.shape
                    and torch.allclose(rows, want[rank], rtol=0, atol=1e-12)):
                local = isinstance(rows, torch.Tensor) and rows.shape == mine.shape and torch.allclose(
                    rows, newton_schulz(mine, cfg), rtol=0, atol=1e-12)
                mistake = ("Newton–Schulz on this rank's rows alone (per-shard): ‖U‖_F and X·Xᵀ need every "
                           "row, so that orthogonalises another matrix. Gather the rows to the owner first"
                           if local else "gather the rows to the owner (comm.gather), newton_schulz(torch.cat("
                           "pieces), cfg) there, scatter its N row-chunks back (comm.scatter)")
                fail(f"owner_muon_step, matrix {tuple(update.shape)} owned by rank {owner}: rank {rank}'s rows",
                     want[rank][0, :4].tolist(), rows[0, :4].tolist() if isinstance(rows, torch.Tensor)
                     and rows.dim() == 2 else repr(rows)[:200], mistake)
            refuse_unlogged(f"owner_muon_step on rank {rank}", unlogged)
            expected = (n - 1) / n * size if rank == owner else size / n
            if abs(sent - expected) > 0.01 * expected:
                everywhere = ops.get("all_gather") or abs(sent - (n - 1) / n * size) <= 0.01 * size
                fail(f"owner_muon_step, matrix {tuple(update.shape)} owned by rank {owner}: bytes rank {rank} sent",
                     f"{expected:.0f} B ({'scatter its chunks back' if rank == owner else 'its rows, to the owner'})",
                     f"{ops}, {sent:.0f} B",
                     "every rank gathered the whole matrix (gather-everywhere: right numbers, (N−1)/N of the "
                     "matrix from every rank and N times the compute); send the rows to the owner alone"
                     if everywhere and rank != owner else
                     "one comm.gather to the owner and one comm.scatter from it, nothing else")
    print(f"owner_muon_step: right on {n} ranks for a wide and a tall matrix (max |Δ| ≤ 1e-12 against one "
          f"process's Newton–Schulz); bytes per rank: the owner (N−1)/N of the matrix, the others 1/N")
