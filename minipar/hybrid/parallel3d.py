"""Hybrid parallelism: data × pipeline × context × tensor parallelism (+ sequence parallelism, + ZeRO-1) on one mesh
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM";
ZeRO-1 over the data-parallel group as in Rajbhandari et al. 2020, §5 and BLOOM/Megatron-DeepSpeed).

The world is a grid ``torch.arange(dp·pp·tp).view(dp, pp, tp)`` (:class:`minipar.mesh.Mesh`): TP innermost
(neighbouring ranks, one node: it talks every layer), PP next (activations between stages), DP outermost
(gradients once per step). One training step on a rank::

    its 1/dp of the global batch B, cut into m micro-batches of B/(dp·m) rows
    pipeline schedule (gpipe | 1f1b | interleaved) over the pp group: point-to-point activations / gradients
        inside each stage: the TP layers of chapter 05 (f, g all-reduces, or SP all-gather/reduce-scatter)
        last stage: vocabulary-parallel cross-entropy, each micro-batch's loss divided by m
    SP only: all-reduce of the LayerNorm/bias gradients over the tp group
    DP: average the gradients over the dp group (DDP's Reducer), or ZeRO-1: reduce-scatter, step the shard,
        all-gather
    optimizer step

So the gradient is (1/dp) Σ_d (1/m) Σ_i ∇L_{d,i} = ∇ of the global batch's mean loss: single-device
training, up to the order of float summation. Bytes sent per rank per step (b bytes per element, mb = B/(dp·m)
rows per micro-batch, s sequence, h hidden, L_r blocks on this rank, Ψ_r parameters on this rank):

    TP  2(t-1)/t · b · m · [(4·L_r + e_r) · mb·s·h + 3·mb·s·l_r]   (e_r: +1 for the embedding on the first
                                                                    stage, +1 for the head's f on the last;
                                                                    l_r = 1 on the last: the loss's 3 reductions)
    PP  b · m · mb·s·h · (number of stage boundaries this rank sends across, forward and backward)
    DP  2(d-1)/d · b · Ψ_r        (all-reduce, or ZeRO-1's reduce-scatter + all-gather: the same)

Context parallelism (cp > 1, :mod:`.context`): a stage's cp ranks hold s/cp tokens of each row, attend over the
cp group (chapter 06b), and average gradients over dp × cp: DP reads 2(dp·cp−1)/(dp·cp), activations s/cp.

Expert parallelism (ep > 1, :mod:`.experts`): an MoE model's experts spread over ep ranks borrowed from dp × cp
(folded: no extra ranks), all-to-all dispatch/combine, each stage's balancing loss seeded into its own backward,
expert gradients averaged over the expert-data-parallel group (÷ dp·cp), router and dense weights over dp × cp.

Global batch = dp × m × mb (the Hugging Face guide). Nothing here re-implements DDP, a schedule or a TP layer: it composes
:class:`minipar.tensor.gpt.TensorParallelGPT`, :class:`minipar.pipeline.runtime.PipelineRank`,
:class:`minipar.data.ddp.Reducer` and :class:`minipar.data.zero.ZeRO` through the mesh's groups. The loop over the
batches and the launch (``parallel_train``, ``run``, ``HybridRun``) live in :mod:`minipar.hybrid.runner`, which
imports this module.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .. import canonical, comm
from ..invariant_mode import MicroBatchGradients, in_own_mode, validate as validate_invariant
from ..recipe import Recipe
from ..data.ddp import Reducer
from ..data.zero import ZeRO
from ..layout import Layout
from ..loop import mean_over_ranks, shard_batch
from ..memory import tensor_bytes
from ..mesh import Mesh
from ..pipeline.runtime import PipelineRank, synced_clock
from ..pipeline.timeline import timed
from ..pipeline.schedules import make_schedule, validate as validate_schedule
from ..pipeline.stages import stage_layers
from ..tensor import gpt as tp_gpt
from ..tensor.gpt import SequenceShardEmbedding, TensorParallelGPT
from ..tensor.sequence import sync_sequence_parallel_grads
from ..tensor.vocab import vocab_parallel_cross_entropy
from . import context, experts
from .formulas import bytes_formula  # noqa: F401  (the formula beside the step it predicts)

__all__ = ["TRAINER_SCHEDULES", "DEFAULTS", "Layout", "validate", "HybridStage", "Trainer3D",
           "bytes_formula"]

TRAINER_SCHEDULES = ("gpipe", "1f1b", "interleaved")


DEFAULTS = {"micro_batches": 4}      # the 3D trainer's m when the keyword form gives none


def validate(recipe: Recipe, *, world_size: int | None = None, layout: Layout | None = None, invariant=False, **dims):
    """Raise ValueError naming the reason, before any process starts, for a layout that cannot work.
    ``layout``: a :class:`~minipar.layout.Layout`, or its fields as keywords (``dp=2, pp=2, tp=2``);
    ``world_size``: the ranks there are (default: the layout's); ``invariant``: in the invariant mode."""
    layout = Layout.of(layout, DEFAULTS, **dims).check()
    if layout.recompute not in ("none", "full"):
        raise ValueError(f"recompute={layout.recompute!r}: the 3D trainer recomputes whole stages ('full') or "
                         f"nothing ('none'); selective recomputation is chapter 11's")
    dp, pp, cp, tp, zero, schedule, micro_batches, v, sp = (getattr(layout, k) for k in (
        "dp", "pp", "cp", "tp", "zero", "schedule", "micro_batches", "v", "sp"))
    Mesh(layout.world_size if world_size is None else world_size, **layout.sizes)   # the mesh's own size check
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0 (plain data parallelism) or a ZeRO stage 1, 2 or 3, got {zero!r}")
    if schedule not in TRAINER_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(TRAINER_SCHEDULES)}")
    model = recipe.model()
    cfg = model.cfg
    if cfg.tie_weights and pp > 1:
        raise ValueError("tied embedding and head weights live on the first and the last stage: use "
                         "tie_weights=False with pipeline parallelism")
    validate_schedule(schedule, pp, micro_batches, v, n_layers=cfg.n_layer)
    batch, seq = recipe.batches[0][0].shape
    if invariant:
        validate_invariant(layout, cfg, batch, seq, moe=getattr(model, "moe", None) is not None)
    context.validate(layout, cfg, seq)
    experts.validate(layout, model)
    tokens = batch // (dp * micro_batches) * (seq // layout.cp)
    if getattr(model, "moe", None) is not None and tp > 1 and tokens % tp:
        raise ValueError(f"an MoE model with tp={tp}: the MoE layer splits each micro-batch's {tokens} tokens over "
                         f"the tp ranks, which needs a token count divisible by tp")
    tp_gpt.validate(cfg, tp=tp, seq_len=seq // cp, sequence_parallel=sp)
    if batch % (dp * micro_batches):
        raise ValueError(f"a global batch of {batch} rows cannot be cut into dp × m = {dp} × {micro_batches} "
                         f"equal micro-batches (global batch = dp × m × micro-batch size)")


class HybridStage(SequenceShardEmbedding, nn.Module):
    """Pipeline stage ``index`` of ``n_stages`` cut from a :class:`TensorParallelGPT` (the layers
    :func:`minipar.pipeline.stages.stage_layers` gives it, as for a reference model): its TP blocks, plus the
    embeddings (first stage, the model's embedding seam) and the final LayerNorm and vocabulary-parallel head
    (last stage)."""

    def __init__(self, model: TensorParallelGPT, index: int, n_stages: int, token_positions=None):
        super().__init__()
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        self.cfg, self.group, self.sequence_parallel = model.cfg, model.group, model.sequence_parallel
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[stage_layers(model.cfg.n_layer, n_stages)[index]])   # the one cut
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head
        names = {id(p): n for n, p in model.named_parameters()}
        self.reference_names = {id(p): names[id(p)] for p in self.parameters()}
        self.token_positions = token_positions   # context parallelism: the global positions of this rank's tokens

    def positions_held(self, idx):
        if self.token_positions is None:
            return super().positions_held(idx)
        held = self.token_positions.to(idx.device)     # SP: this TP rank's chunk of them, as SequenceShardEmbedding
        return held.chunk(tp_gpt.tp_size(self.group))[tp_gpt.tp_rank(self.group)] if self.sequence_parallel else held

    def forward(self, x):
        if self.first:                                  # token ids -> hidden states (TensorParallelGPT's seam)
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x)) if self.last else x   # the last stage: vocabulary-sharded logits


class Trainer3D:
    """One rank of a dp × pp × cp × tp run (ep folded over dp × cp × tp): builds the groups, the TP model (its MoE
    layers' expert slices: ``experts``, None for a dense model), this rank's stages, the schedule and the DP
    reduction (or ZeRO-1), then ``step(inputs, targets)`` trains on one global batch.

    ``device``: where this rank computes ("cpu" with gloo, "cuda:<local rank>" with NCCL). The model is built
    on the CPU (the reference's initial weights), then moved; everything a step creates that meets a
    collective or a parameter is created there (receive buffers, batch shards, the loss, dropout streams).
    ``invariant``: every step runs in the invariant mode (:mod:`minipar.invariant_mode`; each rank enters it)."""

    def __init__(self, rank: int, world_size: int, recipe: Recipe, *, layout: Layout | None = None, device="cpu",
                 invariant: bool = False, **dims):
        self.layout = layout = Layout.of(layout, DEFAULTS, **dims)
        dp, pp, tp, sp, zero, schedule, micro_batches, v = (getattr(layout, k) for k in (
            "dp", "pp", "tp", "sp", "zero", "schedule", "micro_batches", "v"))
        self.recipe, self.m, self.zero_stage, self.device = recipe, micro_batches, zero, torch.device(device)
        self.mesh = Mesh(world_size, **layout.sizes).build(rank)
        # gradients (and loss) averaged over dp × cp (group("dp") if cp = 1); invariant: token sums finish over cp
        self.dp_group, self.cp_group, self.tp_group = (self.mesh.group(*d) for d in (("dp", "cp"), ("cp",), ("tp",)))
        ref = recipe.model().to(self.device, recipe.dtype)     # built on the CPU; TP shards, dropout streams follow
        self.full_shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
        batch, seq = recipe.batches[0][0].shape
        # In a straight line: first what replaces what in the reference (the MoE layers by their expert-parallel
        # slices over the folded ep groups; the attention core by the cp method's), then the tensor-parallel
        # model (it keeps both), then this rank's stages cut from it, then what the step needs.
        self.experts = experts.install(ref, self.mesh, layout, self.dp_group)
        self.positions = context.install(ref, self.mesh, layout, seq)      # my tokens' global positions (cp)
        self.model = TensorParallelGPT(ref, self.tp_group, sp)
        n_stages, sched = pp * v, make_schedule(schedule, pp, micro_batches, v)
        self.stages = {s: HybridStage(self.model, s, n_stages, self.positions)
                       for s in sched.stages_of(self.mesh.coord("pp"))}
        self.params = [p for s in self.stages.values() for p in s.parameters()]
        if self.experts:                                          # only the MoE layers of my stages
            self.experts.keep(m for s in self.stages.values() for m in s.modules() if m in self.experts.layers)
        self.names = {k: n for s in self.stages.values() for k, n in s.reference_names.items()}
        seq //= layout.cp                                         # the tokens this rank holds of each row
        mb = batch // (dp * micro_batches)
        act = ((mb, seq // tp if sp else seq, ref.cfg.n_embd), recipe.dtype)
        shapes = [((mb, seq), torch.long)] + [act] * (n_stages - 1)
        self.vocab_size = ref.cfg.vocab_size
        self.pipeline = timed(PipelineRank)(sched, self.stages, self.mesh, shapes,   # this rank's pipeline part
                                            recompute=layout.recompute == "full",     # checkpointed stages
                                            t0=synced_clock(None, self.device),       # one time axis
                                            device=self.device, loss_fn=self.loss)
        skip = self.experts.ids if self.experts else set()        # experts: reduced over expert-DP instead
        dense = [p for p in self.params if id(p) not in skip]
        if zero:       # ZeRO-1/2/3 over dp × cp, one unit per stage, collectives once per step (not per micro-batch)
            units = [experts.DenseParams(s, skip) if skip else s for s in self.stages.values()]
            self.zero = ZeRO(nn.ModuleList(units), recipe.optimizer, zero, self.dp_group, units=units,
                             once_per_step=True)
            self.optimizer, self.reducer = self.zero.optimizer, None
            if self.experts and self.experts.params:              # experts outside the shards: their own
                self.experts.optimizer = recipe.optimizer(self.experts.params)
        else:
            self.zero, self.optimizer = None, recipe.optimizer(self.params)
            self.reducer = Reducer(dense, self.dp_group) if dp * layout.cp > 1 else None
        self.dense_params = dense
        mine = set(map(id, self.params))
        self.sp_params = [p for p in self.model.sequence_parallel_params() if id(p) in mine]
        self.logs = {k: comm.CommLog(mesh=self.mesh.mesh) for k in ("pp+tp", "dp")}   # records name their dims
        self.steps_taken = 0
        # the invariant mode: the micro-batches' gradients kept apart, then summed as a tree
        self.invariant, self.mb_grads = invariant, MicroBatchGradients(self.params) if invariant else None

    def loss(self, logits, targets):
        """The last stage's loss: vocabulary-parallel cross-entropy over the TP group (the logits stay split
        by vocabulary columns), the mean over the micro-batch's tokens (the runtime divides it by m)."""
        per_token = vocab_parallel_cross_entropy(logits, targets, self.tp_group, self.vocab_size)
        return canonical.mean(per_token) if self.invariant else per_token.mean()

    @property
    def coords(self) -> dict:                                  # {dimension: coordinate}, by name
        return dict(self.mesh.coords)

    def zero_grad(self) -> None:
        if self.experts and self.experts.optimizer:
            self.experts.optimizer.zero_grad(set_to_none=True)
        if self.zero is not None:
            self.zero.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    @in_own_mode                                               # the steps run in the mode self.invariant says
    def step(self, inputs, targets, index: int | None = None):
        """One optimizer step on global batch (inputs, targets); returns the global mean loss on the last
        stage's ranks, None elsewhere. ``index``: the global step (a resumed run passes it; by default the
        steps this trainer took), which seeds the dropout masks and labels the timeline."""
        step = self.steps_taken if index is None else index
        x, y = (t.to(self.device) for t in shard_batch((inputs, targets), self.mesh.coord("dp"), self.mesh.size("dp")))
        if self.positions is not None:                            # context parallelism: my tokens of every row
            x, y = x[:, self.positions.to(self.device)], y[:, self.positions.to(self.device)]
        self.zero_grad()
        self.model.streams.start_step(step)                      # dropout masks: a function of (seed, step)
        self.steps_taken = step + 1
        if self.zero_stage == 3:
            with comm.recording(self.logs["dp"]):
                self.zero.gather_for_step()                      # the full parameters, for all m micro-batches
        with comm.recording(self.logs["pp+tp"]):                  # pipeline messages + the TP collectives
            loss = self.pipeline.run(list(x.chunk(self.m)), list(y.chunk(self.m)), index or 0)
            if self.mb_grads:                                    # invariant: SP's sums were done in backward
                self.mb_grads.finish()
            elif self.sp_params:                                 # SP: LayerNorm/bias gradients summed over tp
                sync_sequence_parallel_grads(self.sp_params, self.tp_group)
            if self.experts and self.layout.tp > 1:              # MoE: each tp rank routed 1/t of the rows
                sync_sequence_parallel_grads(self.experts.router_params, self.tp_group)
        with comm.recording(self.logs["dp"]):                     # gradients over the data-parallel group
            if self.experts:
                self.experts.reduce_gradients()                  # ÷ dp·cp, all-reduce over expert-DP
                if self.experts.optimizer:
                    self.experts.optimizer.step()
            if self.zero is not None:
                self.zero.step()                                 # reduce-scatter, step my shard, all-gather
            else:
                if self.reducer is not None:
                    for p in self.dense_params:
                        self.reducer.grad_ready(p)
                    self.reducer.finish()                        # bucketed all-reduce, averaged over dp
                self.optimizer.step()
        if self.experts:                                          # the stages' balancing losses, onto the loss
            with comm.recording(self.logs["pp+tp"]):
                self.experts.update_bias()                       # loss-free balancing: after the step
            loss = self.experts.add_aux(loss, self.mesh.group("pp"), self.device)
        if loss is None:
            return None
        # float64: mean_over_ranks would turn a Python float into float32 (invariant: the float32 one device's tree
        # gave, which the float holds exactly)
        loss = torch.tensor(loss, dtype=torch.float32 if self.invariant else torch.float64, device=self.device)
        return mean_over_ranks(loss, self.dp_group)

    def readable_params(self):
        """A context in which this rank's parameters hold their values: ZeRO-3 frees them between steps, so
        there it all-gathers them over dp × cp (a collective) and frees them after; elsewhere it does nothing."""
        return self.zero.gathered() if self.zero_stage == 3 else contextlib.nullcontext()

    def full_params(self) -> dict:
        """{reference name: full CPU tensor} of this rank's stages (TP shards gathered: a collective over tp)."""
        mine = set(self.names.values())
        with self.readable_params():
            full = self.model.full_state_dict()
            # clone: with tp = 1 full_state_dict hands back row-parallel weights themselves (all_gather_dim
            # returns its input), which the next optimizer step (or ZeRO-3's free) would change under the caller
            return {n: t.to("cpu", copy=True) for n, t in full.items() if n in mine}

    def measured_state_bytes_total(self) -> int:
        """Parameters + gradients + optimizer state this rank holds, measured from its tensors (bytes)."""
        states = [*self.optimizer.state.values(), *(self.experts.optimizer.state.values()
                                                    if self.experts and self.experts.optimizer else [])]
        opt = [v for st in states for v in st.values() if torch.is_tensor(v)]
        grads = [p.grad for p in self.params if p.grad is not None]
        units = self.zero.units if self.zero else []
        # storages counted once: ZeRO-1/2's FP32 master shards (and ZeRO-1's shard gradients) are views of the
        # full buffers; ZeRO-3's master shards and ZeRO-2/3's shard gradients are storages of their own
        masters = [u.master for u in units]
        grads += [u.master.grad for u in units if u.master.grad is not None]
        return tensor_bytes([*self.params, *masters]) + tensor_bytes(opt) + tensor_bytes(grads)
