"""Chapter 01's displays: each prints (or draws) what one cell ran and holds it to the chapter's claims
(:mod:`.claims`), printing nothing more when they hold — so a cell ends with one ``report.show_...(...)``."""
from __future__ import annotations

import matplotlib.pyplot as plt

from minipar import comm
from minipar.tensor import matmul_split as ms

from . import claims
from .figures import draw_split
from .measure import format_table, format_w_held

ADAM_BYTES_PER_PARAM = 4 + 4 + 8   # fp32 weight, its gradient, Adam's first and second moments

__all__ = ["show_reference", "show_table", "draw_splits", "show_two_ranks", "show_w_held", "show_four_ranks", "show_row_whole_x",
           "show_refused",
           "column_backward_answer", "column_over_data_answer", "show_bigger_batch", "show_whole_y", "show_real_size",
           "show_column_then_row", "show_training"]


def show_reference(reference: dict, x, w, dy) -> None:
    print({k: tuple(v.shape) for k, v in reference.items()})
    claims.check_autograd_formulas(reference, dy, w, x)   # autograd = the formulas


def show_table(table: dict, x_shape, w_shape) -> None:
    print(format_table(table, x_shape, w_shape))


def draw_splits(per_rank: list, whole: dict, splits=ms.SPLITS) -> None:
    """Who holds which block, drawn from the pieces the ranks held (hatched: a partial sum)."""
    for split in splits:
        draw_split(split, [r[split] for r in per_rank], whole)
        plt.show()


def show_two_ranks(table_2: dict, x_shape, w_shape) -> None:
    """2 ranks, x 4×5, w 5×8: all-reduce of dw (160 B), dx (80 B), y (128 B), 2·1/2·S each; w held once."""
    show_table({s: table_2[s] for s in ms.SPLITS}, x_shape, w_shape)   # the row split fed a whole x waits for §4
    claims.check_run_live_2_ranks_equal(table_2)


def column_backward_answer(table_2: dict) -> dict:
    """reveal()'s answer for §3's prediction: the bytes each rank sent in the column split's backward."""
    return dict(measured=table_2["column"].backward[0], what="bytes each rank sent in the column split's backward, "
                "2 ranks", source="logged", formula=table_2["column"].backward_formula, unit="bytes")


def column_over_data_answer(table_b: dict, x, w) -> dict:
    """reveal()'s answer for §5's prediction: backward bytes, column split over data parallelism, 4 ranks."""
    sent = {s: table_b[s].backward[0] for s in ("column", "data")}
    predicted = {s: ms.predicted_bytes(s, x.shape, w.shape, 4)["backward"] for s in ("column", "data")}
    return dict(measured=sent["column"] / sent["data"], what=f"backward bytes, column split ÷ data parallelism, "
                f"x {x.shape[0]}×{x.shape[1]}", source="logged", formula=predicted["column"] / predicted["data"])


def show_w_held(table: dict, w_shape) -> None:
    """Bytes of w each rank keeps after the forward: all of it under data parallelism, once over the ranks
    under the column and row splits."""
    w_bytes = w_shape[0] * w_shape[1] * 4
    print(format_w_held({s: table[s] for s in ms.SPLITS}, w_bytes))
    claims.check_w_held_once(table, w_bytes)


def show_four_ranks(per_rank_4: list, table_4: dict, x, w) -> None:
    """The 4-rank table of the three splits (w's 5 rows split 2, 1, 1, 1); §6 shows the same launch's row split
    fed a whole x (:func:`show_row_whole_x`)."""
    show_table({s: table_4[s] for s in ms.SPLITS}, x.shape, w.shape)
    claims.check_run_live_4_ranks_uneven(table_4, table_4["row_whole_x"].backward, _padded_all_gather(x))


def _padded_all_gather(x) -> float:
    b, k = x.shape
    return comm.predicted_bytes_sent("all_gather", 4 * b * max(ms.shard_sizes(k, 4)) * 4, 4)


def show_row_whole_x(table_4: dict, x, w) -> None:
    """The row split fed a whole x, from §4's 4-rank launch: its backward all-gathers dx's uneven column pieces
    (2, 1, 1, 1 of x's 5 columns), each padded to the largest, 2 columns."""
    b, k = x.shape
    show_table({"row_whole_x": table_4["row_whole_x"]}, x.shape, w.shape)
    sent = table_4["row_whole_x"].backward
    pieces = ms.shard_sizes(k, 4)
    cols = max(pieces)
    mean = comm.predicted_bytes_sent("all_gather", b * k * 4, 4)
    # the ring all-gather's rank 0 forwards pieces 0, N−1, …, 2 (rank r sends pieces r, r−1, …, r−N+2)
    rank0 = sum(pieces[-j % 4] for j in range(3)) * b * 4
    print(f"\nbackward all-gather of dx ({b}×{k}) in column pieces {pieces}: "
          f"every rank sent {sent[0]} bytes: 3 pieces, each padded to {b}×{cols} floats ({b * cols * 4} B); "
          f"without padding rank 0 would send {rank0} B (the ranks' mean, (N−1)/N·|dx|, is {mean:.0f} B)")
    claims.check_unpadded_rank0(rank0, mean)
    claims.check_run_live_4_ranks_uneven(table_4, sent, _padded_all_gather(x))


def show_refused(run, *args, **kwargs) -> None:
    """``run(*args, **kwargs)`` must raise ValueError (before any process starts); prints its message."""
    try:
        run(*args, **kwargs)
    except ValueError as e:
        print("ValueError:", e)
    else:
        raise AssertionError(f"{kwargs} was not refused")


def show_bigger_batch(table_b: dict, x, w) -> None:
    """x 64×5 on 4 ranks: the table; the column split's all-reduce of dx against data parallelism's of dw."""
    k, m = w.shape
    show_table({s: table_b[s] for s in ms.SPLITS}, x.shape, w.shape)   # the row split fed a whole x: §6
    claims.check_column_split_trades_dw_for_dx(table_b, {s: table_b[s].backward[0] for s in ms.SPLITS}, k, m)


def show_whole_y(per_rank_b: list, x, w) -> None:
    """The all-gather that gives every rank the whole y after a column split: measured against (N−1)/N·|y|."""
    gathered_y = per_rank_b[0]["column"]["bytes"]["gather_y"]       # all-gather of y's columns
    formula = comm.predicted_bytes_sent("all_gather", x.shape[0] * w.shape[1] * 4, 4)
    print(f"column split, the whole y on every rank: all-gather, measured {gathered_y} bytes, "
          f"formula (N-1)/N·|y| = {formula:.0f} bytes")
    claims.check_whole_y_is_an_all_gather(gathered_y, formula)


def show_real_size(b: int = 16384, d: int = 4096, n: int = 4) -> None:
    """The formulas at a real size (x b×d · w d×d, float32, n ranks): bytes each rank sends, and the weight's
    training state it keeps (w, its gradient, Adam's two moments)."""
    real = {s: ms.predicted_bytes(s, (b, d), (d, d), n) for s in ms.SPLITS}
    state = {s: max(ms.shard_sizes(d, n)) * d * ADAM_BYTES_PER_PARAM if s != "data"
             else d * d * ADAM_BYTES_PER_PARAM for s in ms.SPLITS}
    print(f"x {b}×{d} · w {d}×{d}, float32, {n} ranks (formulas), MiB per rank:\n"
          f"{'split':7} {'fwd sent':>9} {'bwd sent':>9} {'w state':>9}")
    for s in ms.SPLITS:
        print(f"{s:7} {real[s]['forward'] / 2**20:>9.0f} {real[s]['backward'] / 2**20:>9.0f} {state[s] / 2**20:>9.0f}")
    k = 8   # gradient accumulation: one all-reduce of dw per k micro-batches; the splits of w pay theirs on each
    print(f"data, accumulating k = {k} micro-batches: {real['data']['backward'] / k / 2**20:.0f} MiB per micro-batch"
          f" (its one all-reduce of dw per optimizer step, shared by the {k})")
    print(f"w state: w, its gradient and Adam's two moments, 4 + 4 + 8 = {ADAM_BYTES_PER_PARAM} bytes/param, all fp32")
    claims.check_real_size_column_sends_4x(real)
    claims.check_real_size_state_per_rank(state)


def show_column_then_row(run: dict, world_size: int) -> None:
    """Megatron's pair: rank 0's ring sends and bytes in each pass, beside the one all-reduce each should be."""
    ref, r0 = run["reference"], run["per_rank"][0]
    print(f"column then row on {world_size} ranks, z = (x·w1)·w2, rank 0's log:")
    for phase, what in (("forward", "z"), ("backward", "dx")):
        s = ref[what].numel() * 4
        print(f"  {phase:8}: {r0['sends'][phase]} ring sends, {r0['sent'][phase]:.0f} B = one all-reduce of "
              f"{what} ({s} B): 2(N-1)/N·S = {2 * (world_size - 1) / world_size * s:.0f} B")
    worst = max(float((r[k] - ref[k]).abs().max()) for r in run["per_rank"] for k in ("z", "dx"))
    print(f"  no all-gather: h stayed in column pieces; z and dx equal one device, max |Δ| = {worst:.1e}")
    claims.check_column_then_row(run, world_size)


def show_training(comparisons: dict) -> None:
    """{split: an equivalence check's comparison} of three SGD steps on 4 ranks against one device."""
    for split, c in comparisons.items():
        c.assert_ok()
        print(f"{split:6} split on 4 ranks: loss and w after 3 SGD steps match one device, "
              f"max |Δ| = {c.max_abs_diff:.1e} (allowed: {c.atol:g} + {c.rtol:g}·|ref|)")
