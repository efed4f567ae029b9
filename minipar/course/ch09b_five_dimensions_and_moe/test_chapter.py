"""Chapter 09b: the tour row (5d: equal to one device, bytes = formula in every dimension), the OneFlow layout's
numbers, the recorded 16-rank launches, and the exercise check, rejecting the stub and plausible wrong answers
kept here."""
import re

import pytest
import torch

from minipar.course.checks import ExerciseError
from minipar.course.tour import observed_status
from minipar.course.ch09b_five_dimensions_and_moe import at_scale, tour
from minipar.course.ch09b_five_dimensions_and_moe import checks as ch09b


def test_5d_tour_row():
    """16 ranks, dp 2 × pp 2 × cp 2 × tp 2: equal to one device; model bytes = formula in every dimension (the
    note lists each, formula beside); observed within gloo's per-call allowance. The same launch also carries
    what tests/test_parallel5d_16.py asserted on its own launch of this layout (ring-zigzag, 1F1B): on every
    rank the bytes of each kind equal ``bytes_formula`` and the rank reports its memory (peak > model states)."""
    from minipar.course.hybrid_runs import BATCH, SEQ, measure_layout, recipe
    from minipar.hybrid.parallel3d import bytes_formula
    from minipar.layout import Layout
    assert dict(tour.STRATEGIES)["5d"] is tour._run_5d
    # 2 Adam steps, not the tour's 3: the moments are read from step 2 (the bytes, calls and observed are per step)
    r = measure_layout(tour.LAYOUT_16, steps=2)
    row = tour.row_5d(r)
    assert row.strategy == "5d" and row.world_size == 16 and row.matches and row.max_abs_diff < 1e-10
    layout, cfg = Layout(**tour.LAYOUT_16, micro_batches=4), recipe().model().cfg
    assert len(r["runs"]) == layout.world_size == 16
    for x in r["runs"]:               # bytes per kind: the communication log equals the formula on every rank
        want = bytes_formula(cfg, batch=BATCH, seq=SEQ, layout=layout, pp_rank=x.coords["pp"])
        assert set(want) == {"dp", "pp", "tp", "cp"} and all(want[k] > 0 for k in want)
        assert set(x.bytes_by_kind) == set(want) and x.bytes_by_kind == pytest.approx(want)
        assert x.peak_bytes > x.model_state_bytes > 0           # memory per rank: reported, and states are in it
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula)
    for dim in ("dp×cp", "pp", "cp", "tp"):
        model, formula = re.search(rf"[:,] {dim} ([\d.]+) KiB \(([\d.]+) KiB\)", row.note).groups()
        assert model == formula and float(model) > 0, dim
    assert "tp " in row.note.split("observed")[1] and "asynchronous" in row.note
    assert row.bytes_sent_per_rank <= row.bytes_observed_per_rank and observed_status(row) == "within"
    assert row.peak_bytes_per_rank > 0


def test_seed_001_layout_numbers():
    g = at_scale.seed_layout("GPT-3 175B", m=256)
    assert g["gpus"] == 3072 and g["layers_per_stage"] == (1.5, 2)          # GPT-3 does not cut evenly
    assert g["bubble"] == pytest.approx(63 / (256 + 63))
    t = at_scale.seed_layout("1T")
    assert t["layers_per_stage"] == (2, 2) and t["micro_batch"] == 1 and t["m"] == 512   # the 1T row does
    assert t["bubble"] == pytest.approx(63 / (512 + 63))
    # 2 layers × 12h² / 8 × 16 B: 2 · 12 · 25600² / 8 · 16 = 31.5 GB of model states per GPU
    assert t["model_states_per_gpu"] == 2 * 12 * 25600 ** 2 / 8 * 16


# ----------------------------------------------------------------------------------------------------
# exercise 4: the gradient-reduction groups of a 5D layout (ep folded over each stage's dp × cp × tp)
# ----------------------------------------------------------------------------------------------------

def reduction_solution(world_size, dp, pp, cp, tp, ep):
    grid = torch.arange(world_size).view(dp, pp, cp, tp)
    dense = grid.permute(1, 3, 0, 2).reshape(-1, dp * cp).tolist()     # (pp, tp) fixed; dp, cp vary (cp fastest)
    stage = grid.permute(1, 0, 2, 3).reshape(pp, -1).tolist()         # pp fixed; dp, cp, tp vary (tp fastest)
    return {"dense": dense,
            "ep": [g[i:i + ep] for g in stage for i in range(0, len(g), ep)],
            "expert_dp": [g[j::ep] for g in stage for j in range(ep)]}


def reduction_ep_inside_dense(world_size, dp, pp, cp, tp, ep):   # the old placement: ep only inside dp × cp
    out = reduction_solution(world_size, dp, pp, cp, tp, ep)
    dense = out["dense"]
    out["ep"] = [g[i:i + ep] for g in dense for i in range(0, len(g), ep)]
    out["expert_dp"] = [g[j::ep] for g in dense for j in range(ep)]
    return out


def reduction_dp_only(world_size, dp, pp, cp, tp, ep):      # gradients over dp alone: cp ranks keep their own
    out = reduction_solution(world_size, dp, pp, cp, tp, ep)
    grid = torch.arange(world_size).view(dp, pp, cp, tp)
    out["dense"] = grid.permute(1, 2, 3, 0).reshape(-1, dp).tolist()
    return out


def reduction_ep_across_pp(world_size, dp, pp, cp, tp, ep):  # ep chunks cut from dp × pp × cp: across stages
    out = reduction_solution(world_size, dp, pp, cp, tp, ep)
    wide = torch.arange(world_size).view(dp, pp, cp, tp).permute(3, 0, 2, 1).reshape(tp, -1).tolist()  # pp fastest
    out["ep"] = [g[i:i + ep] for g in wide for i in range(0, len(g), ep)]
    out["expert_dp"] = [g[j::ep] for g in wide for j in range(ep)][:len(out["expert_dp"])]
    return out


def reduction_swapped(world_size, dp, pp, cp, tp, ep):       # ep strided, expert-DP consecutive
    out = reduction_solution(world_size, dp, pp, cp, tp, ep)
    out["ep"], out["expert_dp"] = out["expert_dp"], out["ep"]
    return out


def test_reduction_solution_is_the_five_d_rule():
    from minipar.course.ch09b_five_dimensions_and_moe.five_d import reduction_groups
    for world, dp, pp, cp, tp, ep in ch09b.SHAPES_5D:
        assert reduction_solution(world, dp, pp, cp, tp, ep) == reduction_groups(world, dp=dp, pp=pp, cp=cp, tp=tp,
                                                                                 ep=ep)
    g = reduction_groups(16, dp=2, pp=2, cp=2, tp=2, ep=2)                 # the chapter's 16-rank layout
    assert g["dense"][0] == [0, 2, 8, 10] and g["ep"][:2] == [[0, 1], [2, 3]] and g["expert_dp"][:2] == [[0, 2, 8, 10], [1, 3, 9, 11]]
    with pytest.raises(ValueError, match="must divide"):
        reduction_groups(16, dp=2, pp=2, cp=2, tp=2, ep=3)


@pytest.mark.parametrize("wrong, words", [
    (reduction_dp_only, "dp × cp"),
    (reduction_ep_across_pp, "more than one pipeline stage"),
    (reduction_swapped, "consecutive chunks"),
    (reduction_ep_inside_dense, "the old placement"),
])
def test_reduction_groups(wrong, words):
    ch09b.check_reduction_groups(reduction_solution)
    with pytest.raises(ExerciseError, match=words):
        ch09b.check_reduction_groups(wrong)


def test_reduction_groups_stub():
    def stub(world_size, dp, pp, cp, tp, ep):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError):
        ch09b.check_reduction_groups(stub)


@pytest.mark.parametrize("world, dp, pp, cp, tp, ep", ch09b.SHAPES_5D)
def test_the_chunk_rule_is_megatrons_expert_generator(world, dp, pp, cp, tp, ep):
    """On Megatron's order, chunks of ep consecutive ranks of each stage's dp × cp × tp ranks are its expert
    generator's ep groups with expert-TP = 1 (MoE parallel folding) and the strided sets its expert-DP groups
    (that generator equals Megatron's: test_mesh_megatron)."""
    from minipar.mesh import Mesh, megatron_order
    stages = Mesh(world, megatron_order(), dp=dp, pp=pp, cp=cp, tp=tp).groups("dp", "cp", "tp")
    experts = Mesh(world, megatron_order(), dp=dp * cp * tp // ep, pp=pp, ep=ep, tp=1)
    assert sorted(g[i:i + ep] for g in stages for i in range(0, len(g), ep)) == sorted(experts.groups("ep"))
    assert sorted(g[j::ep] for g in stages for j in range(ep)) == sorted(experts.groups("dp"))


def test_ops_by_dims_reads_one_step_between_marks():
    from minipar.course.ch09b_five_dimensions_and_moe.five_d import ops_by_dims, step_events
    from minipar.mesh import Mesh
    from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace
    mesh = Mesh(4, dp=2, tp=2)

    def rank(r):
        tp_peer, dp_peer = mesh.group_ranks("tp", r), mesh.group_ranks("dp", r)
        step = [Compute(0.1), Comm("all_reduce", tp_peer, 64), Comm("all_reduce", dp_peer, 400)]
        return RankTrace(r, [Comm("broadcast", range(4), 8), *step, Mark("step"), *step,
                             Comm("send", dp_peer, 32), Comm("recv", dp_peer, 32), Mark("step"), *step, Mark("step")])
    trace = Trace([rank(r) for r in range(4)])
    assert len(step_events(trace.ranks[0], 1)) == 5
    assert ops_by_dims(trace, mesh, step=1) == {("all_reduce", ("dp",)): (1, 400), ("all_reduce", ("tp",)): (1, 64),
                                                ("send", ("dp",)): (1, 32)}
    assert ops_by_dims(trace, mesh, step=2) == {("all_reduce", ("dp",)): (1, 400), ("all_reduce", ("tp",)): (1, 64)}


@pytest.mark.parametrize("fields", [dict(dp=2, cp=2, pp=2, ep=2), dict(dp=2, cp=2, pp=2, ep=4)])
def test_run_5d_moe_reports_the_trainers_groups_and_equals_one_device(fields):
    """§2.6 on 8 ranks (the chapter runs 16): every rank's trainer groups are five_d.reduction_groups' (ep = 4:
    expert-DP of one rank), its experts the ep-rank's slice, its states 4× its parameters (Adam), the run equal
    to one device in float64, and the expert-DP bytes = 2(n−1)/n × the experts' parameter bytes."""
    from minipar.check import compare, train_reference
    from minipar.course.ch09b_five_dimensions_and_moe.five_d import moe_recipe, reduction_groups, run_5d_moe
    from minipar.layout import Layout
    layout = Layout(**fields, micro_batches=4)
    recipe = moe_recipe(layout, steps=2)      # 2 Adam steps: the moments are read from step 2; a third shows no more
    out = run_5d_moe(recipe, layout, track_memory=False)     # no peak asserted here: the states need no tracking
    want = reduction_groups(8, dp=2, pp=2, cp=2, tp=1, ep=layout.ep)
    per_rank = 4 // layout.ep
    for rank, o in enumerate(out):
        for kind in ("dense", "ep", "expert_dp"):
            members, total = o["groups"][kind]
            assert rank in members and members in want[kind] and total == sum(members), (rank, kind)
        j = o["groups"]["ep"][0].index(rank)
        assert o["experts_held"] == list(range(j * per_rank, (j + 1) * per_rank))
        states, params = o["run"].model_state_bytes, o["param_bytes"]
        assert 0 <= states - 4 * params["all"] < 1e-3 * states and 0 < params["experts"] < params["all"]
        n_e = 4 // layout.ep
        assert o["run"].bytes_by_kind["edp"] == pytest.approx(2 * (n_e - 1) / n_e * params["experts"])
    compare(train_reference(recipe), [o["run"] for o in out], dtype=torch.float64).assert_ok()


def test_recorded_five_d_feeds_every_table():
    from minipar.course.ch09b_five_dimensions_and_moe import five_d, report_5d
    from minipar.mesh import Mesh
    five = five_d.load_chapter()
    assert five["recorded"]["torch"].split("+")[0] == torch.__version__.split("+")[0], "re-record: torch changed"
    assert five["comparison64"].matches and five["moe_comparison"].matches
    mesh16 = Mesh(16, **five_d.LAYOUT_5D.sizes)
    g16 = five_d.reduction_groups(16, dp=2, pp=2, cp=2, tp=2, ep=2)
    for table in (report_5d.groups_asked(five, mesh16, g16["dense"]), report_5d.ops_table(five, mesh16),
                  report_5d.node_crossing(five["runs64"], five_d.LAYOUT_5D), report_5d.loss_across_layouts(five),
                  report_5d.moe_groups(five, mesh16, g16, five_d.MOE_LAYOUT_5D),
                  report_5d.moe_bytes(five, five_d.MOE_LAYOUT_5D), report_5d.moe_memory(five)):
        table.check()
    with pytest.raises(AssertionError):                   # the checks can fail: a group that is not the mesh's
        five["groups"][0]["tp"] = [[0, 2], 2]
        report_5d.groups_asked(five, mesh16, g16["dense"]).check()
