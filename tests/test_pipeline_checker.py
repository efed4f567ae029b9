"""The V schedules (ZB-V, DualPipeV, V-Min, V-Half) and the static checker: no processes."""
import dataclasses
import math

import pytest

from minipar.pipeline import Action, make_schedule, simulate
from minipar.pipeline.checker import ScheduleError, check
from minipar.pipeline.schedules import SCHEDULES, V_SCHEDULES
from minipar.pipeline.vhalf import repeat_block, v_half_block


def every_schedule(p):
    """Every schedule the library makes for p ranks and m = 1..4p (those that validate)."""
    for name in SCHEDULES:
        for v in ((2, 3) if name == "interleaved" else (2,) if name in V_SCHEDULES else (1,)):
            for m in range(1, 4 * p + 1):
                try:
                    yield make_schedule(name, p, m, v)
                except ValueError:
                    continue


@pytest.mark.parametrize("p", [2, 4, 8])
def test_every_schedule_passes_the_checker_and_the_simulator_agrees(p):
    names = set()
    for s in every_schedule(p):
        n = check(s)
        boundaries = sum(s.rank_of(b) != s.rank_of(b + 1) for b in range(s.num_stages - 1))
        assert n == 2 * s.m * boundaries, (s.name, p, s.m)   # each boundary: m activations, m gradients
        simulate(s)                                             # and it finishes on the clock
        names.add(s.name)
    assert names == set(SCHEDULES)


def test_v_placement_puts_the_loss_beside_the_input():
    s = make_schedule("zb-v", 4, 8, 2)
    assert [s.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [s.rank_of(x) for x in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert {a.stage for a in s.actions[0]} == {0, 7}
    # stages 3 and 4 meet on rank 3: 6 rank boundaries, not 7 (1F1B on 4 ranks has 3)
    assert check(s) == 2 * 8 * 6


def test_zb_v_and_dualpipe_v_pinned_on_two_ranks():
    z = make_schedule("zb-v", 2, 4, 2)
    assert " ".join(map(str, z.actions[1][:8])) == "F0@1 F0@2 F1@1 F1@2 B0@2 W0@2 F2@1 B0@1"
    d = make_schedule("dualpipev", 2, 4, 2)
    # steady phase: F&B pairs, each written as two actions, F of one micro-batch then BW of another
    assert " ".join(map(str, d.actions[0][7:11])) == "F3@0 BW1@3 F2@3 BW0@0"


@pytest.mark.parametrize("name,p,m,v,match", [
    ("zb-v", 4, 8, 1, "exactly 2 stages per rank"), ("dualpipev", 4, 8, 3, "v must be 2"),
    ("dualpipev", 4, 7, 2, "m >= 2p"), ("1f1b", 4, 8, 2, "v must be 1"),
    ("v-half", 4, 8, 1, "exactly 2 stages per rank"), ("v-half", 4, 0, 2, "positive integer")])
def test_v_constraints_are_refused_with_the_reason(name, p, m, v, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(name, p, m, v)


def _swap(s, rank, i, j):
    acts = list(s.actions[rank])
    acts[i], acts[j] = acts[j], acts[i]
    return dataclasses.replace(s, actions=[acts if r == rank else a for r, a in enumerate(s.actions)])


def test_a_hand_broken_schedule_is_caught_naming_the_rank_and_action():
    s = make_schedule("1f1b", 4, 8)
    # rank 1 does its first backward before the forward that the last rank needs for it: a cycle
    k = next(i for i, a in enumerate(s.actions[1]) if a.kind == "BW")
    broken = _swap(s, 1, 1, k)
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits forever .*|rank 1"):
        check(broken)
    with pytest.raises(ScheduleError, match="waits forever"):
        check(broken)


def test_missing_duplicated_and_misplaced_actions_are_caught():
    s = make_schedule("zb-h1", 2, 4)
    drop = dataclasses.replace(s, actions=[s.actions[0][:-1], s.actions[1]])
    with pytest.raises(ScheduleError, match="never runs W3@0"):
        check(drop)
    dup = dataclasses.replace(s, actions=[s.actions[0] + [Action("W", 0, 3)], s.actions[1]])
    with pytest.raises(ScheduleError, match="twice"):
        check(dup)
    away = dataclasses.replace(s, actions=[s.actions[0] + [Action("F", 1, 9)], s.actions[1]])
    with pytest.raises(ScheduleError, match="held by rank 1"):
        check(away)


def test_a_local_hand_over_out_of_order_is_a_deadlock_on_one_rank():
    s = make_schedule("zb-v", 2, 4, 2)
    # rank 1 holds stages 1 and 2: F0@2 before F0@1 waits for itself
    broken = _swap(s, 1, 0, 1)
    with pytest.raises(ScheduleError, match="rank 1 waits forever at action 0 \\(F0@2\\).*F0@1"):
        check(broken)


def test_fifo_order_holds_for_loop_placements_not_for_the_v():
    """Without tags (NCCL matches two ranks' messages in order), the V mixes activations and gradients on
    the same pair of ranks: the checker says where the order breaks. minipar's runtime tags its messages."""
    for name in ("gpipe", "1f1b", "zb-h1"):
        check(make_schedule(name, 4, 8), order="fifo")
    check(make_schedule("interleaved", 4, 8, 2), order="fifo")
    with pytest.raises(ScheduleError, match="waits forever"):
        check(make_schedule("zb-v", 4, 8, 2), order="fifo")


def test_the_error_carries_the_rank_index_and_action():
    s = make_schedule("zb-v", 4, 8, 2)
    acts = s.actions[3]
    k = acts.index(Action("F", 4, 0))
    moved = acts[:k] + acts[k + 1:]
    moved.insert(0, Action("F", 4, 0))          # the up-going forward before the down-going one it needs
    broken = dataclasses.replace(s, actions=s.actions[:3] + [moved])
    with pytest.raises(ScheduleError) as err:
        check(broken)
    assert (err.value.rank, err.value.index, err.value.action) == (3, 0, Action("F", 4, 0))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_v_half_block_lifespans_give_half_the_memory(p):
    """The block's lifespans (slots from F to the end of W) add up to 6p + O(1) on every rank, so the
    repeated block holds ⌈ℓ₀/6⌉ + ⌈ℓ₁/6⌉ ≈ p chunk activations (V-Min's block: ≈ 4p slots, 2p/3 chunks)."""
    blk = v_half_block(p)
    for r in range(p):
        life = [blk[("W", s)] + 1 - blk[("F", s)] for s in (r, 2 * p - 1 - r)]
        assert 6 * p <= sum(life) <= 6 * p + 14, (r, life)            # measured 6p+8 (p = 2, 4), 6p+14 (p = 8)
        assert sum(math.ceil(x / 6) for x in life) <= p + 3
    slots = {r: [t % 6 for (k, s), t in blk.items() if min(s, 2 * p - 1 - s) == r] for r in range(p)}
    assert all(sorted(v) == list(range(6)) for v in slots.values())   # repeats every 6 slots, no collision


@pytest.mark.parametrize("p", [2, 4, 8])
def test_v_half_bubble_about_half_of_1f1b_at_half_the_memory_for_every_m(p):
    """m = p..4p, T_F = T_B = T_W: bubble within 0.4-0.7·B, B = (p-1)/(m+p-1) the 1F1B bubble (measured
    0.45-0.65), peak ≤ p + 3 chunk activations (1F1B: p stages = 2p chunks). The reordered warm-up and
    cool-down are what buy the bubble: the block order alone leaves 0.70-0.73·B at p = 4, 8 (m = 4p; p = 2:
    0.53·B either way, nothing to reorder)."""
    for m in range(p, 4 * p + 1):
        b = (p - 1) / (m + p - 1)
        res = simulate(make_schedule("v-half", p, m, 2))
        assert 0.4 <= res.bubble_fraction / b <= 0.7, (m, res.bubble_fraction / b)
        assert max(res.peak_in_flight) <= p + 3, (m, res.peak_in_flight)
    alone = simulate(repeat_block(v_half_block(p), p, 4 * p)).bubble_fraction / b
    assert alone >= (0.52 if p == 2 else 0.7) and res.bubble_fraction / b <= alone - (0 if p == 2 else 0.15)


def test_v_half_block_gap_sets_the_lifespans():
    """The backward gap is the memory knob: gap 1 is V-Min's block (lifespans ≈ 4p + O(1): 22 at p = 4),
    gap 2 V-Half's (6p + 8 = 32), gap 3 longer still (38); a gap under one slot is refused."""
    sums = {g: {sum(v_half_block(4, g)[("W", s)] + 1 - v_half_block(4, g)[("F", s)] for s in (r, 7 - r))
                for r in range(4)} for g in (1, 2, 3)}
    assert sums == {1: {22}, 2: {32}, 3: {38}}
    with pytest.raises(ValueError, match="at least 1 slot"):
        v_half_block(4, 0)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2),
                                    ("dualpipev", 2), ("v-half", 2)])
def test_one_lowering_feeds_the_checker_the_trace_and_the_simulator(name, v):
    """The messages are derived once (minipar.pipeline.lowering): every send has its receive, each action is
    preceded by what it receives and followed by what it sends, and the checker, the schedule-made trace and
    the simulator count the same messages."""
    from minipar.pipeline.lowering import Recv, Send, lower
    from minipar.pipeline.schedule_trace import from_schedule
    from minipar.pipeline.simulate import Costs
    s = make_schedule(name, 4, 8, v)
    lowered = lower(s)
    sends = sorted(str(x.message) for steps in lowered for x in steps if isinstance(x, Send))
    recvs = sorted(str(x.message) for steps in lowered for x in steps if isinstance(x, Recv))
    assert sends == recvs and len(set(sends)) == len(sends)
    assert [[x for x in steps if isinstance(x, Action)] for steps in lowered] == s.actions
    comms = [e for r in from_schedule(s, Costs()).ranks for e in r.comms()]
    assert check(s) == len(sends) == simulate(s).p2p_messages == len(comms) // 2


def test_the_v_placement_is_the_one_every_consumer_reads():
    from minipar.models import MLP
    from minipar.pipeline.stages import assign, split_model
    s = make_schedule("zb-v", 4, 8, 2)
    cut = split_model(MLP([8] * 9), 8)
    assert [sorted(assign(cut, 4, r, s.placement)) for r in range(4)] == [s.stages_of(r) for r in range(4)] == \
        [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [s.rank_of(x) for x in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
