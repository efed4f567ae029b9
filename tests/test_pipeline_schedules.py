"""Pipeline schedules as data, and the simulator's clock: no processes, exact arithmetic."""
import pytest

from minipar.pipeline import Action, Costs, ScheduleDeadlock, Schedule, bubble_formula, make_schedule, simulate
from minipar.pipeline.simulate import in_flight_over_time


def names(actions):
    return " ".join(f"{a.kind}{a.microbatch}" for a in actions)


# -- pinned action lists -------------------------------------------------------------------------------

def test_gpipe_is_all_forwards_then_all_backwards():
    s = make_schedule("gpipe", 2, 3)
    assert [names(a) for a in s.actions] == ["F0 F1 F2 BW2 BW1 BW0"] * 2
    assert all(a.stage == r for r, acts in enumerate(s.actions) for a in acts)


def test_1f1b_has_warmup_steady_cooldown():
    s = make_schedule("1f1b", 4, 6)
    assert names(s.actions[0]) == "F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 BW3 BW4 BW5"
    assert names(s.actions[2]) == "F0 F1 BW0 F2 BW1 F3 BW2 F4 BW3 F5 BW4 BW5"
    assert names(s.actions[3]) == "F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4 F5 BW5"


def test_interleaved_places_stages_round_robin_and_groups_microbatches_by_p():
    s = make_schedule("interleaved", 2, 4, 2)
    # rank 0 holds stages 0 and 2; warm-up (v-1)·p + 2(p-r-1) = 4 forwards: m0,m1 on chunk 0, then chunk 1
    assert [str(a) for a in s.actions[0][:5]] == ["F0@0", "F1@0", "F0@2", "F1@2", "F2@0"]
    assert [str(a) for a in s.actions[0][5:8]] == ["BW0@2", "F3@0", "BW1@2"]
    assert {a.stage for a in s.actions[1]} == {1, 3}
    assert s.rank_of(2) == 0 and s.chunk_of(2) == 1 and s.stages_of(1) == [1, 3]


def test_seed_layout_16_layers_4_ranks_v2():
    from minipar.models import MLP
    from minipar.pipeline.stages import assign, split_model
    stages = split_model(MLP([8] * 17), 4 * 2)
    rank0 = assign(stages, 4, 0)
    assert sorted(n for s in rank0.values() for n in s.reference_params() if n.endswith("weight")) == \
        ["layers.0.weight", "layers.1.weight", "layers.8.weight", "layers.9.weight"]


def test_zb_h1_splits_backward_and_defers_r_weight_gradients():
    s = make_schedule("zb-h1", 4, 6)
    assert names(s.actions[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"
    assert names(s.actions[0]) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    for acts in s.actions:   # every micro-batch gets exactly one F, one B, one W on each rank
        assert sorted(names([a for a in acts if a.kind == k]) for k in "FBW") == sorted(
            " ".join(f"{k}{i}" for i in range(6)) for k in "FBW")


def test_naive_is_one_microbatch():
    s = make_schedule("naive", 3, 1)
    assert [names(a) for a in s.actions] == ["F0 BW0"] * 3


# -- the formulas, from the clock --------------------------------------------------------------------

@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("gpipe", 2, 1, 1), ("1f1b", 4, 8, 1),
                                        ("1f1b", 3, 7, 1), ("naive", 4, 1, 1), ("interleaved", 4, 8, 2),
                                        ("interleaved", 4, 4, 2), ("interleaved", 2, 6, 3),
                                        ("zb-h1", 4, 8, 1), ("zb-h1", 3, 5, 1), ("zb-h1", 2, 2, 1)])
def test_simulated_bubble_equals_formula(name, p, m, v):
    sim = simulate(make_schedule(name, p, m, v))
    assert sim.bubble_fraction == pytest.approx(bubble_formula(name, p, m, v), abs=1e-12)


def test_bubble_formulas_by_hand():
    assert bubble_formula("gpipe", 4, 8) == 3 / 11 == bubble_formula("1f1b", 4, 8)
    assert bubble_formula("interleaved", 4, 8, 2) == 3 / 19       # bubble time (p-1) divided by v
    assert bubble_formula("zb-h1", 4, 8) == 3 / 27                 # (p-1)(F+B-W) with F=B=W=1
    assert bubble_formula("naive", 4, 1) == 3 / 4


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("gpipe", 2, 3, 1), ("gpipe", 8, 16, 1),
                                        ("1f1b", 4, 8, 1), ("1f1b", 3, 7, 1), ("1f1b", 8, 16, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 4, 8, 4),
                                        ("interleaved", 2, 6, 3), ("interleaved", 8, 16, 2)])
def test_both_bubble_conventions_from_the_clock(name, p, m, v):
    """idle / total (GPipe's paper, this course) and idle / ideal (Megatron-LM, the Playbook, seed 000)."""
    sim = simulate(make_schedule(name, p, m, v))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m), abs=1e-12)
    assert sim.bubble_ratio == pytest.approx(sim.bubble_fraction / (1 - sim.bubble_fraction), abs=1e-12)
    assert bubble_formula(name, p, m, v, over="ideal") == pytest.approx(sim.bubble_ratio, abs=1e-12)


def test_interleaving_divides_megatrons_ratio_by_exactly_v_but_not_the_fraction():
    for p, m in ((4, 8), (2, 6), (8, 16)):
        one = simulate(make_schedule("1f1b", p, m))
        for v in (2, 3, 4):
            if m % p:
                continue
            inter = simulate(make_schedule("interleaved", p, m, v))
            assert inter.bubble_ratio == pytest.approx(one.bubble_ratio / v, abs=1e-12)
            assert inter.bubble_fraction > one.bubble_fraction / v             # the fraction shrinks less
    assert bubble_formula("gpipe", 4, 8, over="ideal") == 3 / 8
    assert bubble_formula("interleaved", 4, 8, 2, over="ideal") == 3 / 16
    assert bubble_formula("zb-h1", 4, 8, over="ideal") == 3 / 24 == \
        pytest.approx(simulate(make_schedule("zb-h1", 4, 8)).bubble_ratio, abs=1e-12)
    with pytest.raises(ValueError, match="over must be"):
        bubble_formula("gpipe", 4, 8, over="makespan")


def test_interleaving_divides_the_bubble_time_by_v():
    one = simulate(make_schedule("1f1b", 4, 8))
    two = simulate(make_schedule("interleaved", 4, 8, 2))
    ideal = 8 * 3                                                  # m · (F + BW), per rank
    assert two.makespan - ideal == pytest.approx((one.makespan - ideal) / 2)


def test_zero_bubble_cuts_the_bubble_for_any_cost():
    costs = Costs(F=1.0, B=2.0, W=1.0, p2p=0.0)
    one, zb = simulate(make_schedule("1f1b", 4, 8), costs), simulate(make_schedule("zb-h1", 4, 8), costs)
    work = 8 * 4.0
    assert one.makespan - work == pytest.approx(3 * (1 + 2 + 1))   # (p-1)(F+B+W)
    assert zb.makespan - work == pytest.approx(3 * (1 + 2 - 1))    # (p-1)(F+B-W)


def test_p2p_cost_lengthens_the_critical_path():
    free, paid = simulate(make_schedule("gpipe", 4, 4)), simulate(make_schedule("gpipe", 4, 4), Costs(p2p=0.5))
    # forward and backward each cross p-1 links on the critical path
    assert paid.makespan - free.makespan == pytest.approx(2 * 3 * 0.5)
    assert len(paid.transfers) == 2 * 3 * 4                       # (p-1) links, both ways, m micro-batches


# -- activation memory: in-flight micro-batches -----------------------------------------------------------

def test_in_flight_gpipe_holds_m_1f1b_holds_p_minus_r():
    assert simulate(make_schedule("gpipe", 4, 8)).peak_in_flight == [8, 8, 8, 8]
    assert simulate(make_schedule("1f1b", 4, 8)).peak_in_flight == [4, 3, 2, 1]
    assert simulate(make_schedule("zb-h1", 4, 8)).peak_in_flight == [4, 4, 4, 4]   # 1F1B's peak, rank 0


def test_in_flight_over_time_returns_to_zero():
    sim = simulate(make_schedule("1f1b", 3, 5))
    for tl in sim.timelines:
        assert in_flight_over_time(tl)[-1][1] == 0


# -- errors -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,match", [
    (("1f1b", 4, 3), r"minipar's 1f1b requires .*\(m >= p\)"),     # minipar's rule, not 1F1B's: Megatron runs m < p
    (("zb-h1", 4, 2), "m >= p"),
    (("interleaved", 4, 6, 2), "multiple of p"),
    (("naive", 4, 2), "m must be 1"),
    (("gpipe", 4, 8, 2), "v must be 1"),
    (("gpipe", 0, 8), "positive integer"),
    (("pipedream", 4, 8), "unknown schedule"),
])
def test_invalid_configurations_raise(args, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(*args)


def test_layers_not_divisible_by_p_times_v():
    with pytest.raises(ValueError, match="divisible by p·v"):
        make_schedule("interleaved", 4, 8, 2, n_layers=12)
    from minipar.check import gpt_recipe
    from minipar.pipeline.stages import split_model
    with pytest.raises(ValueError, match="divisible by p·v"):
        split_model(gpt_recipe(n_layer=3).model(), 2)


def test_a_wrong_order_deadlocks_in_the_simulator():
    # rank 1 wants the backward of micro-batch 1 before it has run its forward: nobody can move
    bad = Schedule("bad", 2, 2, 1, [
        [Action("F", 0, 0), Action("F", 0, 1), Action("BW", 0, 1), Action("BW", 0, 0)],
        [Action("F", 1, 0), Action("BW", 1, 1), Action("F", 1, 1), Action("BW", 1, 0)]])
    with pytest.raises(ScheduleDeadlock, match="rank 1 waits"):
        simulate(bad)


def test_runtime_configuration_is_checked_before_launch():
    from minipar.check import mlp_recipe
    from minipar.pipeline.runtime import validate
    recipe = mlp_recipe(batch_size=12, sizes=[8] * 9)            # 8 layers
    validate(recipe, world_size=4, schedule="interleaved", m=4, v=2)
    with pytest.raises(ValueError, match="equal micro-batches"):
        validate(recipe, world_size=2, schedule="gpipe", m=5)
    with pytest.raises(ValueError, match="divisible by p·v"):
        validate(recipe, world_size=4, schedule="interleaved", m=4, v=4)
