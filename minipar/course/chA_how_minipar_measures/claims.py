"""Appendix A's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

from minipar.machine import gpu_measured


def check_checked_real_h100_host_floor(gpu_rows, inside, course_step, gpu_runs) -> None:
    """Checked on a real H100: the host is the floor"""
    assert len(gpu_rows) == 10 and len(inside) == 9 and course_step["measured"] > 5 * course_step["device"]
    assert abs(gpu_measured.gemm_efficiency(gpu_runs)[0] - 0.72) < 0.005
