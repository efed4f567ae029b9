"""Checks for chapter 08's exercises: the process groups of a dp × pp × tp mesh, the model-state memory of
a layout per GPU, and resharding one tensor-parallel parameter from t ranks to t' ranks.

The first check also builds the learner's groups on real ranks and sums each rank's id over them, so a
wrong group shows up as who-talks-to-whom, not only as a wrong list.
"""
from __future__ import annotations

import torch

from minipar.course.checks import fail, run_on_ranks
from minipar.mesh import Mesh
from minipar.tensor.layers import shard_cols, shard_rows

__all__ = ["check_mesh_groups", "check_memory_per_rank", "check_reshard"]

SHAPES = [(8, 2, 2, 2), (8, 1, 2, 4), (8, 4, 2, 1), (12, 3, 2, 2), (16, 2, 4, 2)]


def _expected_groups(world_size, dp, pp, tp) -> dict:
    mesh = Mesh(world_size, dp=dp, pp=pp, tp=tp)
    return {d: mesh.groups(d) for d in ("dp", "pp", "tp")}


def _as_sets(groups):
    return sorted(tuple(g) for g in groups)


def _sum_over_groups(rank, world_size, groups):
    """Build the learner's groups (every rank, same order) and all-reduce each rank's id over its group."""
    import torch.distributed as dist
    from minipar import comm
    out = {}
    for dim in ("dp", "pp", "tp"):
        for ranks in groups[dim]:
            group = dist.new_group(ranks)
            if rank in ranks:
                t = torch.tensor([float(rank)])
                comm.all_reduce(t, group=group)
                out[dim] = int(t.item())
    return out


def check_mesh_groups(mesh_groups) -> None:
    """``mesh_groups(world_size, dp, pp, tp)`` -> {"dp": [[ranks]...], "pp": ..., "tp": ...}, the grid
    ``arange(world).view(dp, pp, tp)``: TP innermost (neighbouring ranks), DP outermost."""
    for world_size, dp, pp, tp in SHAPES:
        want = _expected_groups(world_size, dp, pp, tp)
        got = mesh_groups(world_size, dp, pp, tp)
        if not isinstance(got, dict) or set(got) != {"dp", "pp", "tp"}:
            fail(f"mesh_groups({world_size}, dp={dp}, pp={pp}, tp={tp})", "a dict with keys 'dp', 'pp', 'tp'",
                 got, "return one list of groups per dimension")
        for dim in ("dp", "pp", "tp"):
            if _as_sets(got[dim]) != _as_sets(want[dim]):
                swapped = {d: _as_sets(got[dim]) == _as_sets(want[d]) for d in ("dp", "pp", "tp")}
                hint = next((f"your {dim} groups are the {d} groups" for d, same in swapped.items() if same),
                            "the grid is arange(world).view(dp, pp, tp): a group varies one coordinate and "
                            "fixes the other two")
                fail(f"{dim} groups of {dp}×{pp}×{tp}", want[dim], got[dim],
                     hint + " (TP innermost: its ranks are neighbours, rank + 1; DP outermost: rank + pp·tp)")
            for g in got[dim]:
                if list(g) != sorted(g):
                    fail(f"order inside a {dim} group of {dp}×{pp}×{tp}", sorted(g), g,
                         "list a group's ranks by their coordinate along the dimension (ascending)")
    groups = mesh_groups(8, 2, 2, 2)
    sums = run_on_ranks(_sum_over_groups, 8, groups, what="your groups")
    for rank, got in enumerate(sums):
        for dim, total in got.items():
            want = sum(Mesh(8, dp=2, pp=2, tp=2).group_ranks(dim, rank))
            if total != want:
                fail(f"all-reduce of the rank ids over rank {rank}'s {dim} group", want, total,
                     "this rank talks to the wrong peers")
    print("right: dp, pp and tp groups for 5 meshes; on 8 ranks every rank talks to its own groups")


def _memory(psi, dp, pp, tp, zero):
    return psi / (pp * tp) * (2 + 2 + 12 / (dp if zero else 1))


CASES = [(1e9, 2, 2, 2, 0), (1e9, 2, 2, 2, 1), (175e9, 6, 64, 8, 0), (175e9, 6, 64, 8, 1), (7e9, 8, 1, 1, 1),
         (7e9, 1, 4, 2, 0)]


def check_memory_per_rank(memory_per_rank) -> None:
    """``memory_per_rank(psi, dp=, pp=, tp=, zero=)`` -> model-state bytes per GPU under mixed-precision Adam
    (2 + 2 + 12 bytes per parameter), ZeRO-1 (zero=1) sharding the 12 over dp."""
    for psi, dp, pp, tp, zero in CASES:
        want = _memory(psi, dp, pp, tp, zero)
        got = memory_per_rank(psi, dp=dp, pp=pp, tp=tp, zero=zero)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-6 * want:
            if isinstance(got, (int, float)):
                if abs(got - want / dp) < 1e-6 * want and dp > 1:
                    mistake = "data parallelism replicates the model: only ZeRO divides (some of) it by dp"
                elif abs(got - psi / (pp * tp) * (2 + (2 + 12) / dp)) < 1e-6 * want and zero:
                    mistake = "ZeRO-1 shards only the optimizer state; sharding the gradients too is ZeRO-2"
                elif abs(got - _memory(psi, dp, pp, 1, zero)) < 1e-6 * want and tp > 1:
                    mistake = "tensor parallelism splits every layer's weights t ways: divide by tp too"
                elif abs(got - _memory(psi, dp, 1, tp, zero)) < 1e-6 * want and pp > 1:
                    mistake = "each pipeline stage holds 1/pp of the layers: divide by pp too"
                else:
                    mistake = "Ψ/(pp·tp) parameters per GPU, each 2 (fp16 weight) + 2 (fp16 grad) + 12 (fp32 " \
                              "master + Adam moments; /dp under ZeRO-1) bytes"
            else:
                mistake = "return a number of bytes"
            fail(f"memory_per_rank(Ψ={psi:g}, dp={dp}, pp={pp}, tp={tp}, zero={zero})", f"{want:.6g} B",
                 got, mistake)
    print("right: model-state bytes per GPU for 6 layouts, GPT-3's among them")


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3 * 8, 6, generator=g, dtype=torch.float64), torch.randn(6, 8, generator=g,
                                                                               dtype=torch.float64)


def check_reshard(reshard) -> None:
    """``reshard(shards, kind, parts, t_new)`` -> the t_new shards of the same parameter: ``kind`` "rows"
    (column-parallel: rows, ``parts`` stacked blocks such as Q, K, V each split t ways) or "cols"
    (row-parallel weight: columns)."""
    qkv, proj = _qkv()
    for kind, full, parts in (("rows", qkv, 3), ("rows", proj.T.contiguous(), 1), ("cols", proj, 1)):
        cut = (lambda w, r, t: shard_rows(w, r, t, parts)) if kind == "rows" else shard_cols
        for t_old, t_new in ((2, 4), (4, 2), (2, 1), (1, 2)):
            shards = [cut(full, r, t_old) for r in range(t_old)]
            want = [cut(full, r, t_new) for r in range(t_new)]
            got = reshard([s.clone() for s in shards], kind, parts, t_new)
            ok = isinstance(got, (list, tuple)) and len(got) == t_new and all(
                isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))
            if not ok:
                naive = torch.cat(shards, dim=0 if kind == "rows" else 1)
                if kind == "rows" and parts > 1 and isinstance(got, (list, tuple)) and len(got) == t_new and \
                        all(torch.equal(a, b) for a, b in zip(got, naive.chunk(t_new))):
                    mistake = ("a fused QKV shard is this rank's Q rows, then its K rows, then its V rows: "
                               "concatenating the shards does not give Q;K;V back. Undo it part by part")
                elif isinstance(got, (list, tuple)) and len(got) != t_new:
                    mistake = f"return t_new = {t_new} shards"
                else:
                    mistake = ("rebuild the full tensor (rows: per part, concatenate the ranks' pieces; cols: "
                               "concatenate along dim 1), then cut it for t_new ranks the same way")
                fail(f"reshard a {kind} parameter {tuple(full.shape)} (parts={parts}) from t={t_old} to "
                     f"t={t_new}", [tuple(w.shape) for w in want],
                     [tuple(a.shape) for a in got] if isinstance(got, (list, tuple)) else got, mistake)
    print("right: column-parallel (fused QKV too) and row-parallel weights resharded between 1, 2 and 4 ranks")
