"""The router of a mixture-of-experts layer: which expert(s) each token goes to, in which slot, with what weight.

For T tokens and E experts a linear router gives logits (T, E) and probabilities p = softmax(logits).

* **top-1 (Switch)**: each token goes to its most probable expert i, and the expert's output is scaled by
  the gate g = p_i (not renormalised, so the router gets a gradient through g). Fedus et al. 2021, "Switch
  Transformers" (arXiv:2101.03961).
* **top-k** (k ≥ 2, GShard's top-2): the k most probable experts, gates renormalised to sum to 1 over the
  k chosen. Lepikhin et al. 2020, "GShard" (arXiv:2006.16668).

**Capacity.** Every expert takes at most C = ⌈k · T/E · cf⌉ tokens (k = 1: ⌈T/E · cf⌉, the Switch
formula), cf the capacity factor. Slots are handed out in token order, all tokens' first choices before any
second choice (GShard's priority). A token whose expert is full is **dropped** for that choice: it gets
nothing from that expert, and if all its choices are dropped the MoE layer outputs 0 for it, so the block's
residual connection carries it through unchanged (x + 0).

**Load-balancing loss (Switch's normalisation).** With f_i = fraction of the T tokens whose *first* choice
is expert i (counted before dropping; no gradient) and P_i = mean over tokens of p_i (differentiable)::

    aux = α · E · Σ_i f_i · P_i          (= α when routing is uniform, f_i = P_i = 1/E; Switch: α = 1e-2)

Its gradient pushes probability away from the experts that receive many tokens. GShard's paper (Algorithm 1)
writes mean_i(f_i · P_i) = (1/E) Σ_i f_i · P_i: E² smaller than the above for the same routing, and so does
fairscale's ``top2gating`` (``l_aux = torch.mean(me * ce)``, fairscale/nn/moe/top2gate.py, averaged over its
groups too). DeepSpeed's ``top2gating`` and fairseq's (``torch.mean(me * ce) * num_experts * num_experts``,
deepspeed/moe/sharded_moe.py, fairseq/modules/moe/top2gate.py) multiply that E² back and equal Switch's form,
as does DeepSpeed's ``top1gating`` (``torch.sum(me * ce) * num_experts``): when copying an α between code bases,
check which of the two a code uses.

:func:`balance_counts` separates the counts from the division so that, over several ranks, the counts can
be summed first (one all-reduce of E numbers) and f taken over the whole batch: see
:mod:`minipar.moe.expert_parallel`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Routing", "capacity", "route", "route_expert_choice", "route_groups", "balance_counts", "load_balancing_loss", "gshard_paper_aux",
           "deepspeed_aux"]


def capacity(tokens: int, experts: int, capacity_factor: float, k: int = 1) -> int:
    """C = ⌈k · tokens / experts · capacity_factor⌉ slots per expert."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity factor must be > 0, got {capacity_factor}")
    return max(1, math.ceil(k * tokens / experts * capacity_factor - 1e-9))


@dataclass
class Routing:
    """Where each of T tokens goes, for its k choices (all (T, k) tensors but ``probs``, (T, E))."""
    probs: torch.Tensor        # softmax of the router logits (T, E), differentiable
    expert: torch.Tensor       # chosen expert per choice (T, k), long
    gate: torch.Tensor         # the weight of that expert's output (T, k), differentiable
    slot: torch.Tensor         # position in the expert's buffer (T, k), long (≥ capacity when dropped)
    kept: torch.Tensor         # slot < capacity (T, k), bool
    capacity: int

    @property
    def experts(self) -> int:
        return self.probs.shape[-1]

    @property
    def dropped(self) -> int:
        """Token-choices that found their expert full."""
        return int((~self.kept).sum())

    def load(self) -> torch.Tensor:
        """Token-choices each expert *received* (after dropping), (E,) long."""
        return torch.bincount(self.expert[self.kept], minlength=self.experts)

    def wanted(self) -> torch.Tensor:
        """Token-choices routed to each expert before dropping, (E,) long."""
        return torch.bincount(self.expert.reshape(-1), minlength=self.experts)


def route(logits: torch.Tensor, k: int = 1, capacity_factor: float = 1.25, cap: int | None = None,
          bias: torch.Tensor | None = None) -> Routing:
    """Route T tokens given router ``logits`` (T, E): top-k experts, gates, slots, and which are dropped.

    ``cap`` overrides the capacity (default :func:`capacity` of T tokens). ``bias`` (E,), loss-free balancing
    (:mod:`minipar.moe.balance`): added to the probabilities only to choose the top k; the gates are the
    unbiased probabilities, so the bias gets no gradient."""
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"top-k must be between 1 and the number of experts ({e}), got {k}")
    probs = logits.softmax(dim=-1)
    if bias is None:
        top_p, expert = probs.topk(k, dim=-1)                        # (T, k), sorted by probability
    else:
        expert = (probs.detach() + bias.detach()).topk(k, dim=-1).indices    # choose with the bias ...
        top_p = probs.gather(-1, expert)                                       # ... weigh without it
    gate = top_p if k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    # Slots: count, per expert, the choices before this one, first choices of all tokens first.
    onehot = F.one_hot(expert.t().reshape(-1), e)                   # (k·T, E) choice-major
    before = onehot.cumsum(dim=0) - onehot                           # choices of that expert earlier
    slot = (before * onehot).sum(dim=-1).view(k, t).t()              # (T, k)
    c = capacity(t, e, capacity_factor, k) if cap is None else cap
    return Routing(probs, expert, gate, slot, slot < c, c)


def route_expert_choice(logits: torch.Tensor, capacity_factor: float = 1.0) -> Routing:
    """Expert choice (Zhou et al. 2022, arXiv:2202.09368): each expert takes the C = ⌈T/E·cf⌉ tokens with its highest
    probability (cf: the mean number of experts per token), so every expert is exactly full and a token gets 0, 1
    or several experts, each weighted by p_te. As a Routing with k = E: choice j of token t is expert j, kept when
    expert j chose t, in slot = its place in j's top C. Balanced by construction (no balancing loss); a token's
    experts depend on the other tokens of its group, later ones included (a decoder's causality is not kept)."""
    t, e = logits.shape
    probs = logits.softmax(dim=-1)
    c = min(t, capacity(t, e, capacity_factor))
    chosen = probs.detach().t().topk(c, dim=-1).indices                # (E, C): each expert's tokens, best first
    slot = torch.full((e, t), c, dtype=torch.long, device=logits.device)
    slot.scatter_(1, chosen, torch.arange(c, device=logits.device).expand(e, c))
    expert = torch.arange(e, device=logits.device).expand(t, e)
    return Routing(probs, expert, probs, slot.t(), slot.t() < c, c)


def route_groups(logits: torch.Tensor, groups: int, k: int = 1, capacity_factor: float = 1.25,
                 bias: torch.Tensor | None = None, expert_choice: bool = False) -> Routing:
    """Route G equal consecutive groups of tokens independently (GShard's *groups*), each with its own
    capacity C = ⌈k·(T/G)/E·cf⌉: what G ranks do, each routing its own tokens. Returned as one Routing over
    all T tokens whose buffer has G·C slots per expert, group g's in slots g·C … g·C + C − 1. ``expert_choice``:
    each group routed by :func:`route_expert_choice` instead."""
    t = logits.shape[0]
    if groups < 1 or t % groups:
        raise ValueError(f"{t} tokens do not split into {groups} equal routing groups")
    def one(chunk):
        return route_expert_choice(chunk, capacity_factor) if expert_choice else route(chunk, k, capacity_factor,
                                                                                         bias=bias)
    if groups == 1:
        return one(logits)
    parts = [one(chunk) for chunk in logits.chunk(groups)]
    c = parts[0].capacity
    slot = torch.cat([p.slot + g * c for g, p in enumerate(parts)])
    kept = torch.cat([p.kept for p in parts])
    return Routing(torch.cat([p.probs for p in parts]), torch.cat([p.expert for p in parts]),
                   torch.cat([p.gate for p in parts]), torch.where(kept, slot, groups * c), kept, groups * c)


def balance_counts(routing: Routing) -> torch.Tensor:
    """Tokens whose first choice is each expert, (E,) float, no gradient (f_i = counts_i / T)."""
    first = routing.expert[:, 0]
    return torch.bincount(first, minlength=routing.experts).to(routing.probs.dtype)


def load_balancing_loss(routing: Routing, alpha: float = 1e-2, counts: torch.Tensor | None = None,
                        total_tokens: int | None = None) -> torch.Tensor:
    """Switch's α · E · Σ_i f_i · P_i over this routing's tokens.

    ``counts`` / ``total_tokens`` replace this routing's own first-choice counts and token count with
    those of a larger batch (summed over ranks), so that f is the whole batch's; P stays this routing's."""
    e = routing.experts
    counts = balance_counts(routing) if counts is None else counts
    f = counts / (routing.probs.shape[0] if total_tokens is None else total_tokens)
    p = routing.probs.mean(dim=0)
    return alpha * e * (f.detach() * p).sum()


def gshard_paper_aux(routing: Routing) -> torch.Tensor:
    """GShard's Algorithm 1 and fairscale's ``top2gating``: mean_e(c_e / S · m_e) = (1/E) Σ f_i P_i (E² below
    Switch's, α = 1)."""
    f = balance_counts(routing) / routing.probs.shape[0]
    return (f * routing.probs.mean(dim=0)).mean()


def deepspeed_aux(routing: Routing) -> torch.Tensor:
    """DeepSpeed's and fairseq's ``mean(me * ce) * E * E`` = E Σ f_i P_i (Switch's, α = 1)."""
    e = routing.experts
    ce = F.one_hot(routing.expert[:, 0], e).to(routing.probs.dtype).mean(dim=0)
    me = routing.probs.mean(dim=0)
    return (me * ce).mean() * e * e
