"""Chapter 01's measurement harness: run the three splits live, compare each with one device, and set the
bytes every rank sent beside the formula.

:func:`compare_and_measure` runs :func:`minipar.tensor.matmul_split.run_split` for all three splits in one
launch, with the all-reduces and all-gathers on minipar's send/recv rings (:func:`minipar.comm.ring_algorithms`):
the communication log then counts every message really sent. (For gloo's own collectives the log records the
formula itself, :func:`minipar.comm.predicted_bytes_sent`, so it would measure nothing.) Beside the library's
three splits it runs a fourth, ``row_whole_x`` (:func:`row_split_fed_whole_x`): the row split when every rank
starts with the whole x and cuts out its own columns, so its backward must all-gather dx. It reduces what the
ranks returned to one :class:`SplitMeasurement` per split; :func:`format_table` prints them.
"""
from __future__ import annotations

from dataclasses import dataclass

from minipar import comm, launch
from minipar.tensor import matmul_split as ms

__all__ = ["SplitMeasurement", "compare_and_measure", "format_table", "column_then_row", "row_split_fed_whole_x",
           "row_whole_x_bytes", "CASES"]

PHASES = ("forward", "backward")
CASES = ms.SPLITS + ("row_whole_x",)   # the three splits, and the row split fed a whole x
COLLECTIVE = {"data": {"backward": "all-reduce dw"}, "column": {"backward": "all-reduce dx"},
              "row": {"forward": "all-reduce y"},
              "row_whole_x": {"forward": "all-reduce y", "backward": "all-gather dx"}}
LABEL = {"row_whole_x": "row, whole x"}   # how the tables name a case
HELD = {"x": "x", "w": "w", "y": "y_piece"}   # what a rank keeps of x, w and y (after the forward's collective)


@dataclass
class SplitMeasurement:
    split: str
    max_abs_diff: float      # worst |gathered y, dx, dw − one device| over every rank
    forward: list            # bytes each rank's ring sends carried in the forward, from its communication log
    backward: list           # ... and in the backward
    forward_formula: float   # ms.predicted_bytes: one all-reduce of S bytes sends 2(N−1)/N · S per rank
    backward_formula: float
    ops: dict                # rank 0's calls per phase, {"forward": {op: (calls, bytes)}, ...}: the ring's send/recv
    holds: list              # bytes each rank holds after the forward, [{"x": .., "w": .., "y": ..}] per rank

    def agrees(self, tolerance: float) -> bool:
        """Equal to one device within ``tolerance``, and every rank sent exactly the formula's bytes."""
        return (self.max_abs_diff <= tolerance and all(b == self.forward_formula for b in self.forward)
                and all(b == self.backward_formula for b in self.backward))


def row_split_fed_whole_x(rank, world_size, x, w, dy, group=None) -> dict:
    """The row split when every rank holds the whole x (B×K): the forward cuts out x_i (the partner of a cut
    is an all-gather) and all-reduces y = Σ_i x_i w_i; the backward computes dx_i = dy w_iᵀ and dw_i = x_iᵀ dy
    locally, then all-gathers dx, because the layer before produced the whole x and needs its whole gradient.
    K need not divide by N: the all-gather pads every piece to the largest, so each rank sends
    (N−1)·B·⌈K/N⌉ elements. Returns :func:`minipar.tensor.matmul_split.run_split`'s keys."""
    k = x.shape[1]
    w_i = ms.shard(w, 0, rank, world_size)
    with comm.recording() as fwd_log:
        x_i = ms.shard(x, 1, rank, world_size)          # the cut: no communication in the forward
        y = ms.row_forward(x_i, w_i, group)
    with comm.recording() as bwd_log:
        dx_i, dw_i = ms.row_backward(x_i, w_i, dy)
        dx = ms.gather_pieces(dx_i, 1, k, group)        # the cut's partner: the whole dx on every rank
    with comm.recording() as cmp_log:                   # the whole dw, only to compare with one device
        dw = ms.gather_pieces(dw_i, 0, k, group)
    return {"x": x.clone(), "w": w_i, "dy": dy, "y_piece": y, "dx_piece": dx, "dw_piece": dw_i,
            "y": y, "dx": dx, "dw": dw,
            "bytes": {"forward": fwd_log.bytes_sent, "backward": bwd_log.bytes_sent, "gather_dw": cmp_log.bytes_sent},
            "ops": {"forward": fwd_log.by_op(), "backward": bwd_log.by_op()}}


def row_whole_x_bytes(x_shape, w_shape, n: int, itemsize: int = 4) -> dict:
    """The formula for :func:`row_split_fed_whole_x`'s bytes per rank: one all-reduce of y, 2(N−1)/N·B·M, and
    one all-gather of dx's column pieces, each padded to the largest: (N−1)·B·⌈K/N⌉."""
    (b, k), m = x_shape, w_shape[1]
    padded_dx = n * b * max(ms.shard_sizes(k, n)) * itemsize
    return {"forward": comm.predicted_bytes_sent("all_reduce", b * m * itemsize, n),
            "backward": comm.predicted_bytes_sent("all_gather", padded_dx, n)}


def _splits_on_rings(rank, world_size, splits, x, w, dy):
    with comm.ring_algorithms("all_reduce", "all_gather"):    # every byte a send the log counts
        runs = {s: ms.run_split(rank, world_size, s, x, w, dy) for s in splits}
        runs["row_whole_x"] = row_split_fed_whole_x(rank, world_size, x, w, dy)
        return runs


def compare_and_measure(world_size: int, x, w, dy, reference: dict) -> tuple:
    """Run every split, and the row split fed a whole x, on ``world_size`` ranks (one launch); return (per rank ``{split: run_split's dict}``,
    ``{split: SplitMeasurement}``). ``reference``: the one-device ``y``, ``dx`` and ``dw``."""
    for split in ms.SPLITS:
        ms.validate(split, tuple(x.shape), tuple(w.shape), world_size=world_size)
    per_rank = launch(_splits_on_rings, world_size, ms.SPLITS, x, w, dy, quiet=True)
    table = {}
    for split in CASES:
        worst = max(float((r[split][k] - reference[k]).abs().max()) for r in per_rank for k in ("y", "dx", "dw"))
        formula = (row_whole_x_bytes(tuple(x.shape), tuple(w.shape), world_size) if split == "row_whole_x"
                   else ms.predicted_bytes(split, tuple(x.shape), tuple(w.shape), world_size))
        holds = [{name: r[split][key].numel() * r[split][key].element_size() for name, key in HELD.items()}
                 for r in per_rank]
        table[split] = SplitMeasurement(split, worst, *[[r[split]["bytes"][p] for r in per_rank] for p in PHASES],
                                        formula["forward"], formula["backward"], per_rank[0][split]["ops"], holds)
    return per_rank, table


def format_table(table: dict, x_shape, w_shape) -> str:
    """The measurements as a text table (bytes of rank 0; the checks hold every rank to the formula): the bytes
    rank 0's ring sends carried in each phase beside the formula (a model)."""
    n = len(next(iter(table.values())).forward)
    lines = [f"{n} ranks, x {tuple(x_shape)} · w {tuple(w_shape)}, float32; bytes sent per rank (rank 0 shown)",
             f"{'split':12} {'max |Δ| vs 1 device':>20} {'fwd sent':>9} {'formula':>8} {'bwd sent':>9} "
             f"{'formula':>8}  collectives"]
    for s, m in table.items():
        names = "; ".join(f"{p}: {COLLECTIVE[s][p]}, {m.ops[p]['send'][0]} ring send{'s' * (m.ops[p]['send'][0] != 1)}"
                          for p in PHASES if m.ops[p]) or "-"
        lines.append(f"{LABEL.get(s, s):12} {m.max_abs_diff:>20.1e} {m.forward[0]:>9.0f} {m.forward_formula:>8.0f} "
                     f"{m.backward[0]:>9.0f} {m.backward_formula:>8.0f}  {names}")
    return "\n".join(lines)


def format_w_held(table: dict, w_bytes: int) -> str:
    """Bytes of w each rank holds after the forward, per split (measured from the pieces the ranks kept)."""
    lines = [f"{'split':12} {'bytes of w held, per rank':>26}  (all of w: {w_bytes} bytes)"]
    for s, m in table.items():
        lines.append(f"{LABEL.get(s, s):12} {', '.join(str(h['w']) for h in m.holds):>26}")
    return "\n".join(lines)


def _column_then_row_on_rank(rank, world_size, x, w1, w2, dz):
    """Megatron's pair on one rank: h_i = x·w1_i (column split of w1: nothing sent), z = Σ_i h_i·w2_i (row
    split of w2, fed h's column pieces as they are: an all-reduce of z); backward: dh_i = dz·w2_iᵀ locally,
    dx = Σ_i dh_i·w1_iᵀ (the column split's all-reduce of dx). No all-gather anywhere."""
    w1_i, w2_i = ms.shard(w1, 1, rank, world_size), ms.shard(w2, 0, rank, world_size)
    with comm.ring_algorithms("all_reduce", "all_gather"):    # every byte a send the log counts
        with comm.recording() as fwd:
            h_i = ms.column_forward(x, w1_i)
            z = ms.row_forward(h_i, w2_i)
        with comm.recording() as bwd:
            dh_i, dw2_i = ms.row_backward(h_i, w2_i, dz)
            dx, dw1_i = ms.column_backward(x, w1_i, dh_i)
    return {"z": z, "dx": dx, "dw1": dw1_i, "dw2": dw2_i, "sent": {"forward": fwd.bytes_sent, "backward": bwd.bytes_sent},
            "sends": {"forward": fwd.by_op().get("send", (0, 0))[0], "backward": bwd.by_op().get("send", (0, 0))[0]}}


def column_then_row(world_size: int, x, w1, w2, dz) -> dict:
    """Run z = (x·w1)·w2 with w1 cut by columns and w2 by rows on ``world_size`` ranks (one launch); returns
    ``per_rank`` (what each rank held and sent) and ``reference`` (z, dx, dw1, dw2 on one device, autograd)."""
    ms.validate("column", tuple(x.shape), tuple(w1.shape), world_size=world_size)
    ms.validate("row", (x.shape[0], w2.shape[0]), tuple(w2.shape), world_size=world_size)
    x_ref, w1_ref, w2_ref = (t.clone().requires_grad_() for t in (x, w1, w2))
    z_ref = x_ref @ w1_ref @ w2_ref
    z_ref.backward(dz)
    reference = {"z": z_ref.detach(), "dx": x_ref.grad, "dw1": w1_ref.grad, "dw2": w2_ref.grad}
    per_rank = launch(_column_then_row_on_rank, world_size, x, w1, w2, dz, quiet=True)
    return {"per_rank": per_rank, "reference": reference}
