"""Chapter 10b's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import math

from minipar.precision.formats import E4M3
from minipar.precision.formats import E5M2
from minipar.precision.formats import round_to


def check_two_8_bit_formats_why(decades) -> None:
    """Two 8-bit formats, and why they need scales"""
    assert E4M3.max == 448 and E5M2.max == 57344 and round_to(1e6, E4M3) == 448 and math.isinf(round_to(1e6, E5M2))
    assert round_to(2.0 ** -10, E4M3) == 0 and round_to(1.5 * 2.0 ** -10, E4M3) == 2.0 ** -9
    assert round(decades["E4M3"], 1) == 5.4 and round(decades["E5M2"], 1) == 9.6 and round(decades["FP16"], 1) == 12.0


def check_formats_match_torch_finfo(f, info) -> None:
    """Two 8-bit formats, and why they need scales"""
    assert (f.max, f.smallest_normal, f.eps) == (info.max, info.tiny, info.eps)


def check_e4m3_quantize_saturates_at_448(q, rel) -> None:
    """Two 8-bit formats, and why they need scales"""
    assert float(q.data.float().abs().max()) == 448 and rel <= E4M3.eps / 2


def check_granularities_real_activation_matrix_with(measured) -> None:
    """Granularities, on a real activation matrix with outlier channels"""
    assert measured["tensor"][1] > measured["row"][1] > measured["block"][1] > measured["mx"][1]
    assert measured["tensor"][0] > measured["row"][0] > measured["block"][0]


def check_delayed_vs_current_scaling(sat) -> None:
    """Delayed vs current scaling"""
    assert sat["current"] == 0 and sat["delayed, history 1"] > sat["delayed, history 8"] > 0


def check_accumulator_why_deepseek_v3_promotes(growth, table) -> None:
    """The accumulator: why DeepSeek-V3 promotes to FP32 every 128"""
    assert growth > 10 and table[4096][1] < table[128][0] and table[4096][1] < table[4096][0] / 50


def check_scales_in_all_gather_bytes(logged) -> None:
    """What FP8 buys: 12 B: the 4 scales' all-gather"""
    assert logged[1] == 2 * (logged[2] - 12) and logged[0] == 2 * logged[1]


def check_what_fp8_buys(observed) -> None:
    """What FP8 buys"""
    assert 0.49 < observed[2] / observed[1] < 0.52


def check_bytes_per_parameter(per_param, fp8_copy) -> None:
    """What FP8 buys"""
    assert per_param == {"FP32": 4, "FP16": 2, "BF16": 2, "E4M3": 1, "E5M2": 1} and sum(fp8_copy.values()) == 15
