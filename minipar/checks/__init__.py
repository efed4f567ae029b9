"""Exercise checks, one module per chapter (``minipar/checks/chNN.py``).

A check takes the learner's function, runs it (on several ranks where the exercise is distributed) and
raises :class:`ExerciseError` that teaches when it is wrong: what was expected, what came back, and the
likely mistake. It prints a short confirmation when right.
"""


__all__ = ["ExerciseError", "run_on_ranks", "fail"]


class ExerciseError(AssertionError):
    """A check failed: the message says what was expected, what came back and the likely mistake."""


def run_on_ranks(fn, world_size: int, *args, what: str = "your function", timeout: float = 15.0, **kwargs):
    """``launch(fn, world_size, *args, quiet=True)`` for a check, translating a failed run into what the
    learner needs: the unfinished stub stays a ``NotImplementedError``, a deadlock and a crash become an
    :class:`ExerciseError` saying what probably went wrong (a short collective timeout, so a deadlocked
    exercise fails in seconds).

    Each rank writes down its own exception before it exits, so the rank that really failed is reported,
    not a rank that lost its connection to it afterwards ("closed by peer")."""
    import tempfile

    from ..launcher import RankError, launch
    with tempfile.TemporaryDirectory(prefix="minipar-check-") as errdir:
        try:
            return launch(_noting_errors, world_size, fn, errdir, *args, timeout=timeout, quiet=True, **kwargs)
        except RankError as exc:
            errors = _read_errors(errdir) or {exc.rank: (str(exc).split(" failed: ", 1)[-1], exc.rank_traceback)}
    causes = {r: e for r, e in errors.items() if not _lost_a_peer(e[0])}
    if not causes:
        raise ExerciseError(
            f"{what} did not finish on {world_size} ranks: rank {min(errors)} waited more than {timeout:g} s for "
            f"a message nobody sent (a deadlock).\nlikely mistake: a wrong neighbour (in a ring, send to "
            f"(rank + 1) % world_size and receive from (rank - 1) % world_size), or ranks calling the "
            f"same collectives in a different order.") from None
    rank = min(causes)
    message, tb = causes[rank]
    if message.startswith("NotImplementedError"):
        raise NotImplementedError(f"{what} is not written yet (rank {rank} reached the stub): "
                                  f"replace '# YOUR CODE HERE' and the raise below it") from None
    if message.startswith("ExerciseError"):
        raise ExerciseError(message.split("ExerciseError: ", 1)[-1]) from None
    raise ExerciseError(f"{what} raised on rank {rank}:\n{tb.rstrip()}") from None


def _noting_errors(rank, world_size, fn, errdir, *args, **kwargs):
    import os
    import traceback
    try:
        return fn(rank, world_size, *args, **kwargs)
    except BaseException as exc:
        path = os.path.join(errdir, f"{rank}.err")
        with open(path + ".tmp", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\0{traceback.format_exc()}")
        os.replace(path + ".tmp", path)   # whole or absent: the launcher may kill this rank any moment now
        raise


def _read_errors(errdir) -> dict:
    import os
    errors = {}
    for name in os.listdir(errdir):
        if not name.endswith(".err"):
            continue
        with open(os.path.join(errdir, name)) as f:
            message, _, tb = f.read().partition("\0")
        errors[int(name.split(".")[0])] = (message, tb)
    return errors


def _lost_a_peer(message: str) -> bool:
    """A rank that failed only because another one stopped or never answered (gloo's words)."""
    text = message.lower()
    return any(w in text for w in ("closed by peer", "connection reset", "timed out", "timeout"))


def fail(what: str, expected, got, mistake: str):
    """Raise the standard teaching message: what was checked, expected, got, likely mistake."""
    raise ExerciseError(f"{what}\n  expected: {expected}\n  got:      {got}\n  likely mistake: {mistake}")
