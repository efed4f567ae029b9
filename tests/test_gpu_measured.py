"""The device model against one H100's measurements (minipar/machine/data/gpu/, written by tools/gpu_operators.py):
the card's two measured constants are what the data give, every measured step of the newest run lies within
15 % of its eager bounds, and the bounds are what their docstring says."""
import math

import pytest

from minipar.course.chA_how_minipar_measures import gpu_bench
from minipar.machine import gpu_measured
from minipar.machine.device import EAGER_HOST_SECONDS, H100_SXM, Op, eager_bounds, ops_seconds


@pytest.fixture(scope="module")
def reports():
    found = gpu_measured.runs()
    assert len(found) == 3 and {r["card"] for r in found} == {H100_SXM.name}
    return found


def test_card_constants_are_the_medians_of_the_data(reports):
    eta, low, high = gpu_measured.full_tile_efficiency(reports)          # the card: a full tile's rate
    assert abs(H100_SXM.gemm_efficiency - eta) < 0.005 and low < eta < high
    plain = gpu_measured.gemm_efficiency(reports)[0]                      # tiles' and bytes' losses in
    assert plain < eta and abs(plain - 0.7165) < 0.0005
    host, values = gpu_measured.host_seconds_per_operator(reports)
    assert abs(EAGER_HOST_SECONDS - host) < 0.5e-6 and len(values) == 10


def test_measured_steps_lie_within_their_bounds(reports):
    rows = gpu_measured.step_rows(reports)
    assert len(rows) == 10
    newest = [r for r in rows if r["run"] == reports[-1]["file"]]
    assert all(abs(r["ratio"] - 1) <= gpu_bench.TOLERANCE for r in newest)
    outside = [r for r in rows if abs(r["ratio"] - 1) > gpu_bench.TOLERANCE]
    assert [(r["run"], r["step"]) for r in outside] == [("h100_2026-11-27_run2.json", "tiny layer (launch-bound)")]
    # the launch-bound steps are host-bound: far above the device's own time
    course = [r for r in newest if r["step"].startswith("TinyGPT")]
    assert course and all(r["measured"] > 5 * r["device"] for r in course)


def test_the_old_five_microsecond_floor_alone_misses_the_course_model_by_far(reports):
    """Why the host term exists: without it the model prices the course's TinyGPT step ~9× too fast."""
    step = reports[-1]["course"]["TinyGPT (the course's default)"]
    from minipar.observe.opcount import ops_of
    assert step["measured_s"] / ops_seconds(ops_of(step["counted_ops"]), H100_SXM) > 5


def test_eager_bounds():
    ops = [Op("mm", "gemm", 2e12, 1e6, 1, 2), Op("add", "memory", 0.0, 1e3, 1, 3)]
    device = ops_seconds(ops, H100_SXM)
    assert eager_bounds(ops, H100_SXM, host=1e-3) == (max(device, 5e-3), device + 5e-3)
    low, high = eager_bounds(ops, H100_SXM, host=0.0)
    assert math.isclose(low, device) and math.isclose(high, device)


def test_bench_prints_and_passes(capsys):
    assert gpu_bench.main([]) == 0
    out = capsys.readouterr().out
    assert "9 of 10 within ±15%" in out and "the H100 card says 0.73" in out
