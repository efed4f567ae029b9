"""Chapter 08's five-dimensional part: dp × pp × cp × tp on one mesh, with ep folded over each stage's dp × cp × tp.

* :func:`reduction_groups` — the groups a 5D layout reduces over, from :class:`minipar.mesh.Mesh` and the
  trainer's :func:`minipar.hybrid.experts.expert_groups`: dense gradients over dp × cp; expert parallelism (ep) borrows its ranks from each (pp, tp) coordinate's
  dp × cp ranks — consecutive chunks of ``ep`` in mesh order (Megatron-Core's ``"tp-cp-ep-dp-pp"`` with
  ep inside dp, ``tests/test_mesh_megatron.py``) — and each expert's gradients are reduced over the
  expert-data-parallel group: the ranks at the same place in every chunk, dp · cp / ep of them.
* :func:`run_5d` — one launch of ``world`` ranks: each rank builds the mesh, reports the members of its
  torch process groups (and sums its rank id over each, so the groups are real), trains the recipe in float64
  under :mod:`minipar.observe.trace` (each optimizer step marked) with memory tracked, then again in float32.
* :func:`run_5d_moe` — the same mesh with MoE layers and ep folded in (:mod:`minipar.hybrid.experts`): each rank
  reports the dense, ep and expert-DP groups of its own trainer (members and the sum of rank ids over each), the
  experts it holds and its parameter bytes (experts apart), then trains; no-drop capacity, since with cp > 1 a
  rank's tokens are no contiguous routing group of one device.
* :func:`ops_by_dims` — what one traced step's calls moved, per (op, dims spanned): which tensor goes over which
  group.
* :func:`declared_cluster` — two nodes of 8 for replaying the trace: compute as measured here, links declared.
"""
from __future__ import annotations

import torch

from minipar.hybrid.experts import expert_groups
from minipar.observe.intervals import step_slice
from minipar.layout import Layout
from minipar.mesh import Mesh

__all__ = ["LAYOUT_5D", "EP", "MOE_LAYOUT_5D", "reduction_groups", "run_5d", "moe_recipe", "run_5d_moe", "step_events", "ops_by_dims", "declared_cluster", "recipes"]

LAYOUT_5D = Layout(dp=2, pp=2, cp=2, tp=2, micro_batches=4)      # 16 ranks, 1F1B, ring attention over cp
EP = 2                                                           # folded: divides dp · cp = 4
MOE_LAYOUT_5D = Layout(dp=2, pp=2, cp=2, tp=2, ep=EP, micro_batches=4)


def reduction_groups(world_size: int, *, dp: int, pp: int, cp: int, tp: int, ep: int) -> dict:
    """{"dense": dp × cp groups, "ep": expert-parallel groups, "expert_dp": expert-data-parallel groups} of a
    ``Mesh(world_size, dp=, pp=, cp=, tp=)``: the trainer's own rule, :func:`minipar.hybrid.experts.expert_groups`
    (ep groups = consecutive chunks of ``ep`` of each stage's dp × cp × tp ranks, expert-DP = the strided sets),
    flattened."""
    Layout(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep).check()                # ep must divide dp · cp · tp
    mesh = Mesh(world_size, dp=dp, pp=pp, cp=cp, tp=tp)
    cuts = expert_groups(mesh, ep)
    return {"dense": mesh.groups("dp", "cp"), "ep": [g for chunks, _ in cuts for g in chunks],
            "expert_dp": [g for _, strided in cuts for g in strided]}


def recipes(steps: int = 3):
    """The chapter's recipe (measure.recipe: tiny GPT, 4 layers, global batch 16 × 8 tokens) in float64 and float32."""
    from .measure import recipe
    r64, r32 = recipe(steps), recipe(steps)
    r32.dtype = torch.float32
    return r64, r32


def _marked(factory):
    """The optimizer factory with every ``step()`` marked in the trace (a step = the gap between two marks)."""
    from minipar.observe import tracer

    def build(params):
        opt = factory(params)
        step = opt.step

        def marked_step(*args, **kwargs):
            out = step(*args, **kwargs)
            tracer.mark("step")
            return out
        opt.step = marked_step
        return opt
    return build


def _groups_seen(rank: int, world_size: int, layout: Layout) -> dict:
    """Build the mesh on this running rank; per group: its members as torch reports them, and the sum of the
    members' rank ids all-reduced over it (= sum of the members when the group is real)."""
    import torch.distributed as dist
    from minipar import comm
    mesh = Mesh(world_size, **layout.sizes).build(rank, combos=[("dp", "cp")])
    handles = {"dp,cp": mesh.group("dp", "cp"), "tp": mesh.group("tp"), "pp": mesh.group("pp"),
               "cp": mesh.group("cp")}
    out = {}
    for name, group in handles.items():
        total = torch.tensor([float(rank)])
        comm.all_reduce(total, group=group)
        out[name] = (dist.get_process_group_ranks(group), int(total.item()))
    return out


def _rank_5d(rank: int, world_size: int, recipe64, recipe32, layout: Layout) -> dict:
    from minipar.observe import tracer
    from minipar.hybrid.runner import parallel_train
    groups = _groups_seen(rank, world_size, layout)
    recipe64.optimizer = _marked(recipe64.optimizer)
    with tracer.tracing(rank) as rank_trace:
        run64 = parallel_train(rank, world_size, recipe64, layout=layout, track_memory=True)
    run32 = parallel_train(rank, world_size, recipe32, layout=layout)
    return {"groups": groups, "run64": run64, "trace": rank_trace, "losses32": run32.losses,
            "params32": run32.params}


def run_5d(recipe64, recipe32, layout: Layout = LAYOUT_5D) -> dict:
    """Validate, then one launch of ``layout.world_size`` ranks (see the module's docstring). Returns
    {"groups": [per rank], "runs64": [HybridRun], "trace": Trace, "runs32": [RunResult]}."""
    from minipar.check import RunResult
    from minipar.hybrid.parallel3d import validate
    from minipar.launcher import launch
    from minipar.observe.trace import Trace
    validate(recipe64, layout=layout)
    out = launch(_rank_5d, layout.world_size, recipe64, recipe32, layout, quiet=True, timeout=180)
    return {"groups": [o["groups"] for o in out], "runs64": [o["run64"] for o in out],
            "trace": Trace([o["trace"] for o in out], {"layout": str(layout)}),
            "runs32": [RunResult(o["losses32"], o["params32"]) for o in out]}


def moe_recipe(layout: Layout = MOE_LAYOUT_5D, steps: int = 3, experts: int = 4):
    """The chapter's model (4 layers, hidden 32, global batch 16 × 8 tokens, float64) with every FFN an MoE layer
    of ``experts`` experts, top-1, capacity factor E/k (no token dropped), Switch balancing loss α = 0.01."""
    from minipar.hybrid.experts import hybrid_moe_recipe
    from .measure import BATCH, SEQ
    return hybrid_moe_recipe(layout, steps=steps, batch_size=BATCH, seq_len=SEQ, experts=experts, k=1,
                             capacity_factor=float(experts), n_layer=4)


def _moe_rank(rank: int, world_size: int, recipe, layout: Layout) -> dict:
    """The groups, experts and parameter bytes of a :class:`~minipar.hybrid.parallel3d.Trainer3D` built on this
    rank, then the measured run (:func:`~minipar.hybrid.runner.parallel_train`, memory tracked)."""
    import torch.distributed as dist
    from minipar import comm
    from minipar.hybrid.parallel3d import Trainer3D
    from minipar.hybrid.runner import parallel_train
    from minipar.memory import tensor_bytes
    t = Trainer3D(rank, world_size, recipe, layout=layout)
    seen = {}
    for name, group in (("dense", t.dp_group), ("ep", t.experts.ep_group), ("expert_dp", t.experts.edp_group)):
        if group is None:                                    # a group of one rank (ep = 1, or ep = dp·cp)
            seen[name] = ([rank], rank)
            continue
        total = torch.tensor([float(rank)])
        comm.all_reduce(total, group=group)
        seen[name] = (dist.get_process_group_ranks(group), int(total.item()))
    held = sorted({int(i) for layer in t.experts.layers for i in layer.experts.keys()})
    param_bytes = {"experts": tensor_bytes(t.experts.params), "all": tensor_bytes(t.params)}
    run = parallel_train(rank, world_size, recipe, layout=layout, track_memory=True)
    return {"groups": seen, "experts_held": held, "param_bytes": param_bytes, "run": run}


def run_5d_moe(recipe=None, layout: Layout = MOE_LAYOUT_5D) -> list:
    """Validate, then one launch of ``layout.world_size`` ranks (:func:`_moe_rank`); per rank {"groups":
    {"dense" | "ep" | "expert_dp": (members, Σ rank ids)}, "experts_held", "param_bytes", "run": HybridRun}."""
    from minipar.hybrid.parallel3d import validate
    from minipar.launcher import launch
    recipe = moe_recipe(layout) if recipe is None else recipe
    validate(recipe, layout=layout)
    return launch(_moe_rank, layout.world_size, recipe, layout, quiet=True, timeout=180)


def step_events(rank_trace, step: int = 1) -> list:
    """The events of one rank between its ``step``-th and ``step + 1``-th "step" marks (step 1: the second
    step, after the first optimizer step; the first also holds the set-up)."""
    return step_slice(rank_trace.events, "step", step - 1)


def ops_by_dims(trace, mesh: Mesh, step: int = 1) -> dict:
    """{(op, dims spanned): (calls, payload bytes)} per rank in one step (:func:`step_events`), mean over the
    ranks, from a trace's calls (a send counted on its sender; the receive is the same message)."""
    table: dict = {}
    for rank_trace in trace.ranks:
        for call in step_events(rank_trace, step):
            if getattr(call, "kind", None) != "comm" or call.op == "recv":
                continue
            key = (call.op, mesh.dims_spanned(call.ranks))
            calls, nbytes = table.get(key, (0, 0))
            table[key] = (calls + 1, nbytes + call.bytes)
    n = trace.world_size
    return {k: (c / n, b / n) for k, (c, b) in sorted(table.items(), key=lambda kv: -kv[1][1])}


def declared_cluster(devices_per_node: int = 8, nodes: int = 2, intra_bw: float = 2e9, inter_bw: float = 2e8,
                     intra_latency: float = 20e-6, inter_latency: float = 200e-6):
    """A declared cluster to replay the 16-rank trace on (a model, not this machine): compute as each segment's
    measured thread CPU time here (replay with ``compute_scale=1``), links 2 GB/s inside a node of 8 and
    10× slower between nodes (round numbers)."""
    from minipar.observe.cluster import Cluster
    return Cluster(devices_per_node, nodes, 16e9, 1.0, intra_bw, inter_bw, intra_latency, inter_latency)
