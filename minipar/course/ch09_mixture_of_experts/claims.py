"""Chapter 09's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch

from minipar.moe.balance import z_loss
from minipar.moe.router import deepspeed_aux
from minipar.moe.router import gshard_paper_aux
from minipar.moe.router import route


def check_why_only_few_experts_per(moe, same_params, padded) -> None:
    """Why only a few experts per token"""
    assert abs(moe[1] - same_params[1]) / same_params[1] < 0.02 and moe[0] < 0.5 * same_params[0]
    assert padded > moe[0]


def check_router(example) -> None:
    """The router"""
    assert example.capacity == 3 and example.dropped == int((example.wanted() - 3).clamp(min=0).sum())


def check_capacity_dropping(r, x, y, dropped) -> None:
    """Capacity and dropping"""
    assert r.dropped == 9 and torch.equal((x + y)[dropped], x[dropped])


def check_favoured_expert_drops_more(curves, factors) -> None:
    """Capacity and dropping"""
    assert curves["expert 0 favoured (+1)"][factors.index(1.25)] > curves["random router"][factors.index(1.25)]


def check_cf_e_k_c_t_nothing(fr) -> None:
    """Capacity and dropping: cf = E/k: C = T, nothing can drop"""
    assert all(a >= b for a, b in zip(fr, fr[1:])) and fr[-1] == 0.0


def check_load_balancing_loss_work(switch, r8) -> None:
    """The load-balancing loss at work"""
    assert torch.allclose(switch, deepspeed_aux(r8)) and torch.allclose(switch, 64 * gshard_paper_aux(r8))


def check_climbs_stays_tokens_dropped(late, drop, s0, peak) -> None:
    """The load-balancing loss at work: climbs, stays: tokens dropped"""
    assert late["α = 0.1"] < late["α = 0"] and drop["α = 0.1"] < drop["α = 0"]
    assert s0[peak] > 1.5 * s0[0] and late["α = 0"] > s0[0] and drop["α = 0"] > 0.1   # climbs, stays: tokens dropped


def check_trained_balancing_drops_less(trained, at) -> None:
    """The load-balancing loss at work"""
    assert trained["router trained with α = 0.1"][at] <= trained["router trained with α = 0"][at]


def check_expert_parallelism_all_all(out, one_group) -> None:
    """Expert parallelism: the all-to-all"""
    assert sum(d for _, d in out) > 0 and not one_group.matches


def check_c_whole_number_these_settings(model, formula, N) -> None:
    """The bytes of the all-to-all: C is a whole number in these settings"""
    assert model == formula * (N - 1) / N


def check_bytes_all_all(per_peer) -> None:
    """The bytes of the all-to-all"""
    assert 0 <= per_peer <= 3 * 64


def check_beyond_switchs_loss_z_loss(lg) -> None:
    """Beyond Switch's loss: the z-loss, per sequence or per batch, and no loss at all"""
    assert abs(z_loss(lg).item() - 1e-3 * (lg.logsumexp(-1) ** 2).mean().item()) < 1e-12


def check_batch_and_sequence_balance_losses(batch, seq) -> None:
    """Beyond Switch's loss: the z-loss, per sequence or per batch, and no loss at all"""
    assert abs(batch - 1.0) < 1e-12 and abs(seq - (2 * 0.7 + 2 * 0.8) / 2) < 1e-12


def check_capacity_limited_routing_load(load, logits) -> None:
    """Beyond Switch's loss: the z-loss, per sequence or per batch, and no loss at all"""
    assert load.max() < 1.2 * 64 < route(logits).wanted().max()


def check_no_balancing_term_loss_lm_loss(runs, loss_free, late, lm) -> None:
    """Beyond Switch's loss: the z-loss, per sequence or per batch, and no loss at all: no balancing term: its loss
    is the LM loss alone"""
    assert all(a == 0.0 for a in runs[loss_free]["aux"])       # no balancing term: its loss is the LM loss alone
    assert any(b != 0 for layer in runs[loss_free]["bias"] for b in layer)
    assert late["α = 0.1"] < min(late[loss_free], late["α = 0"]) and lm["α = 0.1"] > lm["α = 0"]   # the loss's price


def check_expert_flops_and_params(f8, f4, fs, ffn, p8, p4) -> None:
    """Beyond Switch's loss: the z-loss, per sequence or per batch, and no loss at all"""
    assert f8 - f4 == 2 * 2 * 32 * 4 and fs - f8 == 2 * ffn and abs(p8 - p4) < 0.01 * p4


def check_copies_busiest_experts_eplb(phy2log, readme) -> None:
    """Copies of the busiest experts: EPLB"""
    assert torch.equal(phy2log, readme)


def check_eplb_lowers_busiest_load(best, plain, layer) -> None:
    """Copies of the busiest experts: EPLB"""
    assert best < plain[layer].max()


def check_eplb_never_below_ideal(after, ideal, layer) -> None:
    """Copies of the busiest experts: EPLB"""
    assert after.max() >= ideal[layer] - 1e-9
