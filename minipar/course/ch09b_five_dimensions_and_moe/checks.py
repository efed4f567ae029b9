"""Checks for chapter 09b's exercise: the gradient-reduction groups of a 5D layout (dense dp × cp,
expert-parallel, expert-data-parallel), against the trainer's own rule (:func:`.five_d.reduction_groups`)."""
from __future__ import annotations

from minipar.course.checks import fail
from minipar.mesh import Mesh

__all__ = ["check_reduction_groups", "SHAPES_5D"]


def _as_sets(groups):
    return sorted(tuple(g) for g in groups)


SHAPES_5D = [   # (world, dp, pp, cp, tp, ep): ep divides dp · cp · tp (the last two: only with tp)
    (16, 2, 2, 2, 2, 2), (16, 2, 2, 2, 2, 4), (32, 2, 2, 4, 2, 2), (32, 4, 2, 2, 2, 4), (16, 4, 2, 1, 2, 2),
    (24, 3, 2, 2, 2, 3), (16, 1, 2, 2, 4, 8), (16, 2, 2, 1, 4, 8)]


def _hint_5d(kind, got, want, shape) -> str:
    from .five_d import reduction_groups
    world, dp, pp, cp, tp, ep = shape
    mesh = Mesh(world, dp=dp, pp=pp, cp=cp, tp=tp)
    right = reduction_groups(world, dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
    if any(not 0 <= r < world for g in got for r in g):
        return f"ranks run from 0 to world_size − 1 = {world - 1}"
    if kind == "dense" and cp > 1 and got == _as_sets(mesh.groups("dp")):
        return ("those are the dp groups: with context parallelism each cp rank holds other tokens of the same "
                "rows, so the dense gradients are averaged over dp × cp")
    if kind in ("ep", "expert_dp") and any("pp" in mesh.dims_spanned(g) for g in got):
        return ("a group spans more than one pipeline stage: ep borrows its ranks from the dp × cp × tp ranks of "
                "one stage — an expert lives in one stage")
    other = {"ep": "expert_dp", "expert_dp": "ep"}.get(kind)
    if other and got == _as_sets(right[other]):
        return (f"those are the {other.replace('_', '-')} groups: ep takes consecutive chunks of each stage's "
                "ranks (its all-to-all runs every MoE layer, on the nearest ranks), expert-DP the ranks at the "
                "same place in every chunk")
    if kind in ("ep", "expert_dp") and tp > 1 and all("tp" not in mesh.dims_spanned(g) for g in got):
        return ("no group crosses tp: that is the old placement, each expert held by every tp rank (its FLOPs and "
                "memory ×tp); fold ep over the stage's dp × cp × tp ranks, tp fastest")
    return ("dense: the ranks sharing your pp and tp coordinates; ep: a stage's ranks (tp fastest) cut into "
            "chunks of ep consecutive ranks; expert-DP: the i-th rank of every chunk")


def check_reduction_groups(reduction_groups) -> None:
    """``reduction_groups(world_size, dp, pp, cp, tp, ep)`` -> {"dense": [[ranks]...], "ep": ..., "expert_dp": ...}
    on ``Mesh(world_size, dp=, pp=, cp=, tp=)`` with ep folded over each stage's dp × cp × tp ranks; compared with what the mesh gives
    (:func:`minipar.course.ch09b_five_dimensions_and_moe.five_d.reduction_groups`), groups as sets."""
    from .five_d import reduction_groups as mesh_rule
    for shape in SHAPES_5D:
        world, dp, pp, cp, tp, ep = shape
        want = mesh_rule(world, dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
        got = reduction_groups(world, dp, pp, cp, tp, ep)
        what = f"reduction_groups({world}, dp={dp}, pp={pp}, cp={cp}, tp={tp}, ep={ep})"
        if not isinstance(got, dict) or set(got) != set(want):
            fail(what, "a dict with keys 'dense', 'ep', 'expert_dp'", got, "return one list of groups per kind")
        for kind in ("dense", "ep", "expert_dp"):
            try:
                mine = sorted(tuple(sorted(int(r) for r in g)) for g in got[kind])
            except TypeError:
                fail(f"{kind} groups of {what}", want[kind], got[kind], "a list of groups, each a list of ranks")
            if mine != _as_sets(want[kind]):
                fail(f"{kind} groups of {what}", want[kind], got[kind], _hint_5d(kind, mine, want, shape))
    print(f"right: dense, expert and expert-DP groups for {len(SHAPES_5D)} 5D layouts, as the mesh builds them")
