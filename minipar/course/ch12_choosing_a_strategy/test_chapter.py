"""Chapter 12: the exercise checks, each against the stub and plausible wrong answers kept here. (The cost model
against this course's own runs is appendix A's: minipar/course/chA_how_minipar_measures/test_chapter.py.)
"""
import pytest

from minipar.course.checks import ExerciseError
from minipar.course.ch12_choosing_a_strategy import checks
from minipar.plan import (Layout, activation_bytes_per_layer, estimate, in_flight, layer_parameters,
                          model_state_bytes_formula, plan)




# ---- exercise 1: memory per device --------------------------------------------------------------------

def memory_right(model, layout):
    layers = model.layers // layout.pp
    states = model_state_bytes_formula(layers * layer_parameters(model, layout.tp), layout.dp, layout.zero)["total"]
    flying = in_flight(layout.schedule, layout.pp, layout.micro_batches, layout.v) if layout.pp > 1 else 1
    per = activation_bytes_per_layer(model, layout.micro_batch, layout.tp, layout.sp, layout.recompute)
    return {"model_states": states, "activations": layers * flying * per}


def memory_stub(model, layout):
    raise NotImplementedError


def memory_no_tp_split(model, layout):
    out = memory_right(model, layout)
    layers = model.layers // layout.pp
    out["model_states"] = model_state_bytes_formula(layers * layer_parameters(model, 1), layout.dp, layout.zero)["total"]
    return out


def memory_gpipe_in_flight(model, layout):
    out = memory_right(model, layout)
    if layout.pp > 1:
        per = activation_bytes_per_layer(model, layout.micro_batch, layout.tp, layout.sp, layout.recompute)
        out["activations"] = model.layers // layout.pp * layout.micro_batches * per
    return out


def memory_ignores_sp(model, layout):
    out = memory_right(model, layout)
    per = activation_bytes_per_layer(model, layout.micro_batch, layout.tp, False, layout.recompute)
    flying = in_flight(layout.schedule, layout.pp, layout.micro_batches, layout.v) if layout.pp > 1 else 1
    out["activations"] = model.layers // layout.pp * flying * per
    return out


def memory_ignores_zero(model, layout):
    out = memory_right(model, layout)
    out["model_states"] = model_state_bytes_formula(model.layers // layout.pp * layer_parameters(model, layout.tp), 1, 0)["total"]
    return out


def memory_in_gb(model, layout):
    return {k: v / 1e9 for k, v in memory_right(model, layout).items()}


def test_memory_check_accepts_the_solution(capsys):
    checks.check_memory_per_device(memory_right)
    assert "right for all" in capsys.readouterr().out


def test_memory_check_rejects_the_stub():
    with pytest.raises(NotImplementedError):
        checks.check_memory_per_device(memory_stub)


@pytest.mark.parametrize("wrong, says", [(memory_no_tp_split, "not divided by tp"),
                                         (memory_gpipe_in_flight, "that is GPipe"),
                                         (memory_ignores_sp, "SP ignored"), (memory_ignores_zero, "ZeRO ignored"),
                                         (memory_in_gb, "compare each term")])
def test_memory_check_rejects_wrong_answers(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        checks.check_memory_per_device(wrong)


# ---- exercise 2: pick a layout --------------------------------------------------------------------------

def _justified(layout):
    e = estimate(checks.PICK_MODEL, checks.PICK_CLUSTER, layout)
    return layout, {"memory_gb": e.memory["total"] / 1e9, "step_s": e.step_seconds}


def pick_right(model, cluster, global_batch):
    # TP 2 inside a node, PP 4 to share the layers, ZeRO-1 for the optimizer states, DP 4 for the rest
    return _justified(Layout(dp=4, tp=2, pp=4, zero=1, micro_batch=1, micro_batches=global_batch // 4))


def pick_stub(model, cluster, global_batch):
    raise NotImplementedError


def pick_ddp(model, cluster, global_batch):
    return _justified(Layout(dp=32, micro_batch=1, micro_batches=8))


def pick_tp_across_nodes(model, cluster, global_batch):
    return _justified(Layout(dp=2, tp=16, micro_batch=1, micro_batches=128))


def pick_pp_zero3(model, cluster, global_batch):
    return _justified(Layout(dp=4, tp=2, pp=4, zero=3, micro_batch=1, micro_batches=64))


def pick_wrong_batch(model, cluster, global_batch):
    return _justified(Layout(dp=4, tp=2, pp=4, zero=1, micro_batch=1, micro_batches=32))


def pick_slow(model, cluster, global_batch):
    return _justified(Layout(dp=32, zero=3, recompute="full", micro_batch=8, micro_batches=1))


def pick_unjustified(model, cluster, global_batch):
    layout, _ = pick_right(model, cluster, global_batch)
    return layout, {"memory_gb": 80.0, "step_s": 1.0}


def test_pick_check_accepts_the_solution(capsys):
    checks.check_pick_layout(pick_right)
    assert "fits" in capsys.readouterr().out


def test_pick_check_rejects_the_stub():
    with pytest.raises(NotImplementedError):
        checks.check_pick_layout(pick_stub)


@pytest.mark.parametrize("wrong, says", [(pick_ddp, "memory per device"), (pick_tp_across_nodes, "across nodes"),
                                         (pick_pp_zero3, "ZeRO-2/3"), (pick_wrong_batch, "global batch"),
                                         (pick_slow, "within 10 %"), (pick_unjustified, "justification")])
def test_pick_check_rejects_wrong_answers(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        checks.check_pick_layout(wrong)


def test_the_solution_is_near_the_planner():
    planned = plan(checks.PICK_MODEL, checks.PICK_CLUSTER, checks.PICK_BATCH, top=1)
    layout, why = pick_right(checks.PICK_MODEL, checks.PICK_CLUSTER, checks.PICK_BATCH)
    assert why["step_s"] <= (1 + planned.tie) * planned.fastest.step_seconds
