"""Expert parallelism inside the hybrid trainer: the fifth dimension, *folded* into dp × cp × tp (Megatron-Core's
MoE parallel folding with expert-TP = 1, its expert-data-parallel groups and ``MoEAuxLossAutoScaler``;
torchtitan's EP, which borrows tp ranks too), on the layers of chapter 09 (:mod:`minipar.moe`: Lepikhin et al.
2020, GShard, arXiv:2006.16668; Fedus et al. 2021, Switch Transformers, arXiv:2101.03961).

The model is :class:`minipar.moe.layer.MoEGPT`: dense attention, an MoE FFN in every ``every``-th block. On a
rank of the dp × pp × cp × tp mesh:

* **Tokens over tp.** Attention is tensor-parallel, so the t ranks of a TP group hold the *same* tokens
  after it. The MoE layer takes rank i's i-th 1/t of the micro-batch's tokens (rows × positions, flattened:
  :func:`~minipar.tensor.operators.split_to_tp`; backward: all-gather of the gradients) and all-gathers the
  outputs after (backward: keep my tokens), so the n = dp·cp·tp ranks of a stage route different tokens. An earlier design kept the MoE FFN whole on every tp
  rank: each expert then existed t times and every token was computed t times (expert FLOPs and memory ×t).
* **Groups.** The n ranks of a stage, sorted ascending (dp outer, tp inner), are cut into n/ep **ep groups**
  of ep consecutive ranks (the all-to-all: tp neighbours first, Megatron's folding) and ep
  **expert-data-parallel groups**, the strided sets ``ranks[j::ep]`` (an expert's replicas): ep × expert-DP
  partitions every stage's token group exactly (:func:`expert_groups`, tested).
* **Experts.** Rank j of its ep group holds experts j·E/ep … (j+1)·E/ep − 1 of every MoE layer of its stages,
  under their reference names (``blocks.1.mlp.experts.3.fc.weight``), so ``full_params()`` sees experts as
  pipeline stages see blocks. Expert-TP = 1: an expert is whole where it lives. The router is replicated over
  tp and sees only its rank's rows, so its gradient is summed over tp (as SP's LayerNorms are).
* **Forward** (chapter 09): route the rank's T = mb·s/cp tokens, capacity C = ⌈k·T/E·cf⌉ per expert, dispatch
  buffer (E, C, h), all-to-all over the ep group, local experts, all-to-all back, combine. Dropless
  (``MoEConfig(dropless=True)``, ``train --dropless``): :class:`HybridDroplessLayer`, no capacity, the uneven
  all-to-alls of :mod:`minipar.moe.dropless` (their split sizes exchanged first).
* **Balancing loss.** f_i counts first choices over the whole micro-batch (an all-reduce of E counts over the
  stage's dp × cp × tp token group), P_i is the rank's own mean; the aux loss lives in every stage that has MoE
  layers, so it enters the backward through :class:`AuxLossInBackward` (Megatron's ``MoEAuxLossAutoScaler``):
  identity on the activations, whose backward also seeds ∂aux = 1/(m·t) (the t ranks of a TP group share one
  data-parallel rank's loss). Averaged over dp × cp with the rest: (1/m)·Σ_i α·E·Σ_e f_e(i)·P̄_e(i), the loss of
  one device that accumulates m micro-batches (:func:`reference_loss`).
* **Gradients.** Dense and router: the trainer's Reducer (or ZeRO-1) over dp × cp, ÷ dp·cp. Experts: an
  all-reduce over the expert-DP group, **÷ dp·cp, not ÷ expert-DP** (an expert's gradient already sums its ep
  group's tokens; chapter 09's "divide by W, not dp"). With ZeRO-1 the experts stay outside the shards (their
  own optimizer, replicated over expert-DP).

Bytes per rank per step (b bytes per element, m micro-batches, L_e MoE layers on the rank), the log naming each
kind by a tag: ``ep`` = m·L_e·4·(ep−1)/ep·E·C·h·b (dispatch + combine, forward and backward; C from a rank's
mb·s/(cp·t) tokens); ``edp`` = 2(n_e−1)/n_e·b·Ψ_experts (n_e = dp·cp·tp/ep); ``balance`` = m·L_e·2(n−1)/n·E·b (the
f counts); and on tp, 2·(t−1)/t·mb·(s/cp)·h·b per MoE layer and micro-batch (the outputs' all-gather and the
inputs' gradient all-gather), counted by :func:`minipar.hybrid.formulas.bytes_formula`.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..loop import lm_loss
from ..mesh import Mesh
from ..moe.dropless import DroplessMoE
from ..moe.expert_parallel import ExpertParallelMoE
from ..moe.layer import MoEGPT, MoELayer, moe_recipe, no_drop_capacity_factor, validate_config
from ..tensor.operators import gather_from_tp, split_to_tp

__all__ = ["Tag", "validate", "expert_groups", "AuxLossInBackward", "HybridExpertLayer", "HybridDroplessLayer",
           "Experts", "install", "DenseParams", "reference_loss", "hybrid_moe_recipe", "RoutingMismatch"]


class Tag:
    """A stand-in mesh for :func:`minipar.comm.recording`: every record of a group of > 1 ranks spans ``dims``
    (the folded groups span dp and/or cp of the dense mesh, so the log names them by what they carry)."""

    def __init__(self, *dims: str):
        self.dims = dims

    def dims_spanned(self, ranks) -> tuple:
        return self.dims if len(set(ranks)) > 1 else ()


def validate(layout, model) -> None:
    """ValueError, before any process starts, for an MoE/ep layout the hybrid trainer cannot run."""
    moe = getattr(model, "moe", None) if isinstance(model, MoEGPT) else None
    if moe is None:
        layout.refuse("ep", why="expert parallelism needs a mixture-of-experts model (--experts > 0)")
        return
    validate_config(moe, layout.ep)                                        # E divisible by ep, 1 ≤ k ≤ E, cf > 0
    if moe.expert_choice:
        raise ValueError("expert-choice routing runs under chapter 09's expert parallelism, not yet in this trainer")
    if moe.bias_rate > 0 and layout.micro_batches > 1:
        raise ValueError("loss-free balancing moves its bias from one forward's load: with micro_batches > 1 each "
                         "rank would see only its last micro-batch's; use micro_batches=1")
    if layout.sp:
        raise ValueError("sequence parallelism with an MoE model: the MoE layer splits a TP group's tokens over tp "
                         "itself; SP's sequence shards are not built for it; drop sp")
    if layout.recompute != "none":
        raise ValueError(f"recompute={layout.recompute!r} with an MoE model: the recomputed forward would repeat "
                         f"the routing's collectives and count the balancing loss twice; use recompute='none'")
    if model.cfg.dropout:
        raise ValueError(f"dropout = {model.cfg.dropout} with an MoE model: the replicated experts would draw "
                         f"different masks on the tp ranks than one device; use dropout = 0")


def expert_groups(mesh: Mesh, ep: int) -> list:
    """For every stage's token group of the mesh (its dp × cp × tp ranks, one per pp): (its ep groups, its
    expert-DP groups); ep groups are consecutive chunks of ep of its sorted ranks, expert-DP groups the strided
    sets."""
    out = []
    for dense in mesh.groups("dp", "cp", "tp"):
        ranks = sorted(dense)
        out.append(([ranks[i:i + ep] for i in range(0, len(ranks), ep)], [ranks[j::ep] for j in range(ep)]))
    return out


class AuxLossInBackward(torch.autograd.Function):
    """``forward(x, aux, scale)`` = x; backward passes ∂x through and seeds ∂aux = ``scale`` (Megatron-Core's
    MoEAuxLossAutoScaler): a stage's balancing loss joins the backward without reaching the last stage."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class HybridExpertLayer(ExpertParallelMoE):
    """Chapter 09's :class:`ExpertParallelMoE` on the folded groups: experts keyed by their global index
    (``experts.3``), the all-to-alls and counts tagged in the log (:meth:`log_mesh`), the aux loss joined to the
    backward with ``aux_scale`` (1/m); ``aux_values`` collects each forward's aux loss (for the reported loss)."""

    def __init__(self, layer: MoELayer, ep_rank: int, ep: int, ep_group, token_group, tp_group=None):
        super().__init__(layer, ep_rank, ep, ep_group, token_group)
        self.experts = nn.ModuleDict({str(self.first + j): e for j, e in enumerate(self.experts)})
        self.aux_scale, self.aux_values = 1.0, []
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None

    def forward(self, x):
        shape = x.shape
        if self.tp_group is not None:          # my 1/t of the TP group's tokens (they all hold the same ones)
            x = split_to_tp(x.reshape(-1, shape[-1]), self.tp_group, dim=0)
        out = super().forward(x)
        self.aux_values.append(self.aux_loss.detach())
        out = AuxLossInBackward.apply(out, self.aux_loss, self.aux_scale)
        return gather_from_tp(out, self.tp_group, dim=0).view(shape) if self.tp_group is not None else out

    def log_mesh(self, kind):
        """The folded groups' exchanges are logged by what they carry: ``Tag("ep")``, ``Tag("balance")``."""
        return Tag(kind)


class HybridDroplessLayer(HybridExpertLayer, DroplessMoE):
    """:class:`HybridExpertLayer` whose MoE forward is :class:`minipar.moe.dropless.DroplessMoE` 's: no capacity."""


class Experts:
    """A rank's expert side: its :class:`HybridExpertLayer` s, expert parameters, groups, and the gradient
    reduction (÷ ``divisor`` = dp·cp, then all-reduce over expert-DP)."""

    def __init__(self, layers: list, ep_group, edp_group, divisor: int, micro_batches: int, tp_group=None):
        self.ep_group, self.edp_group, self.divisor, self.tp_group = ep_group, edp_group, divisor, tp_group
        self.optimizer = None                   # ZeRO-1: the experts' own optimizer (outside the shards)
        self.ep_rank, self.edp_rank = 0, 0      # this rank's place in its ep and expert-DP groups (install)
        t = dist.get_world_size(tp_group) if tp_group is not None else 1
        for layer in layers:
            layer.aux_scale = 1.0 / (micro_batches * t)    # t ranks share one data-parallel rank's loss
        self.keep(layers)

    def keep(self, layers) -> "Experts":
        """Hold only ``layers`` (the MoE layers of this rank's pipeline stages)."""
        self.layers = list(layers)
        self.params = [p for layer in self.layers for p in layer.experts.parameters()]
        self.ids = set(map(id, self.params))
        # the routers and shared experts see only their rank's rows when tp > 1: their gradients are summed over tp
        self.router_params = [p for layer in self.layers for m in (layer.router, layer.shared) for p in m.parameters()]
        return self

    def reduce_gradients(self) -> None:
        """g_expert ← Σ_{expert-DP replicas} g / (dp·cp): the loss is the mean over the dp·cp token-holding ranks,
        and an expert's gradient already sums its ep group's tokens (÷ expert-DP would be ep× too large)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        for g in grads:
            g.div_(self.divisor)
        if grads and self.edp_group is not None:
            with comm.recording(mesh=Tag("edp")):
                comm.all_reduce_flat(grads, group=self.edp_group)

    def update_bias(self) -> None:
        """Loss-free balancing (``bias_rate > 0``) after the step: each layer's bias moved by the load of its
        token group (an all-reduce of E counts: :meth:`minipar.moe.expert_parallel.ExpertParallelMoE.update_bias`)."""
        for layer in self.layers:
            if layer.moe.bias_rate > 0:
                layer.update_bias()

    def add_aux(self, loss, pp_group, device):
        """``loss`` (the last stage's, or None) + the step's aux losses of every stage: a sum over the pp group,
        outside the step's recordings (reporting, not training)."""
        aux = torch.tensor(self.aux_total(), dtype=torch.float64, device=device)
        for group in (pp_group, self.tp_group):              # every stage's, and (tp > 1) every row share's
            if group is not None and dist.get_world_size(group) > 1:
                comm.all_reduce(aux, group=group)
        return None if loss is None else loss + float(aux)

    def aux_total(self) -> float:
        """Σ of this rank's aux losses of the last step, each × 1/m (then cleared)."""
        total = sum(float(v) * layer.aux_scale for layer in self.layers for v in layer.aux_values)
        for layer in self.layers:
            layer.aux_values.clear()
        return total


def install(model, mesh, layout, dense_group) -> Experts | None:
    """Replace the MoE layers of ``model`` (an MoEGPT, before tensor parallelism splits it: its blocks keep an
    MoE layer whole) by their expert-parallel slices on this rank (every rank creates every folded group, in
    the same order); None for a dense model."""
    if not any(isinstance(b.mlp, MoELayer) for b in model.blocks):
        return None
    ep, n_e, rank = layout.ep, layout.expert_data_parallel, mesh.rank
    tp_group = mesh.group("tp") if layout.tp > 1 else None
    token_group = mesh.group("dp", "cp", "tp") if layout.tp > 1 else dense_group   # a stage's distinct tokens
    plan = expert_groups(mesh.mesh, ep)
    ep_group, my_ep = None, next(r for ep_sets, _ in plan for r in ep_sets if rank in r)
    if ep > 1:
        for ranks in (r for ep_sets, _ in plan for r in ep_sets):          # every ep group, on every rank
            group = dist.new_group(ranks)
            if rank in ranks:
                ep_group = group
    edp_group, my_edp = None, next(r for _, edp_sets in plan for r in edp_sets if rank in r)
    if n_e > 1 and ep == 1:                                               # expert-DP is the token group itself
        edp_group = token_group
    elif n_e > 1:
        for ranks in (r for _, edp_sets in plan for r in edp_sets):       # then every expert-DP group
            group = dist.new_group(ranks)
            if rank in ranks:
                edp_group = group
    layers = []
    for block in model.blocks:
        if isinstance(block.mlp, MoELayer):
            kind = HybridDroplessLayer if block.mlp.moe.dropless else HybridExpertLayer
            block.mlp = kind(block.mlp, my_ep.index(rank), ep, ep_group, token_group, tp_group)
            layers.append(block.mlp)
    held = Experts(layers, ep_group, edp_group, layout.dp * layout.cp, layout.micro_batches, tp_group)
    held.ep_rank, held.edp_rank = my_ep.index(rank), my_edp.index(rank)     # the checkpoint's writer rule
    return held


class DenseParams(nn.Module):
    """A stage's non-expert parameters (the same tensors): what ZeRO-1 shards over dp × cp."""

    def __init__(self, stage: nn.Module, skip: set):
        super().__init__()
        self.held = nn.ParameterList([p for p in stage.parameters() if id(p) not in skip])


def reference_loss(dp: int, micro_batches: int):
    """One device's loss for a dp × m run: global micro-batch i = every dp rank's i-th micro-batch, and the
    loss is (1/m)·Σ_i (cross-entropy of i + its balancing losses, f counted over micro-batch i)."""
    def loss(model, inputs, targets):
        rows, seq = inputs.shape[0] // (dp * micro_batches), inputs.shape[1]
        x, y = (t.reshape(dp, micro_batches, rows, seq) for t in (inputs, targets))
        total = 0.0
        for i in range(micro_batches):
            xi, yi = x[:, i].reshape(dp * rows, seq), y[:, i].reshape(dp * rows, seq)
            total = total + (lm_loss(model(xi), yi) + model.aux_loss()) / micro_batches
        return total
    return loss


def hybrid_moe_recipe(layout, *, steps: int = 3, batch_size: int = 8, seq_len: int = 16, experts: int = 4,
                      k: int = 1, capacity_factor: float = 1.25, alpha: float = 1e-2, every: int = 1,
                      optimizer: str = "adam", dtype=torch.float64, seed: int = 0, bias_rate: float = 0.0, **cfg):
    """The MoE tiny GPT whose one-device loss is the hybrid run's (:func:`reference_loss`), trained with
    ``optimizer`` ("adam" or "sgd", as :func:`minipar.check.gpt_recipe`). With cp = 1 the reference
    routes each micro-batch in dp·tp groups (``MoEConfig(groups=dp·tp)``), the ranks' own token sets (contiguous
    in the flattened micro-batch), so they agree even when tokens are dropped. With cp > 1 a rank's tokens are no contiguous group, so the one-device comparison
    needs a no-drop capacity, cf ≥ E/k (or ``dropless=True``): a smaller cf warns (:class:`RoutingMismatch`).
    ``bias_rate`` > 0: loss-free balancing, whose bias the trainer moves after each step; ``train_reference`` does
    not move it, :func:`minipar.moe.expert_parallel.loss_free_reference` does."""
    if layout.cp > 1 and capacity_factor < no_drop_capacity_factor(experts, k) and not cfg.get("dropless"):
        warnings.warn(f"cp = {layout.cp} with capacity factor {capacity_factor} < E/k = {experts / k:g}: tokens "
                      f"may be dropped, and the one-device reference routes them differently from the run; "
                      f"compare with cf ≥ {experts / k:g}", RoutingMismatch, stacklevel=2)
    groups = layout.dp * layout.tp if layout.cp == 1 else 1      # each rank's tokens: one routing group
    recipe = moe_recipe(steps, batch_size, seq_len, optimizer, seed, dtype, experts, k, capacity_factor, alpha,
                        every, groups, **cfg)
    recipe.loss = reference_loss(layout.dp, layout.micro_batches)
    if bias_rate:
        model = recipe.model()
        cfg, moe = model.cfg, dataclasses.replace(model.moe, bias_rate=bias_rate)
        recipe.model = lambda: MoEGPT(cfg, moe, seed)
        recipe.name += f", loss-free γ {bias_rate:g}"
    return recipe


class RoutingMismatch(UserWarning):
    """:func:`hybrid_moe_recipe`'s reference cannot route as the run does (cp > 1 with dropping possible)."""
