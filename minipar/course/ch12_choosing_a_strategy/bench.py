"""Chapter 12's benchmark: ``python -m minipar bench published`` — the planner's step time for published
training runs beside their papers (:mod:`.published_bench`). The benchmarks of the course's own runs
(``calibrate``, ``replay``, ``steps``, ``gpu``) are appendix A's."""
from __future__ import annotations

from .published_bench import main as published_main

__all__ = ["BENCHMARKS"]

BENCHMARKS = {"published": published_main}
