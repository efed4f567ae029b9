"""Chapter 14's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

from minipar.course.ch14_shrinking_communication import study as s14
from minipar.machine.cluster import IB_HDR


def check_why_these_methods_different_each(own, single) -> None:
    """Why these methods are different: each is checked against its own rule"""
    assert own.matches and single.max_abs_diff > 1e-4


def check_powersgd_rank_r_gradient_with(bytes_rows, study) -> None:
    """PowerSGD: a rank-r gradient with error feedback"""
    assert all(seen == formula for _, seen, formula in bytes_rows)
    assert sum(s.numel() for s in study.shapes) == 9152 and max(s.numel() for s in study.shapes) == 64 * 16


def check_powersgd_matches_torch_hook(ours, theirs, gap) -> None:
    """PowerSGD: a rank-r gradient with error feedback"""
    assert ours.losses[:2] == theirs.losses[:2] and gap < 0.1


def check_diloco_streaming_diloco_one_all(study, ddp_step) -> None:
    """DiLoCo and streaming DiLoCo: one all-reduce per H steps"""
    assert sum(study.runs["DiLoCo H=10"].bytes_per_step) == s14.STEPS / 10 * ddp_step


def check_one_plot_loss_after_fixed(loss, rows) -> None:
    """The one plot: loss after a fixed token budget against bytes sent"""
    assert loss["PowerSGD r=1"] > loss["PowerSGD r=2"] > loss["PowerSGD r=4"] > loss["DDP"]
    assert loss[f"DDP lr {s14.TUNED_LR:g}"] < min(v for k, v in loss.items() if k.startswith(("DiLoCo", "Streaming")))
    assert dict((n, b) for n, b, _, _ in rows)["ZeRO++"] < dict((n, b) for n, b, _, _ in rows)["ZeRO-3"] / 4


def check_when_each_pays_one_step(params, inside, compute, rails, ethernet) -> None:
    """When each pays: one step on a two-node cluster (a model)"""
    assert 1.3e9 < params < 1.5e9 and inside["DDP"] < 0.1 * compute
    n, grads = 16, 4 * params                        # the α-β ring over 8 rails of InfiniBand HDR, by hand
    ring = 2 * (n - 1) * IB_HDR.latency + 2 * (n - 1) / n * grads / (8 * IB_HDR.beta)
    assert ring / 1.5 <= rails["DDP"] <= 1.5 * ring and rails["DDP"] < 0.2 * compute
    assert ethernet["DDP"] > 0.5 * compute and ethernet["ZeRO-3"] > ethernet["DDP"]
    assert max(ethernet[f"PowerSGD r={r}"] for r in s14.RANKS) < 0.01 * compute
