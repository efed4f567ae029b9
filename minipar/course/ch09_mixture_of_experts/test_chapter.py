"""Chapter 09: the tour row, the measurement helpers, and the checks (each rejects the stub and the plausible
wrong answers kept here, and accepts the solution)."""
import math

import pytest
import torch
import torch.nn.functional as F

from minipar.course.checks import ExerciseError
from minipar.course.ch09_mixture_of_experts import checks, figures, tour


# ---- the tour row ----------------------------------------------------------------------------------------

def test_moe_ep_row_matches_and_shows_observed_bytes():
    row = tour.run()
    assert row.strategy == "moe-ep" and row.world_size == 4
    assert row.matches, row
    assert "0 tokens dropped" in row.note
    # model = formula = (ep-1)/ep of 2 directions x 2·k·cf·T·M·b per layer (cf 4: whole capacities)
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula)
    assert row.bytes_formula == 2 * 2 * 2 * 1 * 4.0 * 32 * 32 * 4 * 3 / 4     # 2 layers, T = M = 32, fp32
    if row.bytes_observed_per_rank is not None:
        framing = row.bytes_observed_per_rank - row.bytes_sent_per_rank
        assert 0 <= framing <= 8 * 3 * 3 * 64            # 8 all-to-alls x 3 peers x 3 messages
        from minipar.course.tour import observed_status
        assert observed_status(row) == "within"
    assert row.peak_bytes_per_rank > 0


def test_shared_and_fine_grained_row_equals_one_device_with_the_formulas_bytes():
    row = tour.shared_fine_grained()
    assert row.matches and row.max_abs_diff < 1e-10 and "shared expert" in row.note
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula)


def test_loss_free_row_equals_one_device_moving_its_bias():
    row = tour.loss_free()
    assert row.matches and row.max_abs_diff < 1e-10 and "no balancing loss" in row.note


def test_dropless_row_drops_nothing_under_a_planted_imbalance_and_equals_one_device():
    row = tour.dropless_row()
    assert row.strategy == "moe-ep dropless" and row.matches, row
    assert "0 dropped (padded cf 1.25: 528)" in row.note        # 4 ranks x 2 layers x 3 steps x 22 of 32 tokens
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula)
    assert row.bytes_formula == 2 * (4 * 32 * 32 * 4 * 3 / 4 + 4 * 8 * 3 / 4)   # 2 layers, T = M = 32, fp32
    if row.bytes_observed_per_rank is not None:
        from minipar.course.tour import observed_status
        assert observed_status(row) == "within"


def test_allgather_row_equals_one_device_with_the_formulas_bytes():
    row = tour.allgather_row()
    assert row.strategy == "moe all-gather dispatch" and row.matches, row
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula)
    assert row.bytes_formula == 2 * 3 * 32 * (4 * 32 * 4 + 2 * 2 * 4 + 8 * 2)     # 2 layers, ep 4, T = M = 32, k 2
    assert "(ep/k = 2 x less)" in row.note
    if row.bytes_observed_per_rank is not None:     # + the reduce-scatters' bytes again (gloo all-reduces them)
        scattered = 2 * 3 * 32 * (2 * 32 * 4 + 2 * 4)
        assert 0 <= row.bytes_observed_per_rank - row.bytes_sent_per_rank - scattered <= 14 * 3 * 512   # framing
        assert "gloo's reduce-scatter all-reduces" in row.note


def test_expert_tp_row_equals_one_device_with_the_formulas_bytes():
    row = tour.expert_tp_row()
    assert row.strategy == "expert-TP 2" and row.matches and row.max_abs_diff < 1e-11, row
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula) == 2 * 4 * 1 * 128 * 32 * 8   # 2 layers, 2 x 2·32 slots, float64


# ---- measurement helpers ---------------------------------------------------------------------------------

def test_routing_example_and_drop_fraction():
    r = figures.example_routing()
    assert r.capacity == 3 and r.dropped == int((r.slot[:, 0] >= 3).sum()) > 0
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    fracs = figures.drop_fraction(logits, figures.CAPACITY_FACTORS)
    assert all(a >= b for a, b in zip(fracs, fracs[1:])) and fracs[-1] == 0.0


def test_loss_free_run_moves_its_biases_and_adds_no_loss_term():
    run = figures.balance_run(0.0, steps=6, bias_rate=0.01)
    assert all(a == 0.0 for a in run["aux"]) and figures.lm_losses(run) == run["loss"]
    assert all(abs(b) <= 6 * 0.01 + 1e-9 for layer in run["bias"] for b in layer)     # at most γ per step
    assert any(b != 0 for layer in run["bias"] for b in layer)
    loads = figures.expert_loads(run, last=2)
    assert loads.shape == (2, 4) and loads.sum().item() == 2 * 2 * run["tokens"]      # 2 layers x 2 steps


def test_flops_per_token_moe_near_dense_of_same_compute():
    f = figures.flops_per_token()
    moe, same_params, same_compute = f["moe"], f["dense same params"], f["dense same compute"]
    assert abs(moe[1] - same_params[1]) / same_params[1] < 0.02          # about the same parameters
    assert moe[0] < 0.5 * same_params[0]                                  # far less compute per token
    assert same_compute[0] <= moe[0] < 1.05 * same_compute[0]             # + the router's matmul


# ---- exercise 1: top-1 routing with capacity ---------------------------------------------------------------

def route_right(logits, capacity_factor):
    t, e = logits.shape
    probs = logits.softmax(-1)
    gate, expert = probs.max(-1)
    cap = math.ceil(t / e * capacity_factor)
    position = F.one_hot(expert, e).cumsum(0).gather(1, expert[:, None]).squeeze(1) - 1
    return expert, gate, position < cap


def route_stub(logits, capacity_factor):
    raise NotImplementedError()


def route_no_capacity(logits, capacity_factor):
    expert, gate, kept = route_right(logits, capacity_factor)
    return expert, gate, torch.ones_like(kept)


def route_floor(logits, capacity_factor):
    t, e = logits.shape
    expert, gate, _ = route_right(logits, capacity_factor)
    position = F.one_hot(expert, e).cumsum(0).gather(1, expert[:, None]).squeeze(1) - 1
    return expert, gate, position < math.floor(t / e * capacity_factor)


def route_drops_earliest(logits, capacity_factor):
    expert, gate, _ = route_right(logits, capacity_factor)
    _, _, kept_from_the_end = route_right(logits.flip(0), capacity_factor)
    return expert, gate, kept_from_the_end.flip(0)


def route_gate_one(logits, capacity_factor):
    expert, gate, kept = route_right(logits, capacity_factor)
    return expert, torch.ones_like(gate, requires_grad=True), kept


def route_gate_logit(logits, capacity_factor):
    expert, _, kept = route_right(logits, capacity_factor)
    return expert, logits.max(-1).values, kept


def route_detached_gate(logits, capacity_factor):
    expert, gate, kept = route_right(logits, capacity_factor)
    return expert, gate.detach(), kept


def route_argmin(logits, capacity_factor):
    _, gate, kept = route_right(logits, capacity_factor)
    return logits.argmin(-1), gate, kept


def test_top1_route_accepts_solution():
    checks.check_top1_route(route_right)


def test_top1_route_stub_stays_not_implemented():
    with pytest.raises(NotImplementedError):
        checks.check_top1_route(route_stub)


@pytest.mark.parametrize("wrong,says", [
    (route_no_capacity, "no token was dropped"), (route_floor, "rounded down"),
    (route_drops_earliest, "earliest tokens first"), (route_gate_one, "no gradient"),
    (route_gate_logit, "not the raw logit"), (route_detached_gate, "differentiable"),
    (route_argmin, "argmax")])
def test_top1_route_rejects_wrong_answers(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        checks.check_top1_route(wrong)


# ---- exercise 2: the aux loss ----------------------------------------------------------------------------

def aux_right(logits, alpha):
    e = logits.shape[1]
    probs = logits.softmax(-1)
    f = F.one_hot(probs.argmax(-1), e).to(probs.dtype).mean(0)
    return alpha * e * (f * probs.mean(0)).sum()


def aux_stub(logits, alpha):
    raise NotImplementedError()


def aux_gshard_paper(logits, alpha):
    return aux_right(logits, alpha) / logits.shape[1] ** 2


def aux_no_e(logits, alpha):
    return aux_right(logits, alpha) / logits.shape[1]


def aux_e_twice(logits, alpha):
    return aux_right(logits, alpha) * logits.shape[1]


def aux_no_alpha(logits, alpha):
    return aux_right(logits, 1.0)


def aux_p_times_p(logits, alpha):
    p = logits.softmax(-1).mean(0)
    return alpha * logits.shape[1] * (p * p).sum()


def aux_gate_only(logits, alpha):
    e = logits.shape[1]
    probs = logits.softmax(-1)
    mask = F.one_hot(probs.argmax(-1), e).to(probs.dtype)
    return alpha * e * (mask.mean(0) * (probs * mask).mean(0)).sum()


def aux_detached(logits, alpha):
    return aux_right(logits.detach(), alpha)


def test_aux_loss_accepts_solution():
    checks.check_aux_loss(aux_right)


def test_aux_loss_stub_stays_not_implemented():
    with pytest.raises(NotImplementedError):
        checks.check_aux_loss(aux_stub)


@pytest.mark.parametrize("wrong,says", [
    (aux_gshard_paper, "GShard"), (aux_no_e, "factor E is missing"), (aux_e_twice, "E counted twice"),
    (aux_no_alpha, "α is missing"), (aux_p_times_p, "P·P"), (aux_gate_only, "full distribution"),
    (aux_detached, "no gradient")])
def test_aux_loss_rejects_wrong_answers(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        checks.check_aux_loss(wrong)


# ---- the dropless section --------------------------------------------------------------------------------

def test_dropless_section_keeps_every_token_where_padded_drops_and_its_check_can_fail():
    from minipar.course.ch09_mixture_of_experts import dropless_run
    table = dropless_run.run()
    dropless_run.check(table)
    assert table["dropless"]["dropped"] == 0 and table["dropless"]["matches"]
    assert table["padded"]["dropped"] == 22 * 4 * 2 * 3         # 32 - ceil(32/4 · 1.25) a rank, layer, step
    for name, key, value in (("dropless", "dropped", 1), ("padded", "dropped", 0), ("dropless", "sent", 0.0)):
        bad = {n: dict(row) for n, row in table.items()}
        bad[name][key] = value
        with pytest.raises(AssertionError):
            dropless_run.check(bad)
