"""Equal to the last bit: the first tensor where two layouts of one training run part, by how many ULPs, and
which reduction's order made it.

Float addition is not associative: ``(a + b) + c`` and ``a + (b + c)`` can differ in the last bit. Every
dimension a layout splits changes the order of some sum — tokens across DP ranks and micro-batches (the weight
gradients' sum over tokens), the inner dimension across TP ranks (the row-parallel linear's partial sums, then
an all-reduce), the vocabulary across TP ranks (the softmax's Σ exp), keys across CP ranks (ring attention's
online-softmax merge of key blocks). A correct parallel run therefore leaves one device by a few ULPs, and
:func:`minipar.debug.first_departure.first_departure` at tolerance 0 says *where* first.

:func:`capture` trains a recipe with the hybrid trainer (:class:`minipar.hybrid.parallel3d.Trainer3D`) under a
:class:`~minipar.layout.Layout` and keeps, for every step, in execution order: the forward's activations
(the embedding; per block the attention core, the attention's and the MLP's output projections, the block's
output; the final LayerNorm, the logits, the per-token loss, the loss), the backward's parameter gradients
after every reduction (reverse model order), and the parameters after the optimizer step. Each rank records
its pieces with the global rows, positions, heads and vocabulary columns they hold; the pieces are put back
into whole tensors, so two layouts compare element by element. :func:`first_difference` walks both in that
order with :func:`~minipar.debug.first_departure.first_departure` at tolerance 0 and names the first tensor that differs.

ULP distance (units in the last place): float32 bits read as int32, negative floats mapped to
``−2³¹ − bits`` so that the integers are ordered like the floats; the distance is the integers' difference
(Goldberg 1991, "What every computer scientist should know about floating-point arithmetic", §1.2; the same
ordering as Bruce Dawson's "Comparing floating point numbers", 2012). Neighbouring floats are 1 ULP apart
whatever their exponent; ``+0`` and ``−0`` are 0 apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hybrid.parallel3d import Trainer3D, validate
from ..launcher import launch
from ..layout import Layout
from ..recipe import Recipe
from ..tensor.operators import tp_rank, tp_size
from ..tensor.vocab import vocab_parallel_cross_entropy
from .first_departure import first_departure

__all__ = ["ulp_distance", "capture", "Capture", "Difference", "first_difference", "reduction_for"]

_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |ordered(a) − ordered(b)| as int64 (float32 and float64 exactly; see the docstring)."""
    if a.dtype != b.dtype or a.dtype not in _INT:
        raise ValueError(f"ULP distance needs two tensors of one floating dtype, got {a.dtype} and {b.dtype}")
    lowest = torch.iinfo(_INT[a.dtype]).min

    def ordered(t):
        bits = t.detach().contiguous().view(_INT[t.dtype]).long()
        return torch.where(bits < 0, lowest - bits, bits)
    return (ordered(a) - ordered(b)).abs()


# Capture: every rank's pieces, with where they sit in the whole tensor --------------------------------------

def _points(cfg, names) -> list:
    """(tensor name, op) in execution order: forward, backward (reverse model order), optimizer step."""
    forward = [("embedding", "tok_emb + pos_emb")]
    for i in range(cfg.n_layer):
        forward += [(f"blocks.{i}.attn.core", "attention core softmax(QKᵀ/√d)V"),
                    (f"blocks.{i}.attn.proj", "attention output Linear (row-parallel under tp)"),
                    (f"blocks.{i}.mlp.proj", "MLP output Linear (row-parallel under tp)"),
                    (f"blocks.{i}", "residual add (the block's output)")]
    forward += [("ln_f", "final LayerNorm"), ("head", "LM head Linear (logits)"),
                ("loss per token", "cross-entropy of each token"), ("loss", "mean over the batch's tokens")]
    return ([("forward " + n, op) for n, op in forward] + [(f"backward {n}.grad", "gradient") for n in names[::-1]]
            + [("step " + n, "optimizer step") for n in names])


class _Recorder:
    """Installed on one rank's Trainer3D: forward hooks on the activations, the loss function wrapped, the
    optimizer's step preceded by the gradients; ``pieces``: (name, tensor, {dim: (whole size, indices)})."""

    def __init__(self, trainer):
        self.t, self.pieces, self.calls = trainer, [], {}
        layout, cfg = trainer.layout, trainer.model.cfg
        batch, seq = trainer.recipe.batches[0][0].shape
        self.batch, self.seq, self.heads, self.vocab = batch, seq, cfg.n_head, cfg.vocab_size
        self.mb = batch // (layout.dp * layout.micro_batches)
        t, r = tp_size(trainer.tp_group), tp_rank(trainer.tp_group)
        held = trainer.positions if trainer.positions is not None else torch.arange(seq)
        self.positions = held                                   # the core, the logits and the loss: whole s/cp
        self.seq_shard = held.chunk(t)[r] if layout.sp else held   # SP: the tokens between the blocks
        self.my_heads = torch.arange(r * cfg.n_head // t, (r + 1) * cfg.n_head // t)
        model = trainer.model
        hidden = [("embedding", model.blocks[0], True)] + [
            (f"blocks.{i}{part}", getattr(b, sub) if sub else b, False)
            for i, b in enumerate(model.blocks) for part, sub in ((".attn.proj", "attn"), (".mlp.proj", "mlp"),
                                                                    ("", None))] + [("ln_f", model.head, True)]
        for name, module, pre in hidden:
            if pre:      # the embedding: block 0's input; ln_f's output: the head's (ln_f may run as a function)
                module.register_forward_pre_hook(lambda m, args, n=name: self.keep(n, args[0], 1, self.seq_shard))
            else:
                module.register_forward_hook(lambda m, args, out, n=name: self.keep(n, out, 1, self.seq_shard))
        model.head.register_forward_hook(lambda m, args, out: self.keep_logits(out, r * out.shape[-1]))
        for i, block in enumerate(model.blocks):
            block.attn.attention = self.wrap_core(f"blocks.{i}.attn.core", block.attn.attention)
        self.loss_fn, trainer.pipeline.loss_fn = trainer.pipeline.loss_fn, self.loss
        self.opt_step, trainer.optimizer.step = trainer.optimizer.step, self.step

    def rows(self, name):
        """The global batch rows of this call's micro-batch: DP shard, then micro-batches in order (every schedule
        runs a stage's forwards in micro-batch order; recomputation, which runs them twice, is refused)."""
        i = self.calls[name] = self.calls.get(name, -1) + 1
        start = self.t.mesh.coord("dp") * (self.batch // self.t.layout.dp) + i * self.mb
        return torch.arange(start, start + self.mb)

    def keep(self, name, tensor, seq_dim, positions, more=None):
        where = {0: (self.batch, self.rows(name)), seq_dim: (self.seq, positions), **(more or {})}
        self.pieces.append((name, tensor.detach().to("cpu", copy=True), where))

    def keep_logits(self, out, first_column):
        columns = torch.arange(first_column, first_column + out.shape[-1])
        real = columns < self.vocab                              # padded vocabulary columns are no class
        self.keep("head", out[..., real], 1, self.positions, {2: (self.vocab, columns[real])})

    def wrap_core(self, name, core):
        def recorded(q, k, v):
            out = core(q, k, v)
            self.keep(name, out, 2, self.positions, {1: (self.heads, self.my_heads)})
            return out
        return recorded

    def loss(self, logits, targets):
        with torch.no_grad():                   # a second evaluation to look at; the trainer's own loss trains
            per_token = vocab_parallel_cross_entropy(logits, targets, self.t.tp_group, self.vocab)
        self.keep("loss per token", per_token, 1, self.positions)
        return self.loss_fn(logits, targets)

    def step(self, *args, **kwargs):
        self.pieces += [("%s.grad" % n, g, {}) for n, g in _full_grads(self.t).items()]
        return self.opt_step(*args, **kwargs)


def _full_grads(trainer) -> dict:
    """The gradients of this rank's stages, TP shards gathered: ``full_state_dict`` on the gradients (their
    data swapped in for the parameters' for the gather, then swapped back)."""
    params = dict(trainer.model.named_parameters())
    saved = {n: p.data for n, p in params.items()}
    for p in params.values():
        p.data = p.grad if p.grad is not None else torch.zeros_like(p.data)
    try:
        full = trainer.model.full_state_dict()
    finally:
        for n, p in params.items():
            p.data = saved[n]
    mine = set(trainer.names.values())
    return {n: g.to("cpu", copy=True) for n, g in full.items() if n in mine}


def _capture_rank(rank, world_size, recipe, layout, mode):
    trainer = Trainer3D(rank, world_size, recipe, layout=layout, **mode)
    recorder, steps = _Recorder(trainer), []
    for i, (inputs, targets) in enumerate(recipe.batches):
        recorder.pieces, recorder.calls = [], {}
        loss = trainer.step(inputs, targets, i)
        if loss is not None:
            recorder.pieces.append(("loss", torch.tensor(loss, dtype=recipe.dtype), {}))
        params = trainer.full_params()                            # a collective over tp
        steps.append([(f"{'forward' if '.grad' not in n else 'backward'} {n}", t, w) for n, t, w in recorder.pieces]
                     + [(f"step {n}", t, {}) for n, t in params.items()])
    return steps


@dataclass
class Capture:
    """One run's tensors: ``steps[s]`` is {name: whole tensor} in execution order; ``ops`` {name: op}."""
    layout: Layout
    steps: list
    ops: dict
    invariant: bool = False


def capture(recipe: Recipe, layout: Layout | None = None, *, invariant: bool = False, **dims) -> Capture:
    """Train ``recipe`` under ``layout`` (or its fields as keywords; micro_batches defaults to 1) with the 3D
    trainer and keep every step's tensors (the docstring's list), pieces put back whole. ``invariant``: the
    trainer in the invariant mode (:mod:`minipar.invariant_mode`)."""
    layout = Layout.of(layout, {"micro_batches": 1}, **dims)
    mode = {"invariant": True} if invariant else {}      # the default mode passes nothing: any trainer takes it
    validate(recipe, layout=layout, **mode)
    if layout.zero or layout.recompute != "none" or layout.ep > 1:
        raise ValueError("the diff tool captures plain optimizer steps without recomputation or experts: "
                         f"zero={layout.zero}, recompute={layout.recompute!r}, ep={layout.ep}")
    ranks = launch(_capture_rank, layout.world_size, recipe, layout, mode, quiet=True, timeout=120)
    model = recipe.model()
    points = _points(model.cfg, [n for n, _ in model.named_parameters()])
    steps = [_assemble([piece for r in ranks for piece in r[s]], [n for n, _ in points]) for s in range(len(ranks[0]))]
    return Capture(layout, steps, dict(points), invariant)


def _assemble(pieces, order) -> dict:
    """{name: whole tensor} in ``order`` from (name, piece, {dim: (whole size, indices)}) (replicas overwrite)."""
    whole = {}
    for name, piece, where in pieces:
        if not where:
            whole[name] = piece
            continue
        shape = [where[d][0] if d in where else n for d, n in enumerate(piece.shape)]
        out = whole.setdefault(name, torch.zeros(shape, dtype=piece.dtype))
        index = [where[d][1] if d in where else torch.arange(n) for d, n in enumerate(piece.shape)]
        grid = [ix.reshape([-1 if d == k else 1 for k in range(piece.dim())]) for d, ix in enumerate(index)]
        out[tuple(grid)] = piece
    return {n: whole[n] for n in order if n in whole}


# The first difference, and the reduction whose order made it --------------------------------------------

def _splits(layout: Layout) -> dict:
    return {"dp": layout.dp, "m": layout.micro_batches, "tp": layout.tp, "cp": layout.cp, "pp": layout.pp}


def reduction_for(name: str, a: Layout, b: Layout) -> str:
    """The reduction at tensor ``name`` whose order differs between layouts ``a`` and ``b`` (by what they split)."""
    d = {k: f"{k} {x} vs {y}" for (k, x), y in zip(_splits(a).items(), _splits(b).values()) if x != y}
    over_tokens = [f"{what} ({d[k]})" for k, what in (
        ("dp", "the DP all-reduce of the gradients: each rank sums its tokens, the ring adds the ranks' sums"),
        ("m", "gradient accumulation over micro-batches: one partial sum per micro-batch, added in turn"),
        ("cp", "the gradient all-reduce over the CP ranks' tokens")) if k in d]
    if name.endswith(".attn.core") and "cp" in d:
        return f"ring attention's key-block merge: the online softmax adds key blocks in ring order ({d['cp']})"
    if name.endswith((".attn.proj", ".mlp.proj")) and "tp" in d:
        return ("the row-parallel linear's all-reduce over the inner dimension: each tp rank sums its slice, "
                f"the all-reduce adds the partial sums ({d['tp']})")
    if name == "forward loss per token" and "tp" in d:
        return ("the vocabulary-parallel softmax's sum: each tp rank's Σ exp over its columns, then all-reduced "
                f"({d['tp']})")
    if name == "forward loss" and ({"dp", "m", "cp"} & set(d)):
        split = ", ".join(d[k] for k in ("dp", "m", "cp") if k in d)
        return f"the loss's mean over tokens: one mean per shard, then the mean of the means ({split})"
    if name.endswith(".grad") and over_tokens:
        return " and ".join(over_tokens)
    if name.endswith(".grad") and "tp" in d:
        return f"the backward's all-reduce of the input gradients over the inner dimension ({d['tp']})"
    if name.startswith("step "):
        return "none of its own: the optimizer acts elementwise on a gradient that differed"
    if not d:
        return "no split differs: the same layout ran twice (a nondeterministic kernel)"
    return f"no reduction of this op is split ({', '.join(d.values())}): a kernel that blocks another shape differently"


@dataclass
class Difference:
    """``name``/``op``/``step``: the first tensor that differs (None: none does); ``ulps_max``, ``ulps_count``
    (elements that differ) of ``numel``; ``reduction``: whose order made it; ``first_in_phase`` {phase: name}."""
    name: str | None
    op: str = ""
    step: int = 0
    ulps_max: int = 0
    ulps_count: int = 0
    numel: int = 0
    reduction: str = ""
    first_in_phase: dict | None = None
    compared: int = 0

    def __str__(self) -> str:
        if self.name is None:
            return f"no difference: all {self.compared} tensors bitwise equal at every step"
        lines = [f"first difference: step {self.step}, {self.name} ({self.op}): {self.ulps_count} of {self.numel} "
                 f"elements differ, by at most {self.ulps_max} ULP", f"  order changed by: {self.reduction}"]
        lines += [f"  first in {p}: {n}" for p, n in (self.first_in_phase or {}).items()]
        return "\n".join(lines)


def first_difference(a: Capture, b: Capture) -> Difference:
    """The first tensor (step, then execution order) where ``b`` differs from ``a`` in any bit."""
    if len(a.steps) != len(b.steps):
        raise ValueError(f"the runs took {len(a.steps)} and {len(b.steps)} steps")
    found = first_departure(a.steps, [b.steps], 0.0)
    compared = sum(len(s) for s in a.steps)
    if found.first is None:
        return Difference(None, compared=compared)
    step, name = found.first.step, found.first.name
    ulps = ulp_distance(b.steps[step][name], a.steps[step][name])
    phases = {}
    for n in found.wrong:
        phases.setdefault(n.split(" ")[0], n.split(" ", 1)[1])
    reduction = (reduction_for(name, a.layout, b.layout) if a.invariant == b.invariant else
                 "the modes differ: the invariant mode sums every split reduction in its canonical tree")
    return Difference(name, a.ops.get(name, ""), step, int(ulps.max()), int((ulps > 0).sum()), ulps.numel(),
                      reduction, phases, compared)
