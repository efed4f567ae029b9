"""A mixture-of-experts layer and the tiny GPT built with it.

:class:`MoELayer` replaces a block's feed-forward network (FFN) by E expert FFNs of the same shape and a
router (:mod:`minipar.moe.router`). For T tokens x (T, M):

1. route: top-k experts per token, gates, a slot < C in each chosen expert's buffer (or dropped);
2. **dispatch**: copy each kept token into its slot of a buffer (E, C, M) (empty slots stay zero);
3. each expert e runs its FFN on buffer[e] (C, M);
4. **combine**: y_t = Σ_{kept choices j} gate_tj · expert_{e_tj}(x_t); a token with no kept choice gets 0,
   and the block adds it to its residual: x + 0 = x passes through.

The buffer has a fixed shape (E, C, M) whatever the routing: that is what lets expert parallelism send it
with one all-to-all of known size (:mod:`minipar.moe.expert_parallel`), the choice of Switch and GShard.
An expert computes on its empty slots too: the price of fixed shapes, cf − 1 of the work at most.
With ``MoEConfig(groups=G)`` the T tokens are routed as G consecutive groups, each with its own capacity
(:func:`minipar.moe.router.route_groups`): what G expert-parallel ranks do with their own tokens.
``MoEConfig(expert_choice=True)``: the experts choose their tokens instead (each its top C; no balancing loss:
:func:`minipar.moe.router.route_expert_choice`); ``MoEConfig(dropless=True)``: no capacity at all.

Compute per token: an FFN is two matmuls, 2·(2·M·H) FLOPs forward (H its hidden size); a token visits k
experts, so the MoE layer costs k FFNs (+ the router, 2·M·E) while holding E FFNs of parameters: E/k times
the parameters of the dense FFN for about k times its compute per token.

**Shared and fine-grained experts** (DeepSeekMoE: Dai et al. 2024, arXiv:2401.06066). ``MoEConfig(granularity=m)``
cuts every expert to H/m hidden units (*fine-grained segmentation*: with m·E experts and top m·k, the same
parameters and compute as E experts top-k, but C(mE, mk) instead of C(E, k) combinations for a token to pick);
``MoEConfig(shared=S)`` adds S experts of that size which every token passes through, outside the router
(*shared expert isolation*: common knowledge in them, so the routed experts need not each learn it)::

    y_t = Σ_{s < S} shared_s(x_t) + Σ_{kept choices j} gate_tj · expert_{e_tj}(x_t)

Shared experts are dense parameters: under expert parallelism every rank holds them and their gradients are
averaged like attention's. DeepSeek-V3: 1 shared + 256 routed experts, top 8.

:class:`MoEGPT` is :class:`minipar.models.TinyGPT` with every ``moe_every``-th block's FFN replaced by an
MoE layer (Switch puts one in every other block; here every block by default). Its loss
(:func:`moe_loss`) is the language-model cross-entropy plus the blocks' load-balancing losses (and router
z-losses, ``MoEConfig(z_loss=c_z)``). ``MoEConfig(bias_rate=γ)`` turns on auxiliary-loss-free balancing: a
per-expert routing bias (a buffer, never a parameter) that :meth:`MoEGPT.update_routing_bias` moves after each
step (:mod:`minipar.moe.balance`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..recipe import gpt_recipe
from ..loop import lm_loss
from ..models import FeedForward, GPTConfig, TinyGPT
from ..validation import positive_int
from .balance import update_bias, z_loss
from .router import Routing, balance_counts, load_balancing_loss, route, route_groups

__all__ = ["MoEConfig", "MoELayer", "MoEGPT", "moe_blocks", "expert_config", "dispatch", "combine", "moe_loss",
           "moe_recipe",
           "validate_config", "no_drop_capacity_factor"]


@dataclass(frozen=True)
class MoEConfig:
    experts: int = 4
    k: int = 1                      # experts per token (1: Switch)
    capacity_factor: float = 1.25   # C = ceil(k · T/E · cf)
    alpha: float = 1e-2             # weight of the load-balancing loss (Switch: 1e-2)
    every: int = 1                  # an MoE layer in every `every`-th block (Switch, GLaM: 2)
    groups: int = 1                 # routing groups per forward, each with its own capacity (GShard)
    z_loss: float = 0.0             # c_z of the router z-loss (ST-MoE: 1e-3); 0: none
    bias_rate: float = 0.0          # γ of loss-free balancing (DeepSeek-V3: 1e-3); 0: no routing bias
    shared: int = 0                 # shared experts every token passes through (DeepSeekMoE)
    granularity: int = 1            # m: each expert's FFN hidden = dense FFN hidden / m (DeepSeekMoE)
    dropless: bool = False          # no capacity: every choice kept, cf unused (MegaBlocks; minipar.moe.dropless)
    expert_choice: bool = False     # experts choose their top C tokens (Zhou et al. 2022); k unused, cf = mean experts

    def __post_init__(self):
        validate_config(self)


def validate_config(moe: MoEConfig, ep: int = 1) -> None:
    """ValueError for a configuration that cannot run: raised when it is made, before any process starts."""
    positive_int("experts (an MoE layer needs at least one expert)", moe.experts)
    if not 1 <= moe.k <= moe.experts:
        raise ValueError(f"top-k={moe.k} must be between 1 and the number of experts ({moe.experts}): "
                         f"a token cannot visit more experts than there are")
    if not moe.capacity_factor > 0:
        raise ValueError(f"capacity factor must be > 0, got {moe.capacity_factor}: every expert needs a slot")
    for name in ("z_loss", "bias_rate"):
        if not getattr(moe, name) >= 0:
            raise ValueError(f"{name} must be ≥ 0 (0 turns it off), got {getattr(moe, name)}")
    if isinstance(moe.shared, bool) or not isinstance(moe.shared, int) or moe.shared < 0:
        raise ValueError(f"shared experts must be a whole number ≥ 0, got {moe.shared!r}")
    positive_int("granularity", moe.granularity)
    if not isinstance(moe.dropless, bool) or not isinstance(moe.expert_choice, bool):
        raise ValueError(f"dropless and expert_choice are True or False, got {moe.dropless!r}, {moe.expert_choice!r}")
    if moe.expert_choice and (moe.dropless or moe.bias_rate):
        raise ValueError("expert choice fills every expert to its capacity by construction: no dropless, no bias")
    positive_int("every", moe.every)
    positive_int("groups", moe.groups)
    if moe.experts % positive_int("ep", ep):
        raise ValueError(f"{moe.experts} experts cannot be spread evenly over an expert-parallel group of "
                         f"{ep} ranks: the number of experts must be divisible by the EP size")


def dispatch(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The buffer (E, C, M): kept token-choices copied to their expert's slot, empty slots zero."""
    e, c = routing.experts, routing.capacity
    token, choice = routing.kept.nonzero(as_tuple=True)
    where = routing.expert[token, choice] * c + routing.slot[token, choice]
    return x.new_zeros(e * c, x.shape[-1]).index_add(0, where, x[token]).view(e, c, -1)


def combine(out: torch.Tensor, routing: Routing, tokens: int) -> torch.Tensor:
    """y (T, M): each token's kept experts' outputs read back from ``out`` (E, C, M), weighted by the gate."""
    c = routing.capacity
    token, choice = routing.kept.nonzero(as_tuple=True)
    where = routing.expert[token, choice] * c + routing.slot[token, choice]
    picked = out.reshape(-1, out.shape[-1])[where] * routing.gate[token, choice].unsqueeze(-1)
    return out.new_zeros(tokens, out.shape[-1]).index_add(0, token, picked)


class MoELayer(nn.Module):
    """Router + E expert FFNs in place of one FFN. After ``forward``: ``routing`` and ``aux_loss``."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.router = nn.Linear(cfg.n_embd, moe.experts, bias=False)
        expert_cfg = expert_config(cfg, moe)
        self.experts = nn.ModuleList(FeedForward(expert_cfg) for _ in range(moe.experts))
        self.shared = nn.ModuleList(FeedForward(expert_cfg) for _ in range(moe.shared))   # empty: no parameters
        self.routing: Routing | None = None
        self.aux_loss = torch.zeros((), device=self.router.weight.device)
        if moe.bias_rate > 0:                     # a buffer: moved and saved with the model, no gradient
            self.register_buffer("routing_bias", torch.zeros(moe.experts, device=self.router.weight.device))

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        bias = getattr(self, "routing_bias", None)
        if self.moe.dropless:      # C = T, the most one expert can be sent: nothing dropped, grouping irrelevant
            self.routing = route(logits, self.moe.k, cap=flat.shape[0], bias=bias)
        else:
            self.routing = route_groups(logits, self.moe.groups, self.moe.k, self.moe.capacity_factor, bias=bias,
                                        expert_choice=self.moe.expert_choice)
        # expert choice is balanced by construction: no balancing loss
        self.aux_loss = logits.new_zeros(()) if self.moe.expert_choice else self.balance_loss(self.routing)
        if self.moe.z_loss:
            self.aux_loss = self.aux_loss + z_loss(logits, self.moe.z_loss)
        out = self.run_experts(dispatch(flat, self.routing))
        y = combine(out, self.routing, flat.shape[0])
        for expert in self.shared:                 # every token, no router, no capacity
            y = y + expert(flat)
        return y.view(shape)

    def balance_loss(self, routing: Routing) -> torch.Tensor:
        return load_balancing_loss(routing, self.moe.alpha, balance_counts(routing))

    def update_bias(self) -> None:
        """Loss-free balancing after a step: b ← b + γ·sign(mean load − load), load = the token-choices each
        expert was given in the last forward (before dropping)."""
        update_bias(self.routing_bias, self.routing.wanted(), self.moe.bias_rate)

    def run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        """Expert e on its slots buffer[e] (C, M)."""
        return torch.stack([expert(buffer[e]) for e, expert in enumerate(self.experts)])


def expert_config(cfg: GPTConfig, moe: MoEConfig) -> GPTConfig:
    """The config of one (routed or shared) expert FFN: hidden size ffn_mult/m · n_embd."""
    if cfg.ffn_mult % moe.granularity:
        raise ValueError(f"granularity {moe.granularity} must divide ffn_mult={cfg.ffn_mult}: each expert's FFN has "
                         f"ffn_mult/granularity · n_embd hidden units")
    return cfg.with_(ffn_mult=cfg.ffn_mult // moe.granularity)


def moe_blocks(n_layer: int, every: int) -> list:
    """The blocks with an MoE FFN: b with (b + 1) % every == 0, the last of each run of ``every``."""
    return [b for b in range(n_layer) if (b + 1) % every == 0]


class MoEGPT(TinyGPT):
    """TinyGPT whose every ``moe.every``-th block (the last of each run of ``every``) has an MoE FFN.

    Parameter names: ``blocks.{b}.mlp.router.weight``, ``blocks.{b}.mlp.experts.{e}.fc.weight``, ..."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), moe: MoEConfig = MoEConfig(), seed: int = 0):
        nn.Module.__init__(self)
        self.cfg, self.moe = cfg, moe
        with torch.random.fork_rng(devices=[]):
            self._build(cfg)
            for b in self.moe_blocks():
                self.blocks[b].mlp = MoELayer(cfg, moe)
        self._init_weights(seed)    # GPT-2's init over every parameter, experts and routers included

    def moe_blocks(self) -> list:
        return moe_blocks(self.cfg.n_layer, self.moe.every)

    def moe_layers(self) -> list:
        return [self.blocks[b].mlp for b in self.moe_blocks()]

    def aux_loss(self) -> torch.Tensor:
        """Σ over MoE layers of their load-balancing loss (+ z-loss) from the last forward."""
        return sum(layer.aux_loss for layer in self.moe_layers())

    def update_routing_bias(self) -> None:
        """After the optimizer step, every MoE layer's loss-free routing bias (``MoEConfig(bias_rate=γ)``)."""
        if self.moe.bias_rate > 0:
            for layer in self.moe_layers():
                layer.update_bias()


def moe_loss(model: MoEGPT, inputs, targets) -> torch.Tensor:
    """Cross-entropy (mean over tokens) + Σ_layers α·E·Σ_i f_i·P_i (+ c_z·mean z²)."""
    return lm_loss(model(inputs), targets) + model.aux_loss()


def moe_recipe(steps: int = 3, batch_size: int = 8, seq_len: int = 16, optimizer: str = "adam",
               seed: int = 0, dtype: torch.dtype = torch.float32, experts: int = 4, k: int = 1,
               capacity_factor: float = 1.25, alpha: float = 1e-2, every: int = 1, groups: int = 1,
               z_loss: float = 0.0, shared: int = 0, granularity: int = 1, dropless: bool = False,
               expert_choice: bool = False, **cfg_changes):
    """The MoE tiny GPT on :func:`minipar.datasets.markov_tokens` (as :func:`minipar.check.gpt_recipe`). No
    ``bias_rate``: a recipe's training loops have no step to update the loss-free bias after (see
    :meth:`MoEGPT.update_routing_bias`)."""
    moe = MoEConfig(experts, k, capacity_factor, alpha, every, groups, z_loss, shared=shared, granularity=granularity,
                    dropless=dropless, expert_choice=expert_choice)
    base = gpt_recipe(steps, batch_size, seq_len, optimizer, seed, **cfg_changes)
    cfg = base.model().cfg
    base.model = lambda: MoEGPT(cfg, moe, seed)
    base.loss, base.dtype = moe_loss, dtype
    shape = (f", {shared} shared" if shared else "") + (f", 1/{granularity}-size experts" if granularity > 1 else "")
    shape += (", dropless" if dropless else "") + (", expert choice" if expert_choice else "")
    base.name = (f"MoE TinyGPT {cfg.n_layer}L/{cfg.n_embd}h, {experts} experts top-{k}{shape}, cf {capacity_factor}, "
                 f"{optimizer}")
    return base


def no_drop_capacity_factor(moe_or_experts, k: int = 1) -> float:
    """The smallest cf with C ≥ T for any T: E/k (no token can ever be dropped)."""
    experts = getattr(moe_or_experts, "experts", moe_or_experts)
    k = getattr(moe_or_experts, "k", k)
    return experts / k
