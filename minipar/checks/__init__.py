"""Exercise checks, one module per chapter (``minipar/checks/chNN.py``).

A check takes the learner's function, runs it (on several ranks where the exercise is distributed) and
raises :class:`ExerciseError` that teaches when it is wrong: what was expected, what came back, and the
likely mistake. It prints a short confirmation when right.
"""


class ExerciseError(AssertionError):
    """A check failed: the message says what was expected, what came back and the likely mistake."""
