"""Chapter 08: the tour rows (3d, 3d+zero1: equal to one device, bytes = formula), the ZeRO-in-a-
pipeline numbers, and the exercise checks, each rejecting the stub and plausible wrong answers kept here."""

import pytest
import torch

from minipar.course.checks import ExerciseError
from minipar.course.ch08_hybrid_parallelism import checks as ch08
from minipar.course.ch08_hybrid_parallelism import measure, tour
from minipar.tensor.layers import shard_cols, shard_rows


@pytest.mark.parametrize("name", ["3d", "3d+zero1", "3d+zero3"])
def test_tour_rows(name):
    run = dict(tour.STRATEGIES)[name]
    row = run()
    assert row.strategy == name and row.world_size == 8
    assert row.matches and row.max_abs_diff < 1e-10
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula)          # model log = formula
    assert row.bytes_sent_per_rank <= row.bytes_observed_per_rank <= 1.5 * row.bytes_formula
    assert row.peak_bytes_per_rank > 0


def test_zero_in_a_pipeline_costs_m_times():
    z = measure.zero_in_pipeline(m=4, dp=2, pp=2, tp=1)             # 4 ranks: the chapter runs 2×2×2
    rs = {k: v["by_op"]["reduce_scatter"] for k, v in z.items()}
    assert rs[1][0] == 1 and rs[2][0] == 4 and rs[3][0] == 4           # calls per step: 1 vs m
    assert rs[2][1] == 4 * rs[1][1]                                    # bytes: m × ZeRO-1's
    assert z[2]["by_op"]["all_gather"] == z[1]["by_op"]["all_gather"]   # ZeRO-2 also gathers after the step
    assert 2 * z[2]["bytes"] == 5 * z[1]["bytes"]                      # (m + 1)/2 × ZeRO-1's bytes in all
    assert z[3]["by_op"]["all_gather"][0] == 8                         # ZeRO-3: a gather before every F and BW


# ----------------------------------------------------------------------------------------------------
# exercise 1: the groups of a mesh
# ----------------------------------------------------------------------------------------------------

def groups_solution(world_size, dp, pp, tp):
    grid = torch.arange(world_size).view(dp, pp, tp)
    return {"dp": grid.permute(1, 2, 0).reshape(-1, dp).tolist(),
            "pp": grid.permute(0, 2, 1).reshape(-1, pp).tolist(),
            "tp": grid.reshape(-1, tp).tolist()}


def groups_dp_innermost(world_size, dp, pp, tp):         # arange(world).view(tp, pp, dp): DP neighbours
    grid = torch.arange(world_size).view(tp, pp, dp)
    return {"tp": grid.permute(1, 2, 0).reshape(-1, tp).tolist(),
            "pp": grid.permute(0, 2, 1).reshape(-1, pp).tolist(),
            "dp": grid.reshape(-1, dp).tolist()}


def groups_consecutive(world_size, dp, pp, tp):          # every dimension as blocks of consecutive ranks
    r = list(range(world_size))
    return {d: [r[i:i + n] for i in range(0, world_size, n)] for d, n in (("dp", dp), ("pp", pp), ("tp", tp))}


def groups_stub(world_size, dp, pp, tp):
    raise NotImplementedError()


def test_mesh_groups():
    ch08.check_mesh_groups(groups_solution)
    with pytest.raises(NotImplementedError):
        ch08.check_mesh_groups(groups_stub)
    for wrong in (groups_dp_innermost, groups_consecutive):
        with pytest.raises(ExerciseError):
            ch08.check_mesh_groups(wrong)


# ----------------------------------------------------------------------------------------------------
# exercise 2: memory per rank
# ----------------------------------------------------------------------------------------------------

def memory_solution(psi, *, dp, pp, tp, zero):
    return psi / (pp * tp) * (2 + 2 + 12 / (dp if zero else 1))


@pytest.mark.parametrize("wrong, words", [
    (lambda psi, *, dp, pp, tp, zero: psi / (pp * tp * dp) * 16, "replicates"),
    (lambda psi, *, dp, pp, tp, zero: psi / (pp * tp) * (2 + (14 / dp if zero else 14)), "ZeRO-2"),
    (lambda psi, *, dp, pp, tp, zero: psi / pp * (4 + 12 / (dp if zero else 1)), "divide by tp"),
    (lambda psi, *, dp, pp, tp, zero: psi / (pp * tp) * 16, "ZeRO-1"),
])
def test_memory_per_rank(wrong, words):
    ch08.check_memory_per_rank(memory_solution)
    with pytest.raises(ExerciseError, match=words):
        ch08.check_memory_per_rank(wrong)


def test_memory_stub():
    def stub(psi, *, dp, pp, tp, zero):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError):
        ch08.check_memory_per_rank(stub)


# ----------------------------------------------------------------------------------------------------
# exercise 3: reshard one parameter
# ----------------------------------------------------------------------------------------------------

def reshard_solution(shards, kind, parts, t_new):
    if kind == "cols":
        full = torch.cat(shards, dim=1)
        return [shard_cols(full, r, t_new) for r in range(t_new)]
    full = torch.cat([torch.cat([s.chunk(parts)[i] for s in shards]) for i in range(parts)])
    return [shard_rows(full, r, t_new, parts) for r in range(t_new)]


def reshard_naive(shards, kind, parts, t_new):           # ignores the Q, K, V blocks of a fused shard
    full = torch.cat(shards, dim=0 if kind == "rows" else 1)
    return list(full.chunk(t_new, dim=0 if kind == "rows" else 1))


def reshard_always_rows(shards, kind, parts, t_new):     # treats a row-parallel weight like a column one
    return reshard_solution(shards, "rows", parts, t_new)


def test_reshard():
    ch08.check_reshard(reshard_solution)
    with pytest.raises(ExerciseError, match="fused QKV"):
        ch08.check_reshard(reshard_naive)
    with pytest.raises(ExerciseError):
        ch08.check_reshard(reshard_always_rows)

    def stub(shards, kind, parts, t_new):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError):
        ch08.check_reshard(stub)


# ----------------------------------------------------------------------------------------------------
# the chapter's recorded runs (§6's PyTorch side, §9's two 16-rank launches): readable, and still true
# ----------------------------------------------------------------------------------------------------

def test_recorded_torch_side_holds_and_names_its_torch():
    from minipar.course.ch08_hybrid_parallelism import recorded
    r = recorded.report()
    r.check()
    assert r.text.startswith("Recorded on ") and r.record["recorded"]["command"] == recorded.COMMAND
    assert r.record["recorded"]["torch"].split("+")[0] == torch.__version__.split("+")[0], "re-record: torch changed"


def test_the_bubble_is_a_table_of_three_numbers_and_a_sentence_on_the_side_they_fall():
    from minipar.course.ch08_hybrid_parallelism.report import bubble_table, measured_against_model
    text = bubble_table(formula=0.20, unequal=0.23, measured=0.18, per_stage=[0.003, 0.004], step=1)
    lines = text.splitlines()
    assert "stage 0 3.0 ms, stage 1 4.0 ms" in lines[0] and "step 2" in lines[0]      # computed, not a fixed story
    assert [line.split()[-1] for line in lines[2:]] == ["0.20", "0.23", "0.18"]
    assert "below the model's (0.23)" in measured_against_model(0.23, 0.18)           # the side the numbers put it on
    assert "above the model's (0.20)" in measured_against_model(0.20, 0.24)
    assert "agree here (0.20)" in measured_against_model(0.201, 0.199)                 # equal as printed
