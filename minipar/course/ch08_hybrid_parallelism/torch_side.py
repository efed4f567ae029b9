"""Chapter 08's layout built from PyTorch's own pieces, the way torchtitan composes them, beside minipar's.

    mesh   = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))     # minipar.mesh.Mesh
    stage  = this pp rank's blocks (+ embeddings on the first stage, + final LayerNorm and head on the last)
    parallelize_module(stage, mesh["tp"], plan)     ColwiseParallel q, k, v, fc / RowwiseParallel proj: ch. 05
    fully_shard(block / stage, mesh=mesh["dp"])     FSDP2 over the data-parallel sub-mesh: ch. 03 (ZeRO-3)
    PipelineStage + Schedule1F1B / ScheduleGPipe    over mesh["pp"]: ch. 04's runtime
      / ScheduleInterleaved1F1B (v stages per rank)  stage s on pp rank s % pp, as minipar's interleaved
    loss_parallel()                                 cross-entropy on the vocabulary-sharded logits: ch. 05

The model is :class:`TorchGPT`, minipar's :class:`~minipar.models.TinyGPT` with the fused QKV Linear cut into
separate ``q``, ``k``, ``v`` Linears (the weights split from the fused one). ``ColwiseParallel`` shards a
weight into contiguous row blocks: on the fused (3h × h) weight rank 0 of 2 would get all of Q and half of K,
not its heads' Q, K and V; on three separate weights each rank gets its heads of each (torchtitan's models keep
``wq``, ``wk``, ``wv`` for this reason). Everything else is the same module, the same initial weights, the same
batches, the same Adam: :func:`torch_train` returns a :class:`minipar.check.RunResult` under the reference
names (q, k, v glued back into ``qkv``), so :func:`minipar.check.compare` checks it against one device and
against minipar's :func:`minipar.hybrid.runner.run` of the same layout.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar.check import RunResult, compare, train_reference
from minipar.launcher import launch
from minipar.loop import mean_over_ranks, shard_batch

__all__ = ["TorchAttention", "TorchBlock", "TorchGPT", "tp_plan", "TorchTrainer3D", "torch_train", "torch_run",
           "side_by_side", "side_by_side_of", "ddp_over_tp_error"]


class TorchAttention(nn.Module):
    """Causal self-attention with separate q, k, v Linears cut from a fused ``CausalSelfAttention``. The number
    of heads follows the width of q's output, so the same forward runs whole or on a TP rank's heads."""

    def __init__(self, attn):
        super().__init__()
        c = attn.qkv.in_features
        self.head_dim, self.dropout = c // attn.n_head, attn.dropout
        kw = dict(bias=attn.qkv.bias is not None, dtype=attn.qkv.weight.dtype)
        self.q, self.k, self.v = (nn.Linear(c, c, **kw) for _ in range(3))
        with torch.no_grad():
            for lin, w in zip((self.q, self.k, self.v), attn.qkv.weight.split(c)):
                lin.weight.copy_(w)
            if attn.qkv.bias is not None:
                for lin, b in zip((self.q, self.k, self.v), attn.qkv.bias.split(c)):
                    lin.bias.copy_(b)
        self.proj, self.resid_drop = copy.deepcopy(attn.proj), copy.deepcopy(attn.resid_drop)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class TorchBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn, self.mlp = TorchAttention(block.attn), copy.deepcopy(block.mlp)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT(nn.Module):
    """TinyGPT with separate q, k, v; ``stage(i, n)`` keeps pipeline stage i of n (torchtitan's way: the pieces
    another stage owns are deleted, ``blocks`` is a ModuleDict so the names stay the reference names)."""

    def __init__(self, ref):
        super().__init__()
        self.cfg = ref.cfg
        if ref.cfg.tie_weights:
            raise ValueError("use tie_weights=False: the head and the embedding are parallelized separately")
        self.tok_emb, self.pos_emb = copy.deepcopy(ref.tok_emb), copy.deepcopy(ref.pos_emb)
        self.drop = copy.deepcopy(ref.drop)
        self.blocks = nn.ModuleDict({str(i): TorchBlock(b) for i, b in enumerate(ref.blocks)})
        self.ln_f, self.head = copy.deepcopy(ref.ln_f), copy.deepcopy(ref.head)

    def stage(self, index: int, n_stages: int) -> "TorchGPT":
        per = self.cfg.n_layer // n_stages
        for i in list(self.blocks):
            if not index * per <= int(i) < (index + 1) * per:
                del self.blocks[i]
        if index > 0:
            self.tok_emb = self.pos_emb = None
        if index < n_stages - 1:
            self.ln_f = self.head = None
        return self

    def forward(self, x):
        if self.tok_emb is not None:                                 # token ids -> hidden states
            x = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x


def tp_plan() -> dict:
    """parallelize_module's plan for the model (chapter 05's layers, named by module path)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),   # vocabulary-parallel embedding
            # vocabulary-parallel head: logits stay a DTensor sharded on the vocabulary, for loss_parallel
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
        plan[f"blocks.*.{name}"] = ColwiseParallel()
    for name in ("attn.proj", "mlp.proj"):
        plan[f"blocks.*.{name}"] = RowwiseParallel()
    return plan


def lm_loss_parallel(logits, targets):
    """Mean cross-entropy; on vocabulary-sharded DTensor logits under ``loss_parallel()`` (no gather)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


class TorchTrainer3D:
    """One rank of the dp × pp × tp layout in PyTorch's pieces; ``step(inputs, targets)`` trains on one global
    batch and returns the global mean loss on the last stage's ranks (None elsewhere), like
    :class:`minipar.hybrid.parallel3d.Trainer3D`."""

    def __init__(self, rank, world_size, recipe, *, dp, pp, tp, micro_batches=4, schedule="1f1b",
                 data_parallel: str = "replicate", v: int = 1):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module
        self.mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        self.dp, self.pp, self.m = dp, pp, micro_batches
        self.dp_rank, self.pp_rank = self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("pp")
        if data_parallel not in ("fsdp", "replicate", "ddp"):
            raise ValueError(f"data_parallel must be 'fsdp', 'replicate' or 'ddp', got {data_parallel!r}")
        if data_parallel == "ddp" and pp > 1:
            raise ValueError("data_parallel='ddp' is shown without a pipeline (pp = 1): use 'replicate' with pp > 1")
        n_stages = pp * v                                 # interleaved (v > 1): stages r, r + pp, ... on rank r
        self.modules = {s: TorchGPT(recipe.model().to(recipe.dtype)).stage(s, n_stages)
                        for s in range(self.pp_rank, n_stages, pp)}
        for model in self.modules.values():
            plan = {k: p for k, p in tp_plan().items() if k.startswith("blocks") or getattr(model, k) is not None}
            if tp > 1:
                parallelize_module(model, self.mesh["tp"], plan)
            if dp > 1 and data_parallel == "ddp":       # DDP handed the dp sub-mesh (not its process group)
                continue
            if dp > 1:      # one unit per block, the rest in the root, over the dp sub-mesh
                if data_parallel == "fsdp":              # FSDP2: parameters sharded over dp (ZeRO-3, chapter 03)
                    wrap = lambda m: fully_shard(m, mesh=self.mesh["dp"], reshard_after_forward=pp == 1)  # noqa: E731
                else:                                    # replicated, gradients all-reduced (DDP, chapter 02)
                    from torch.distributed._composable.replicate_with_fsdp import replicate
                    wrap = lambda m: replicate(m, mesh=self.mesh["dp"])                                   # noqa: E731
                for block in model.blocks.values():
                    wrap(block)
                wrap(model)
        self.model = self.modules[self.pp_rank]           # the only one unless interleaved
        if dp > 1 and data_parallel == "ddp":
            self.model = nn.parallel.DistributedDataParallel(self.model, device_mesh=self.mesh["dp"])
        # kept now: DDP's TP glue swaps the DTensor parameters for plain attributes during each forward
        self.named_params = [(n, p) for model in self.modules.values() for n, p in model.named_parameters()]
        params = [p for _, p in self.named_params]
        self.optimizer = recipe.optimizer(params)
        self.last = self.pp_rank == pp - 1
        self.schedule = None
        if pp > 1:
            from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                      ScheduleInterleaved1F1B)
            stages = [PipelineStage(model, s, n_stages, torch.device("cpu"), group=self.mesh["pp"].get_group())
                      for s, model in self.modules.items()]
            if schedule == "interleaved":
                self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=micro_batches, loss_fn=lm_loss_parallel)
            else:
                kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
                self.schedule = kind(stages[0], n_microbatches=micro_batches, loss_fn=lm_loss_parallel)

    def step(self, inputs, targets):
        from torch.distributed.tensor.parallel import loss_parallel
        x, y = shard_batch((inputs, targets), self.dp_rank, self.dp)
        self.optimizer.zero_grad(set_to_none=True)
        with loss_parallel():
            if self.schedule is None:
                loss = lm_loss_parallel(self.model(x), y)
                loss.backward()
                loss = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
            else:
                losses = []
                if self.pp_rank == 0:
                    self.schedule.step(x)
                elif self.last:
                    self.schedule.step(target=y, losses=losses)
                else:
                    self.schedule.step()
                loss = None
                if self.last:
                    loss = sum(l.full_tensor() if hasattr(l, "full_tensor") else l for l in losses) / self.m
        self.optimizer.step()
        if not self.last:
            return None
        return mean_over_ranks(loss.detach().to(torch.float64), self.mesh["dp"].get_group())

    def full_params(self) -> dict:
        """{reference name: full tensor} of this rank's stage (a collective over dp and tp: every rank calls
        it); q, k, v glued back into the fused ``qkv``."""
        full = {n: _full(p).detach().clone() for n, p in self.named_params}
        out = {}
        for name, t in full.items():
            if ".attn.q." in name:
                parts = [full[name.replace(".attn.q.", f".attn.{w}.")] for w in "qkv"]
                out[name.replace(".attn.q.", ".attn.qkv.")] = torch.cat(parts)
            elif ".attn.k." not in name and ".attn.v." not in name:
                out[name] = t
        return out


def _full(p):
    """The whole tensor behind a parameter: a DTensor's ``full_tensor()``; under DDP with a device mesh the TP'd
    parameters are kept as local shards tagged ``_st_info`` (PyTorch's ``_pre_dp_module_transform``) between
    forwards, so they are rebuilt as DTensors first (a private helper of PyTorch's TP + DDP glue)."""
    if hasattr(p, "_st_info"):
        from torch.distributed.tensor.parallel._data_parallel_utils import _unflatten_tensor
        p = _unflatten_tensor(p, p._st_info)
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def torch_train(rank, world_size, recipe, *, dp, pp, tp, micro_batches=4, schedule="1f1b",
                data_parallel="replicate", v=1) -> RunResult:
    """Train ``recipe`` on this rank of PyTorch's dp × pp × tp layout; a :class:`RunResult` like minipar's."""
    t = TorchTrainer3D(rank, world_size, recipe, dp=dp, pp=pp, tp=tp, micro_batches=micro_batches,
                       schedule=schedule, data_parallel=data_parallel, v=v)
    losses = [t.step(x, y) for x, y in recipe.batches]
    losses = losses if t.last else None
    return RunResult([float(l) for l in losses] if losses else None, t.full_params())


def torch_run(recipe, *, dp, pp, tp, micro_batches=4, schedule="1f1b", data_parallel="replicate", v=1,
              timeout=120.0) -> list:
    """Launch :func:`torch_train` on dp·pp·tp ranks; the per-rank :class:`RunResult`."""
    return launch(torch_train, dp * pp * tp, recipe, dp=dp, pp=pp, tp=tp, micro_batches=micro_batches,
                  schedule=schedule, data_parallel=data_parallel, v=v, quiet=True, timeout=timeout)


def _merged(runs) -> RunResult:
    """One RunResult from per-rank results: the first loss list reported, every parameter (first report)."""
    losses = next(r.losses for r in runs if r.losses is not None)
    params = {}
    for r in runs:
        for n, p in r.params.items():
            params.setdefault(n, p)
    return RunResult(losses, params)


def side_by_side(recipe, *, dp, pp, tp, micro_batches=4, schedule="1f1b", v=1) -> dict:
    """Train ``recipe`` on one device, with minipar's 3D layout and with PyTorch's; compare each with one
    device and the two with each other (max |Δ| over losses and parameters)."""
    from minipar.hybrid.runner import run
    ref = train_reference(recipe)
    ours = run(recipe, world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp, micro_batches=micro_batches,
               schedule=schedule, v=v)
    theirs = torch_run(recipe, dp=dp, pp=pp, tp=tp, micro_batches=micro_batches, schedule=schedule, v=v)
    return side_by_side_of(recipe, ref, ours, theirs)


def side_by_side_of(recipe, ref: RunResult, ours: list, theirs: list) -> dict:
    """:func:`side_by_side`'s comparisons and losses, of runs already made: ``ref`` on one device, ``ours``
    (minipar's per-rank results) and ``theirs`` (:func:`torch_train`'s per-rank results) of one layout."""
    return {"minipar_vs_one_device": compare(ref, ours, dtype=recipe.dtype),
            "torch_vs_one_device": compare(ref, theirs, dtype=recipe.dtype),
            "minipar_vs_torch": compare(_merged(theirs), ours, dtype=recipe.dtype),
            "losses": {"one device": ref.losses, "minipar": _merged(ours).losses, "torch": _merged(theirs).losses}}


def ddp_over_tp_with_mesh(recipe, *, dp: int = 2, tp: int = 2) -> dict:
    """The path that composes: ``DistributedDataParallel(model, device_mesh=mesh["dp"])`` over a TP'd model
    (handed the dp sub-mesh, DDP skips the broadcast that concatenates DTensors with plain tensors), trained
    beside one device: {"one device", "torch DDP + TP"} comparisons and losses."""
    ref = train_reference(recipe)
    theirs = torch_run(recipe, dp=dp, pp=1, tp=tp, micro_batches=1, data_parallel="ddp")
    return {"vs_one_device": compare(ref, theirs, dtype=recipe.dtype),
            "losses": {"one device": ref.losses, "torch DDP + TP": _merged(theirs).losses}}


def ddp_over_tp_error(rank, world_size, recipe):
    """The trap: ``DistributedDataParallel(model, process_group=...)`` over a model already made tensor-parallel.
    Returns the error its constructor raises on this rank (None if it were accepted). DDP broadcasts the
    module's states from rank 0 with ``_broadcast_coalesced``, which concatenates them: the TP'd weights are
    DTensors, the LayerNorm weights plain tensors, and DTensor refuses the mix. Not a CPU or gloo limit (the
    broadcast is the same on NCCL). Handed ``device_mesh=mesh["dp"]`` instead, DDP first turns the DTensors
    into local shards and composes (:func:`ddp_over_tp_with_mesh`); torchtitan uses FSDP2's ``replicate`` /
    ``fully_shard`` over the dp sub-mesh, as :class:`TorchTrainer3D` does by default."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    model = TorchGPT(recipe.model().to(recipe.dtype))
    parallelize_module(model, mesh["tp"], tp_plan())
    try:
        nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
