"""Checks for chapter 00's exercises: what a collective leaves on each rank, and one step of a ring.

Every check compares with a live run of the real collective through :mod:`minipar.comm` on 4 ranks (or a
step-by-step simulation of the ring, then a live ring built from the learner's schedule), and names the
likely mistake when the answer matches a known wrong one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minipar import comm
from minipar.course.checks import ExerciseError, fail, refuse_unlogged, run_on_ranks, unlogged_bytes

__all__ = ["rank_inputs", "check_after_all_gather", "check_after_reduce_scatter", "check_average",
           "check_ring_step"]

WORLD_SIZE = 4


def rank_inputs(world_size: int = WORLD_SIZE, numel: int = 8) -> list:
    """Rank r's input: 10·r + 1, 10·r + 2, ... (every number says which rank it came from)."""
    return [torch.arange(1, numel + 1, dtype=torch.float32) + 10 * r for r in range(world_size)]


def _same(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.float(), b.float())


def _per_rank_answer(fn, inputs, what):
    got = fn([t.clone() for t in inputs])
    if not isinstance(got, (list, tuple)) or len(got) != len(inputs):
        fail(what, f"a list with one tensor per rank ({len(inputs)})", repr(got)[:200],
             "return [what rank 0 holds, what rank 1 holds, ...]")
    return list(got)


def _diagnose(what, rank, got, want, known_wrong):
    for wrong, mistake in known_wrong:
        if _same(got, wrong):
            fail(f"{what}: rank {rank}", want.tolist(), got.tolist(), mistake)
    fail(f"{what}: rank {rank}", want.tolist(), got.tolist() if isinstance(got, torch.Tensor) else got,
         "compare with the definition in the chapter, rank by rank")


def _real_all_gather(rank, n, inputs):
    out = torch.empty(n * inputs[rank].numel())
    comm.all_gather_into_tensor(out, inputs[rank])
    return out


def check_after_all_gather(after_all_gather) -> None:
    """``after_all_gather(inputs)`` -> what each rank holds after ``all_gather_into_tensor``."""
    inputs = rank_inputs(numel=3)
    got = _per_rank_answer(after_all_gather, inputs, "after_all_gather(inputs)")
    real = run_on_ranks(_real_all_gather, WORLD_SIZE, inputs, what="the real all-gather")
    for r in range(WORLD_SIZE):
        if not _same(got[r], real[r]):
            _diagnose("all-gather", r, got[r], real[r], [
                (inputs[r], f"rank {r} holds only its own input: all-gather gives every rank every rank's input"),
                (torch.cat(inputs[::-1]), "the pieces are in reverse order: rank 0's piece comes first"),
                (torch.stack(inputs), "stacked into a matrix: all_gather_into_tensor concatenates (torch.cat)"),
                (sum(inputs), "summed: that is all-reduce; all-gather only moves data")])
    print(f"all-gather: right on all {WORLD_SIZE} ranks (checked against a live run)")


def _real_reduce_scatter(rank, n, inputs):
    out = torch.empty(inputs[rank].numel() // n)
    comm.reduce_scatter_tensor(out, inputs[rank].clone())
    return out


def check_after_reduce_scatter(after_reduce_scatter) -> None:
    """``after_reduce_scatter(inputs)`` -> what each rank holds after ``reduce_scatter_tensor`` (sum)."""
    inputs = rank_inputs(numel=8)
    got = _per_rank_answer(after_reduce_scatter, inputs, "after_reduce_scatter(inputs)")
    real = run_on_ranks(_real_reduce_scatter, WORLD_SIZE, inputs, what="the real reduce-scatter")
    total = sum(inputs)
    for r in range(WORLD_SIZE):
        if not _same(got[r], real[r]):
            _diagnose("reduce-scatter", r, got[r], real[r], [
                (total, "that is the whole sum (all-reduce): reduce-scatter leaves rank r only chunk r of it"),
                (inputs[r].chunk(WORLD_SIZE)[r], f"not reduced: chunk {r} must be summed over all ranks"),
                (real[r] / WORLD_SIZE, "divided by world_size: reduce_scatter sums (ReduceOp.SUM)"),
                (total.chunk(WORLD_SIZE)[(r + 1) % WORLD_SIZE], "wrong chunk: rank r gets chunk r of the sum"),
                (total.chunk(WORLD_SIZE)[WORLD_SIZE - 1 - r], "wrong chunk: rank r gets chunk r of the sum")])
    print(f"reduce-scatter: right on all {WORLD_SIZE} ranks (checked against a live run)")


def _run_average(rank, n, average, inputs):
    with comm.recording() as log:
        out = average(inputs[rank].clone())
    return out, log.count(), log.count("all_reduce"), log.bytes_sent, log.observed_bytes_sent, unlogged_bytes(log)


def check_average(average) -> None:
    """``average(t)`` on every rank -> the mean of every rank's ``t`` (as data parallelism needs for grads)."""
    inputs = rank_inputs(numel=4)
    mean = sum(inputs) / WORLD_SIZE
    results = run_on_ranks(_run_average, WORLD_SIZE, average, inputs, what="average(t)")
    for r, (got, calls, all_reduces, _, _, unlogged) in enumerate(results):
        if _same(got, mean):
            continue
        if _same(got, mean * WORLD_SIZE):
            fail(f"average: rank {r}", mean.tolist(), got.tolist(),
                 f"rank {r} holds the sum over ranks 0..{WORLD_SIZE - 1} but was not divided by world_size")
        if _same(got, inputs[r]) or _same(got, inputs[r] / WORLD_SIZE):
            fail(f"average: rank {r}", mean.tolist(), got.tolist(),
                 f"nothing came from the other ranks ({calls} collective calls): call comm.all_reduce(t)")
        if got is None:
            fail(f"average: rank {r}", mean.tolist(), None, "return the tensor")
        _diagnose("average", r, got, mean, [])
    for r, (_, _, _, _, _, unlogged) in enumerate(results):
        refuse_unlogged(f"average on rank {r}", unlogged)
    model, observed = results[0][3], results[0][4]
    print(f"average: every rank holds the mean over {WORLD_SIZE} ranks; measured on rank 0: "
          f"{results[0][2]} all-reduce(s), {model} B in the log's model, "
          f"{'-' if observed is None else observed} B written to the sockets (gloo's headers included)")


# ----------------------------------------------------------------------------------------------------
# One step of ring reduce-scatter
# ----------------------------------------------------------------------------------------------------

def _schedule(ring_step, rank, n, step):
    got = ring_step(rank, n, step)
    if not (isinstance(got, (tuple, list)) and len(got) == 4 and all(isinstance(v, int) for v in got)):
        fail(f"ring_step({rank}, {n}, {step})", "(send_to, send_chunk, recv_from, recv_chunk), four ints",
             repr(got)[:200], "return a tuple of four ints")
    return tuple(got)


def simulate_ring(ring_step, n: int) -> list:
    """Run the learner's schedule symbolically: which ranks' contributions each rank holds per chunk."""
    holds = [[{r} for _ in range(n)] for r in range(n)]   # holds[rank][chunk] = ranks summed in
    for step in range(n - 1):
        plan = [_schedule(ring_step, r, n, step) for r in range(n)]
        for r, (send_to, send_chunk, recv_from, recv_chunk) in enumerate(plan):
            if send_to != (r + 1) % n or recv_from != (r - 1) % n:
                fail(f"ring_step({r}, {n}, {step}): the neighbours", f"send to {(r + 1) % n}, receive from "
                     f"{(r - 1) % n}", f"send to {send_to}, receive from {recv_from}",
                     "wrong neighbour in the ring: rank r sends to (r + 1) % world_size and receives from "
                     "(r - 1) % world_size")
        for r, (_, _, recv_from, recv_chunk) in enumerate(plan):
            sent_chunk = plan[recv_from][1]
            if recv_chunk != sent_chunk:
                fail(f"step {step} on {n} ranks: rank {r} adds what rank {recv_from} sends", f"chunk {sent_chunk}",
                     f"chunk {recv_chunk}", "the chunk rank r receives must be the one its left neighbour sends")
        incoming = [set(holds[plan[r][2]][plan[r][3]]) for r in range(n)]   # read before anyone adds
        for r in range(n):
            holds[r][plan[r][3]] |= incoming[r]
    return holds


def check_ring_step(ring_step) -> None:
    """``ring_step(rank, world_size, step)`` -> ``(send_to, send_chunk, recv_from, recv_chunk)`` for step
    ``step`` of ring reduce-scatter, such that after world_size - 1 steps rank r holds the whole sum of
    chunk r. Checked by simulation on 2..5 ranks, then live: a reduce-scatter built on it on 4 ranks."""
    for n in (2, 3, 4, 5):
        holds = simulate_ring(ring_step, n)
        for r in range(n):
            if holds[r][r] != set(range(n)):
                fail(f"after {n - 1} steps on {n} ranks, chunk {r} on rank {r}",
                     f"the sum over ranks {sorted(range(n))}", f"the sum over ranks {sorted(holds[r][r])}",
                     "rank r must add the last contribution to chunk r in the last step, and in every step "
                     "pass on the chunk it added to in the step before (rank r starts by sending a chunk that is "
                     "not its own)")
    inputs = rank_inputs(numel=8)
    got = run_on_ranks(_live_ring, WORLD_SIZE, ring_step, inputs, what="a ring built on ring_step")
    want = sum(inputs).chunk(WORLD_SIZE)
    for r in range(WORLD_SIZE):
        if not _same(got[r], want[r]):
            raise ExerciseError(f"live ring on 4 ranks: rank {r} holds {got[r].tolist()}, expected "
                                f"{want[r].tolist()}")
    print("ring step: every rank ends with the whole sum of its chunk (simulated on 2..5 ranks, run live on 4)")


def _live_ring(rank, n, ring_step, inputs):
    chunks = [c.clone() for c in inputs[rank].chunk(n)]
    for step in range(n - 1):
        send_to, send_chunk, recv_from, recv_chunk = ring_step(rank, n, step)
        incoming = torch.empty_like(chunks[recv_chunk])
        req = comm.isend(chunks[send_chunk], send_to)
        comm.recv(incoming, recv_from)
        req.wait()
        chunks[recv_chunk] += incoming
    dist.barrier()
    return chunks[rank]
