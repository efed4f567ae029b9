"""Chapter 05's TP timing (timing.py): one step cut out of a trace, the placements, and a real TP trace's
replayed communication equal to the α-β sum of its collectives on the link the placement puts them on, its
compute the counted operators priced on the H100 card, split into matmuls, memory-bound operators and floors."""
import math

import pytest

from minipar.check import compare, gpt_recipe, train_reference
from minipar.course.ch05_tensor_parallelism import timing
from minipar.machine.cluster import comm_seconds
from minipar.machine.device import H100_SXM, ops_seconds
from minipar.observe.opcount import kernel_count, ops_of
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace, Wait


def _recipe(steps=2):
    return gpt_recipe(steps=steps, batch_size=2, seq_len=8, n_layer=1, n_embd=16, n_head=4, vocab_size=16)


def test_one_step_keeps_the_events_between_the_last_two_marks():
    events = [Compute(9.0), Mark("step"), Compute(1.0), Comm("all_reduce", (0, 1), 8), Mark("step"),
              Compute(2.0), Comm("all_reduce", (0, 1), 16), Compute(3.0), Mark("step"), Comm("all_gather", (0, 1), 4)]
    step = timing.one_step(Trace([RankTrace(0, events), RankTrace(1, list(events))]))
    assert [e.seconds_cpu if isinstance(e, Compute) else e.bytes for e in step.ranks[0].events] == [2.0, 16, 3.0]
    with pytest.raises(ValueError, match="fewer than two"):
        timing.one_step(Trace([RankTrace(0, events[:3])]))
    with pytest.raises(ValueError, match="blocking"):
        timing.one_step(Trace([RankTrace(0, [Mark("step"), Comm("send", (0, 1), 4, True), Wait(1), Mark("step")])]))


def test_placements_put_the_ring_inside_one_node_or_across_two():
    for t in (2, 4, 8):
        inside, across = (timing.placements(t, 1e-3, 1e9)[k] for k in ("inside", "across"))
        assert len({r // inside.devices_per_node for r in range(t)}) == 1
        assert len({r // across.devices_per_node for r in range(t)}) == 2
    assert timing.placements(16, 1e-3, 1e9)["inside"] is None


def test_tp_runs_refuses_before_launch():
    with pytest.raises(ValueError, match="at least 2 steps"):
        timing.tp_runs(_recipe(steps=1), 2)
    with pytest.raises(ValueError):
        timing.tp_runs(_recipe(), 3)                         # 4 heads do not split 3 ways
    with pytest.raises(ValueError, match="counted_steps"):
        timing.tp_runs(_recipe(), 2, counted_steps=3)


def test_replayed_tp_comm_is_the_alpha_beta_sum_and_compute_the_counted_operators_on_the_card():
    recipe = _recipe(steps=3)
    measured, timed, counted, results, counted_results, counted_recipe = timing.tp_runs(recipe, 2)
    assert len(measured) == 2 and min(measured) > 0 and counted_recipe.steps == 2
    assert compare(train_reference(recipe), results).matches
    assert compare(train_reference(counted_recipe), counted_results).matches
    assert all(e.ops is None for e in timed.ranks[0].events if isinstance(e, Compute))     # the timed run: not counted
    assert any(e.ops for e in counted.ranks[0].events if isinstance(e, Compute))
    step = timing.one_step(counted)
    calls = [e for e in step.ranks[0].events if isinstance(e, Comm)]
    assert calls and {c.op for c in calls} <= {"all_reduce"}
    table = timing.tp_table(timing.one_step(timed), step, 2, alpha=1e-4, beta=1e9)
    for where in ("inside", "across"):
        cluster = timing.placements(2, 1e-4, 1e9)[where]
        expected = sum(comm_seconds(c.op, c.ranks, c.bytes, cluster) for c in calls)
        assert math.isclose(table[where]["comm"], expected, rel_tol=1e-9)
        rows = [r for e in step.ranks[0].events if isinstance(e, Compute) for r in e.ops]
        priced = ops_seconds(ops_of(rows), cluster.device)          # each operator on the card, with its floor
        terms = table[where]["terms"]
        assert math.isclose(table[where]["compute"], priced, rel_tol=1e-9)
        assert math.isclose(terms["gemm"] + terms["memory"] + terms["floor"], priced, rel_tol=1e-9)
        assert terms["kernels"] == kernel_count(rows) and terms["floor"] == kernels_floor(rows, cluster)
    assert table["across"]["comm"] > table["inside"]["comm"]
    with pytest.raises(ValueError, match="ops=True"):
        timing.compute_terms(timing.one_step(timed).ranks[0])


def kernels_floor(rows, cluster):
    return kernel_count(rows) * cluster.device.launch_floor


def test_compute_terms_split_a_hand_counted_segment():
    gemm = {"name": "aten.mm", "kind": "gemm", "count": 2, "flops": 2e12, "bytes": 8}
    add = {"name": "aten.add", "kind": "memory", "count": 3, "flops": 0, "bytes": 3.35e9}
    terms = timing.compute_terms(RankTrace(0, [Compute(1.0, ops=[gemm, add])]), H100_SXM)
    # 2 matmuls of 2 TFLOP: 2 · 2e12 / (989e12 · η_gemm); 3 adds of 3.35 GB: 3 · 3.35e9 / (3.35e12 · η_HBM)
    assert (H100_SXM.peak_flops, H100_SXM.hbm_bandwidth) == (989e12, 3.35e12)
    assert math.isclose(terms["gemm"], 2 * 2e12 / (989e12 * H100_SXM.gemm_efficiency))
    assert math.isclose(terms["memory"], 3 * 1e-3 / H100_SXM.memory_efficiency)
    assert terms["kernels"] == 5 and math.isclose(terms["floor"], 5 * 5e-6)
    assert math.isclose(terms["gemm_bytes"], 2 * 8 / (3.35e12 * H100_SXM.memory_efficiency))   # at HBM speed alone


def test_the_allreduce_fit_takes_the_rings_form_alpha_per_step():
    # the chapter's α is one ring step's, as in chapter 00 and the cluster model: t = 2(N-1)·α + 2(N-1)/N·S/β
    from minipar.course.ch05_tensor_parallelism.figures import fit_latency_bandwidth
    alpha, beta, n = 50e-6, 2e9, 4
    timings = {s: [2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta, 1.0] for s in (16, 1024, 65536, 4 << 20)}
    got_alpha, got_beta = fit_latency_bandwidth(timings, n)
    assert math.isclose(got_alpha, alpha, rel_tol=1e-6) and math.isclose(got_beta, beta, rel_tol=1e-6)


def test_section_9_prints_the_numbers_its_planner_priced():
    """Under §9's table: each card's peak and matmul efficiency, each link's α and β = bandwidth × ring share."""
    from minipar.course.ch05_tensor_parallelism.throughput import priced_with
    a100, h100 = priced_with()
    assert a100 == ("A100-SXM4-80GB: peak 312 TFLOP/s, matmul efficiency 83%; NVLink 3: α 5 µs, β 231 GB/s; "
                    "InfiniBand HDR: α 10 µs, β 22.5 GB/s")
    assert h100 == ("H100-SXM5-80GB: peak 989 TFLOP/s, matmul efficiency 73%; NVLink 4: α 3 µs, β 360 GB/s; "
                    "InfiniBand NDR: α 8 µs, β 45 GB/s")
