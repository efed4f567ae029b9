"""Chapter 09b's five-dimensional mesh: dp × pp × cp × tp on one mesh, with ep folded over each stage's dp × cp × tp.

* :func:`reduction_groups` — the groups a 5D layout reduces over, from :class:`minipar.mesh.Mesh` and the
  trainer's :func:`minipar.hybrid.experts.expert_groups`: dense gradients over dp × cp; expert parallelism (ep) borrows its ranks from each (pp, tp) coordinate's
  dp × cp ranks — consecutive chunks of ``ep`` in mesh order (Megatron-Core's ``"tp-cp-ep-dp-pp"`` with
  ep inside dp, ``tests/test_mesh_megatron.py``) — and each expert's gradients are reduced over the
  expert-data-parallel group: the ranks at the same place in every chunk, dp · cp / ep of them.
* :func:`run_5d` — one launch of ``world`` ranks: each rank builds the mesh, reports the members of its
  torch process groups (and sums its rank id over each, so the groups are real), trains the recipe in float64
  under :mod:`minipar.machine.trace` (each optimizer step marked) with memory tracked, then again in float32.
* :func:`run_5d_moe` — the same mesh with MoE layers and ep folded in (:mod:`minipar.hybrid.experts`): each rank
  reports the dense, ep and expert-DP groups of its own trainer (members and the sum of rank ids over each), the
  experts it holds and its parameter bytes (experts apart), then trains; no-drop capacity, since with cp > 1 a
  rank's tokens are no contiguous routing group of one device.
* :func:`run_chapter` — both, two launches of 16 ranks whose results feed every cell of §2.
* :func:`ops_by_dims` — what one traced step's calls moved, per (op, dims spanned): which tensor goes over which
  group.
* :func:`declared_cluster` — two nodes of 8 for replaying the trace: compute as measured here, links declared.
"""
from __future__ import annotations

import torch

from minipar.hybrid.experts import expert_groups
from minipar.machine.intervals import step_slice
from minipar.layout import Layout
from minipar.mesh import Mesh

__all__ = ["LAYOUT_5D", "EP", "MOE_LAYOUT_5D", "reduction_groups", "run_5d", "moe_recipe", "run_5d_moe", "step_events", "ops_by_dims", "declared_cluster", "recipes", "run_chapter",
           "record_chapter", "load_chapter", "RecordedComparison"]

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
    """Chapter 08's recipe (tiny GPT, 4 layers, global batch 16 × 8 tokens) in float64 and float32."""
    from minipar.course.hybrid_runs import recipe
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


def _tracked(rank: int, world_size: int, layout: Layout) -> bool:
    """Whether this rank measures its peak: the ranks at dp = 0 and tp = 0 (one per stage and cp position). The
    other dp and tp ranks run the same program on tensors of the same shapes; tracking every live tensor
    costs a step twice its time, so the chapter measures the peak where it can differ."""
    c = Mesh(world_size, **layout.sizes).coords(rank)
    return c["dp"] == 0 and c["tp"] == 0


def _rank_5d(rank: int, world_size: int, recipe64, recipe32, layout: Layout, track: str = "all") -> dict:
    from minipar.observe import tracer
    from minipar.hybrid.runner import parallel_train
    groups = _groups_seen(rank, world_size, layout)
    recipe64.optimizer = _marked(recipe64.optimizer)
    track_memory = track == "all" or _tracked(rank, world_size, layout)
    with tracer.tracing(rank) as rank_trace:
        run64 = parallel_train(rank, world_size, recipe64, layout=layout, track_memory=track_memory)
    run32 = parallel_train(rank, world_size, recipe32, layout=layout)
    return {"groups": groups, "run64": run64, "trace": rank_trace, "losses32": run32.losses,
            "params32": run32.params}


def run_5d(recipe64, recipe32, layout: Layout = LAYOUT_5D) -> dict:
    """Validate, then one launch of ``layout.world_size`` ranks (see the module's docstring). Returns
    {"groups": [per rank], "runs64": [HybridRun], "trace": Trace, "runs32": [RunResult]}."""
    from minipar.check import RunResult
    from minipar.hybrid.parallel3d import validate
    from minipar.launcher import launch
    from minipar.machine.trace import Trace
    validate(recipe64, layout=layout)
    out = launch(_rank_5d, layout.world_size, recipe64, recipe32, layout, quiet=True, timeout=180)
    return {"groups": [o["groups"] for o in out], "runs64": [o["run64"] for o in out],
            "trace": Trace([o["trace"] for o in out], {"layout": str(layout)}),
            "runs32": [RunResult(o["losses32"], o["params32"]) for o in out]}


def run_chapter(steps: int = 2, layout: Layout = LAYOUT_5D, moe_layout: Layout = MOE_LAYOUT_5D) -> dict:
    """§2's runs, ``steps`` steps each: one launch of 16 ranks for :func:`run_5d`'s dense runs (float64 traced,
    peak measured on the ranks of :func:`_tracked`; float32), one for :func:`run_5d_moe`'s MoE run (no memory
    tracking: the chapter reads its model states, which a rank counts at the end without it). Two launches, not
    one: a process that already holds the dense trainers' process groups (65 per trainer on this mesh) runs the
    MoE steps 2–3× slower here. Returns run_5d's dict + "moe" (run_5d_moe's list), "recipe64", "recipe32",
    "moe_recipe", "tracked" (the ranks whose peak was measured)."""
    from minipar.hybrid.parallel3d import validate
    from minipar.launcher import launch
    from minipar.check import RunResult
    from minipar.machine.trace import Trace
    recipe64, recipe32 = recipes(steps)
    moe = moe_recipe(moe_layout, steps=steps)
    validate(recipe64, layout=layout)
    validate(moe, layout=moe_layout)
    out = launch(_rank_5d, layout.world_size, recipe64, recipe32, layout, "dp0,tp0", quiet=True, timeout=180)
    moe_out = launch(_moe_rank, moe_layout.world_size, moe, moe_layout, False, quiet=True, timeout=180)
    return {"groups": [o["groups"] for o in out], "runs64": [o["run64"] for o in out],
            "trace": Trace([o["trace"] for o in out], {"layout": str(layout)}),
            "runs32": [RunResult(o["losses32"], o["params32"]) for o in out], "moe": moe_out,
            "recipe64": recipe64, "recipe32": recipe32, "moe_recipe": moe,
            "tracked": [r for r in range(layout.world_size) if _tracked(r, layout.world_size, layout)]}


def moe_recipe(layout: Layout = MOE_LAYOUT_5D, steps: int = 3, experts: int = 4):
    """The chapter's model (4 layers, hidden 32, global batch 16 × 8 tokens, float64) with every FFN an MoE layer
    of ``experts`` experts, top-1, capacity factor E/k (no token dropped), Switch balancing loss α = 0.01."""
    from minipar.hybrid.experts import hybrid_moe_recipe
    from minipar.course.hybrid_runs import BATCH, SEQ
    return hybrid_moe_recipe(layout, steps=steps, batch_size=BATCH, seq_len=SEQ, experts=experts, k=1,
                             capacity_factor=float(experts), n_layer=4)


def _moe_rank(rank: int, world_size: int, recipe, layout: Layout, track_memory: bool = True) -> dict:
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
    run = parallel_train(rank, world_size, recipe, layout=layout, track_memory=track_memory)
    return {"groups": seen, "experts_held": held, "param_bytes": param_bytes, "run": run}


def run_5d_moe(recipe=None, layout: Layout = MOE_LAYOUT_5D, track_memory: bool = True) -> list:
    """Validate, then one launch of ``layout.world_size`` ranks (:func:`_moe_rank`); per rank {"groups":
    {"dense" | "ep" | "expert_dp": (members, Σ rank ids)}, "experts_held", "param_bytes", "run": HybridRun}.
    ``track_memory=False``: no peak measured (``run.peak_bytes`` 0; the last step then costs half as much)."""
    from minipar.hybrid.parallel3d import validate
    from minipar.launcher import launch
    recipe = moe_recipe(layout) if recipe is None else recipe
    validate(recipe, layout=layout)
    return launch(_moe_rank, layout.world_size, recipe, layout, track_memory, quiet=True, timeout=180)


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
    from minipar.machine.cluster import Cluster
    return Cluster(devices_per_node, nodes, 16e9, 1.0, intra_bw, inter_bw, intra_latency, inter_latency)


# ---------------------------------------------------------------------------------------------------------
# recorded: two launches of 16 ranks cost about a minute of two shared cores, so the chapter shows a record
# ---------------------------------------------------------------------------------------------------------

RECORD_COMMAND = "python -m minipar bench five-d"


class RecordedComparison:
    """A :class:`minipar.check.Comparison` as recorded: ``matches``, ``max_abs_diff`` and its sentence."""

    def __init__(self, matches: bool, max_abs_diff: float, text: str):
        self.matches, self.max_abs_diff, self.text = matches, max_abs_diff, text

    def assert_ok(self):
        assert self.matches, self.text
        return self

    def __str__(self) -> str:
        return self.text


def _run_fields(run) -> dict:
    """A HybridRun's measurements as JSON (its parameters and pipeline timeline left out)."""
    return {k: v for k, v in vars(run).items() if k not in ("params", "timeline")}


def record_chapter(steps: int = 2) -> dict:
    """:func:`run_chapter`, compared with one device, as one JSON-ready dict with its provenance."""
    import os
    import time
    from minipar.check import compare, train_reference
    from .recorded import provenance
    started, load_before = time.time(), os.getloadavg()[0]
    five = run_chapter(steps)
    as_dict = lambda c: {"matches": bool(c.matches), "max_abs_diff": float(c.max_abs_diff), "text": str(c)}  # noqa: E731
    dense = compare(train_reference(five["recipe64"]), five["runs64"], dtype=torch.float64)
    moe = compare(train_reference(five["moe_recipe"]), [o["run"] for o in five["moe"]], dtype=torch.float64)
    return {"recorded": {**provenance(started, load_before), "command": RECORD_COMMAND}, "steps": steps,
            "layout": str(LAYOUT_5D), "moe_layout": str(MOE_LAYOUT_5D), "groups": five["groups"],
            "runs64": [_run_fields(r) for r in five["runs64"]], "losses32": [r.losses for r in five["runs32"]],
            "trace": five["trace"].to_dict(), "tracked": five["tracked"],
            "moe": [{**{k: v for k, v in o.items() if k != "run"}, "run": _run_fields(o["run"])} for o in five["moe"]],
            "comparison64": as_dict(dense), "moe_comparison": as_dict(moe)}


def load_chapter(path=None) -> dict:
    """The record of :func:`record_chapter` as :func:`run_chapter` returns it (runs without parameters; the
    comparisons with one device as recorded: "comparison64", "moe_comparison"; "recorded": when and where)."""
    import json
    from minipar.check import RunResult
    from minipar.hybrid.runner import HybridRun
    from minipar.machine.trace import Trace
    from .recorded import FIVE_D_RECORD
    rec = json.loads((path or FIVE_D_RECORD).read_text())
    run = lambda d: HybridRun(**{**d, "params": {}, "timeline": []})  # noqa: E731
    recipe64, recipe32 = recipes(rec["steps"])
    return {"recorded": rec["recorded"], "groups": rec["groups"], "runs64": [run(d) for d in rec["runs64"]],
            "trace": Trace.from_dict(rec["trace"]), "runs32": [RunResult(l, {}) for l in rec["losses32"]],
            "moe": [{**o, "run": run(o["run"])} for o in rec["moe"]], "recipe64": recipe64, "recipe32": recipe32,
            "moe_recipe": moe_recipe(MOE_LAYOUT_5D, steps=rec["steps"]), "tracked": rec["tracked"],
            "comparison64": RecordedComparison(**rec["comparison64"]),
            "moe_comparison": RecordedComparison(**rec["moe_comparison"])}


def record_main(argv=None) -> int:
    """``python -m minipar bench five-d [--out FILE]``: run chapter 09b's launches and write their record."""
    import argparse
    import json
    from .recorded import FIVE_D_RECORD
    parser = argparse.ArgumentParser(prog=RECORD_COMMAND, description="record chapter 09b's 16-rank runs")
    parser.add_argument("--out", default=str(FIVE_D_RECORD))
    parser.add_argument("--steps", type=int, default=2)
    a = parser.parse_args(argv)
    rec = record_chapter(a.steps)
    with open(a.out, "w") as f:
        json.dump(rec, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"{a.out}: {rec['recorded']}; dense vs one device: {rec['comparison64']['text']}; "
          f"MoE: {rec['moe_comparison']['text']}")
    return 0
