"""What every chapter's exercise checks share (each chapter's are in ``minipar/course/chNN_topic/checks.py``).

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
