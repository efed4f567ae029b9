"""The one check every ``validate`` repeats: a size, degree or count must be a positive integer.

Raised before any process starts, with the name the user typed, so a learner reads
``ValueError: tp must be a positive integer, got 0`` rather than a traceback from inside a rank.
"""
from __future__ import annotations

__all__ = ["positive_int"]


def positive_int(name: str, value) -> int:
    """``value`` if it is an ``int`` ≥ 1 (``bool`` is not), else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
