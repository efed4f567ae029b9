"""What every chapter's exercise checks share (each chapter's are in ``minipar/course/chNN_topic/checks.py``).

A check takes the learner's function, runs it (on several ranks where the exercise is distributed) and
raises :class:`ExerciseError` that teaches when it is wrong: what was expected, what came back, and the
likely mistake. It prints a short confirmation when right.
"""


__all__ = ["ExerciseError", "run_on_ranks", "fail", "tp_group", "close", "unlogged_bytes", "refuse_unlogged",
           "FRAMING_PER_CALL", "UNLOGGED_LIMIT"]


class ExerciseError(AssertionError):
    """A check failed: the message says what was expected, what came back and the likely mistake."""


def run_on_ranks(fn, world_size: int, *args, what: str = "your function", timeout: float = 15.0, **kwargs):
    """``launch(fn, world_size, *args, quiet=True)`` for a check, translating a failed run into what the
    learner needs: the unfinished stub stays a ``NotImplementedError``, a deadlock and a crash become an
    :class:`ExerciseError` saying what probably went wrong (a short collective timeout, so a deadlocked
    exercise fails in seconds). The launcher already names the rank that really failed, not a rank that
    lost its connection to it afterwards ("closed by peer")."""
    from ..launcher import LaunchTimeout, RankError, launch
    try:
        return launch(fn, world_size, *args, timeout=timeout, quiet=True, **kwargs)
    except LaunchTimeout as exc:
        raise ExerciseError(
            f"{what} did not finish on {world_size} ranks: rank {exc.rank} waited more than {timeout:g} s for "
            f"a message nobody sent (a deadlock).\nlikely mistake: a wrong neighbour (in a ring, send to "
            f"(rank + 1) % world_size and receive from (rank - 1) % world_size), or ranks calling the "
            f"same collectives in a different order.") from None
    except RankError as exc:
        message = str(exc).split(" failed: ", 1)[-1].split("\n\n--- traceback", 1)[0]
        if message.startswith("NotImplementedError"):
            raise NotImplementedError(f"{what} is not written yet (rank {exc.rank} reached the stub): "
                                      f"replace '# YOUR CODE HERE' and the raise below it") from None
        if message.startswith("ExerciseError"):
            raise ExerciseError(message.split("ExerciseError: ", 1)[-1]) from None
        raise ExerciseError(f"{what} raised on rank {exc.rank}:\n{exc.rank_traceback.rstrip()}") from None


def fail(what: str, expected, got, mistake: str):
    """Raise the standard teaching message: what was checked, expected, got, likely mistake."""
    raise ExerciseError(f"{what}\n  expected: {expected}\n  got:      {got}\n  likely mistake: {mistake}")


def tp_group(rank: int, world_size: int):
    """The tensor-parallel group of all ``world_size`` ranks (what the TP and SP exercises run in)."""
    from minipar.mesh import Mesh
    return Mesh(world_size, tp=world_size).build(rank).group("tp")


def close(a, b, tol: float = 1e-9) -> bool:
    """``a`` is a tensor of ``b``'s shape and equal to it within ``tol`` (absolute and relative)."""
    import torch
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=tol)


FRAMING_PER_CALL = 2048   # gloo's headers per logged call, at most (measured: ~150 B a message, 1.7 KiB a
                          # 4-rank all-reduce)
UNLOGGED_LIMIT = 512      # bytes on the wire that no logged call explains, tolerated (a print is tens of bytes)


# ----------------------------------------------------------------------------------------------------
# Traffic the log did not see: checks that cannot be fooled by calling torch.distributed directly
# ----------------------------------------------------------------------------------------------------

def _wire_of(record) -> float:
    """The most gloo puts on the wire for one logged call: its model, except where gloo runs another
    algorithm — reduce-scatter all-reduces (2x), reduce and broadcast move up to one payload more."""
    if record.op == "reduce_scatter":
        return 2 * record.sent_bytes
    if record.op in ("reduce", "broadcast"):
        return record.sent_bytes + record.payload_bytes
    return record.sent_bytes


def unlogged_bytes(log) -> float | None:
    """Bytes this rank wrote to its sockets inside ``log``'s block that none of its logged calls explains
    (their gloo traffic plus :data:`FRAMING_PER_CALL` each): collectives called straight through
    ``torch.distributed``. None where the kernel's counter is not available (not Linux)."""
    if log.observed_bytes_sent is None:
        return None
    explained = sum(_wire_of(r) + FRAMING_PER_CALL for r in log.records)
    return log.observed_bytes_sent - explained


def refuse_unlogged(what: str, unlogged, limit: float = UNLOGGED_LIMIT) -> None:
    """Fail when more than ``limit`` bytes went over the wire around :mod:`minipar.comm`'s log."""
    if unlogged is not None and unlogged > limit:
        fail(f"{what}: bytes on the wire that minipar.comm's log did not see",
             f"≤ {limit:.0f} (every collective through minipar.comm, so it is counted)", f"{unlogged:.0f}",
             "a collective was called straight through torch.distributed (dist.all_reduce, ...): the "
             "sockets carried it, the log did not. Call the minipar.comm wrapper (comm.all_reduce, "
             "comm.reduce_scatter_tensor, comm.all_gather_into_tensor, ...) so your traffic is counted")
