"""Chapter 09b's benchmark: ``python -m minipar bench five-d`` makes the chapter's two 16-rank launches
(dp × pp × cp × tp, then with MoE and ep folded in) and writes the record the chapter reads."""
from __future__ import annotations


def _record_five_d(argv=None) -> int:
    """Chapter 09b's 16-rank launches (dp × pp × cp × tp, ep folded in), made now and written to the record
    the chapter reads."""
    from .five_d import record_main
    return record_main(argv)


BENCHMARKS = {"five-d": _record_five_d}
