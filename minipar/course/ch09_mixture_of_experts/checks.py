"""Checks for chapter 09's exercises: top-1 routing with capacity, and the Switch load-balancing loss.

Both run on one process and compare with :func:`minipar.moe.router.route` and
:func:`minipar.moe.router.load_balancing_loss` on several routers (balanced, skewed enough to drop tokens,
token counts where T/E·cf is not an integer), and name the likely mistake when the answer matches a known
wrong one.
"""
from __future__ import annotations

import math

import torch

from minipar.course.checks import fail
from minipar.moe.router import load_balancing_loss, route

__all__ = ["check_top1_route", "check_aux_loss", "cases"]


def cases():
    """(name, logits (T, E) float64, capacity factor) the checks try."""
    g = torch.Generator().manual_seed(9)
    skew = torch.tensor([2.0, 0.5, 0.0, -1.0], dtype=torch.float64)

    def randn(t, e):
        return torch.randn(t, e, dtype=torch.float64, generator=g)
    return [
        ("10 tokens, 4 experts, cf 1.0 (C = ceil(2.5) = 3)", randn(10, 4) + skew, 1.0),
        ("16 tokens, 4 experts, cf 1.25 (C = 5), skewed", randn(16, 4) + skew, 1.25),
        ("24 tokens, 3 experts, cf 0.9 (C = ceil(7.2) = 8)", randn(24, 3), 0.9),
        ("8 tokens, 2 experts, cf 2.0 (C = 8: nothing can drop)", randn(8, 2), 2.0),
    ]


def check_top1_route(top1_route) -> None:
    """``top1_route(logits, capacity_factor)`` -> ``(expert, gate, kept)``, each of shape (T,): the chosen
    expert (long), its gate p_expert (differentiable), and whether the token got a slot."""
    for name, logits, cf in cases():
        logits = logits.clone().requires_grad_()
        want = route(logits, 1, cf)
        got = top1_route(logits, cf)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            fail(f"{name}: the return value", "a tuple (expert, gate, kept)", type(got).__name__,
                 "return the three tensors, in that order")
        expert, gate, kept = (torch.as_tensor(x) for x in got)
        w_expert, w_gate, w_kept = want.expert[:, 0], want.gate[:, 0], want.kept[:, 0]
        if expert.shape != w_expert.shape or not torch.equal(expert.long(), w_expert):
            fail(f"{name}: expert per token", w_expert.tolist(), expert.tolist(),
                 "the expert is the argmax of the logits (= of the softmax), one per token (dim=-1)")
        if gate.shape != w_gate.shape or not torch.allclose(gate.detach().double(), w_gate.detach(), atol=1e-9):
            g = gate.detach().double()
            if torch.allclose(g, torch.ones_like(g)):
                mistake = ("the gate is p_expert (Switch), not 1: with a constant gate the router gets no "
                           "gradient from the language-model loss")
            elif torch.allclose(g, logits.detach().max(-1).values):
                mistake = "the gate is the softmax probability, not the raw logit"
            else:
                mistake = "gate = softmax(logits)[t, expert[t]]"
            fail(f"{name}: gate per token", [round(x, 4) for x in w_gate.tolist()],
                 [round(x, 4) for x in g.tolist()], mistake)
        if not gate.requires_grad:
            fail(f"{name}: the gate", "differentiable with respect to the logits", "no gradient",
                 "do not detach the probabilities (or build the gate from .item()/argmax values)")
        kept = kept.bool()
        if kept.shape != w_kept.shape or not torch.equal(kept, w_kept):
            c = want.capacity
            t, e = logits.shape
            if bool(kept.all()) and not bool(w_kept.all()):
                mistake = f"no token was dropped: an expert takes at most C = ceil(T/E · cf) = {c} tokens"
            elif torch.equal(kept, _kept_with(w_expert, math.floor(t / e * cf))):
                mistake = f"capacity rounded down: C = ceil(T/E · cf) = {c}, not floor"
            elif torch.equal(kept, _kept_from_the_end(w_expert, c)):
                mistake = "slots go to the earliest tokens first (token order): the latest ones are dropped"
            else:
                mistake = (f"count each expert's tokens in token order (a cumulative sum over tokens of the "
                           f"one-hot choice); keep a token while its position is < C = {c}")
            fail(f"{name}: kept per token", w_kept.int().tolist(), kept.int().tolist(), mistake)
    print("top1_route: the experts, gates and dropped tokens of every case equal minipar.moe.router.route")


def _kept_with(expert, cap):
    seen: dict = {}
    out = []
    for e in expert.tolist():
        seen[e] = seen.get(e, 0) + 1
        out.append(seen[e] <= cap)
    return torch.tensor(out)


def _kept_from_the_end(expert, cap):
    return _kept_with(expert.flip(0), cap).flip(0)


def check_aux_loss(aux_loss) -> None:
    """``aux_loss(logits, alpha)`` -> α · E · Σ_i f_i · P_i for top-1 routing of ``logits`` (T, E): f_i the
    fraction of tokens whose argmax is i (no gradient), P_i the mean softmax probability of expert i."""
    for name, logits, cf in cases():
        e = logits.shape[1]
        x = logits.clone().requires_grad_()
        want = load_balancing_loss(route(x, 1, cf), alpha=0.01)
        (want_grad,) = torch.autograd.grad(want, x)
        x = logits.clone().requires_grad_()
        got = aux_loss(x, 0.01)
        got = torch.as_tensor(got)
        if got.numel() != 1:
            fail(f"{name}: the loss", "a scalar", f"shape {tuple(got.shape)}", "sum over the experts")
        value = got.detach().double().reshape(())
        if not torch.allclose(value, want.detach(), rtol=1e-9, atol=1e-15):
            ratio = (value / want.detach()).item()
            if math.isclose(ratio, 1 / e ** 2, rel_tol=1e-6):
                mistake = ("GShard's paper form, mean_i(f_i·P_i): E² smaller than Switch's α·E·Σ f_i·P_i "
                           "(which is what fairscale's mean(me*ce)*E*E computes)")
            elif math.isclose(ratio, 1 / e, rel_tol=1e-6):
                mistake = "the factor E is missing (or you took the mean over experts instead of the sum)"
            elif math.isclose(ratio, e, rel_tol=1e-6):
                mistake = "E counted twice: α · E · Σ_i, with f and P fractions (each sums to 1)"
            elif math.isclose(ratio, 100.0, rel_tol=1e-6):
                mistake = "α is missing"
            else:
                p = logits.softmax(-1).mean(0)
                if math.isclose(value.item(), 0.01 * e * (p * p).sum().item(), rel_tol=1e-6):
                    mistake = ("f_i is the fraction of tokens *sent* to expert i (counts of the argmax), not "
                               "the mean probability: P·P is not the Switch loss")
                else:
                    mistake = ("f_i = (tokens whose argmax is i) / T, P_i = mean over tokens of softmax(logits)[:, i]; "
                               "P uses every token's full distribution, not just the chosen gate")
            fail(f"{name}: aux loss (α = 0.01)", f"{want.item():.6g}", f"{value.item():.6g}", mistake)
        if not got.requires_grad:
            fail(f"{name}: the loss", "differentiable (through P)", "no gradient",
                 "P_i must come from the softmax of the logits, not from detached values")
        (grad,) = torch.autograd.grad(got.reshape(()), x)
        if not torch.allclose(grad.double(), want_grad, rtol=1e-7, atol=1e-12):
            fail(f"{name}: gradient of the aux loss", "the gradient of α·E·Σ f_i·P_i with f constant",
                 f"max |Δ| {(grad.double() - want_grad).abs().max().item():.3g}",
                 "f_i is a count (no gradient): detach it; the gradient flows through P only")
    print("aux_loss: value and gradient equal minipar.moe.router.load_balancing_loss on every case")
