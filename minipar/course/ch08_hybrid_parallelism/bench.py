"""minipar's 3D layout against the same layout in PyTorch's own pieces, side by side on CPU ranks (gloo).

    python -m minipar bench torch3d                          # dp × pp × tp = 2×1×2 (4 ranks), 2×2×2 (8), then
                                                             # 2×2×2v2: interleaved 1F1B, 2 stages per rank
    python -m minipar bench torch3d --layouts 2x2x2 --json   # one JSON object per layout
    python -m minipar bench torch3d --fsdp                   # PyTorch's dp as fully_shard (ZeRO-3) instead

On every rank both trainers are built from the same TinyGPT and recipe: minipar's
:class:`~minipar.hybrid.parallel3d.Trainer3D` (its Mesh, TP layers, pipeline runtime and DDP Reducer) and
:class:`~.torch_side.TorchTrainer3D` (``init_device_mesh``, ``parallelize_module``, FSDP2's ``replicate`` or
``fully_shard`` over the dp sub-mesh, ``PipelineStage`` + ``Schedule1F1B`` or, for a layout written ``…v2``,
``ScheduleInterleaved1F1B`` against minipar's interleaved schedule, ``loss_parallel``). One step of
each (zero_grad, the pipeline schedule with the TP collectives, the dp gradient reduction, Adam, the loss
averaged over dp) is timed between barriers by :func:`minipar.course.bench.alternating_medians`, the two
alternating step by step; each trains its own copy on the same batch, so their losses stay equal (printed).

With ``replicate`` both sides keep whole replicas over dp and all-reduce the gradients (minipar's zero=0);
``--fsdp`` shards them (PyTorch gathers the parameters before use and reduce-scatters the gradients), which
minipar's 3D runtime does inside a pipeline only once per step (chapter 08 §5: ZeRO-2/3 with pp). On a 2-core machine 8 ranks
share the cores: trust the ratio of medians measured side by side, not the absolute figures.
"""
from __future__ import annotations

import argparse
import json

__all__ = ["bench_rank", "run", "main"]


def _recipe(layers, embd, batch, seq):
    from minipar.check import gpt_recipe
    return gpt_recipe(steps=1, batch_size=batch, seq_len=seq, n_layer=layers, n_embd=embd, n_head=4,
                      vocab_size=256, block_size=seq)


def bench_rank(rank, world_size, dp=2, pp=2, tp=2, micro_batches=4, layers=4, embd=128, batch=16, seq=64,
               iters=10, warmup=2, data_parallel="replicate", v=1):
    """On each rank: {name: median step seconds} and the losses each trainer saw (last stage)."""
    from minipar.course.bench import alternating_medians
    from minipar.hybrid.parallel3d import Trainer3D

    from .torch_side import TorchTrainer3D
    m = micro_batches if pp > 1 else 1
    schedule = "interleaved" if v > 1 else "1f1b" if pp > 1 else "gpipe"
    recipe = _recipe(layers, embd, batch, seq)
    x, y = recipe.batches[0]
    ours = Trainer3D(rank, world_size, recipe, dp=dp, pp=pp, tp=tp, micro_batches=m, schedule=schedule, v=v)
    theirs = TorchTrainer3D(rank, world_size, recipe, dp=dp, pp=pp, tp=tp, micro_batches=m, schedule=schedule,
                            data_parallel=data_parallel, v=v)
    losses = {"minipar": [], "torch": []}

    def step(name, trainer):
        def go():
            loss = trainer.step(x, y)
            if loss is not None:
                losses[name].append(float(loss))
        return go
    medians = alternating_medians({"minipar": step("minipar", ours), "torch": step("torch", theirs)},
                                  iters=iters, warmup=warmup)
    return {"medians": medians, "losses": losses}


def run(layout=(2, 2, 2), quiet=True, v=1, **kwargs) -> dict:
    """Launch :func:`bench_rank` on dp·pp·tp ranks; medians (every rank's: the barriers make them the slowest
    rank's), their ratio, and the largest loss difference between the two trainers step by step."""
    from minipar.launcher import launch
    dp, pp, tp = layout
    per_rank = launch(bench_rank, dp * pp * tp, dp=dp, pp=pp, tp=tp, v=v, quiet=quiet, timeout=300, **kwargs)
    last = next(r for r in per_rank if r["losses"]["minipar"])
    diffs = [abs(a - b) for a, b in zip(last["losses"]["minipar"], last["losses"]["torch"])]
    med = per_rank[0]["medians"]
    return {"layout": f"{dp}x{pp}x{tp}" + (f"v{v}" if v > 1 else ""), "ranks": dp * pp * tp, "minipar_ms": round(1e3 * med["minipar"], 2),
            "torch_ms": round(1e3 * med["torch"], 2), "ratio_minipar_over_torch": round(med["minipar"] / med["torch"], 3),
            "steps": len(diffs), "max_loss_diff": max(diffs), "last_loss": last["losses"]["torch"][-1]}


def main(argv=None) -> int:
    """minipar's dp × pp × tp layouts (interleaved too) against the same layouts in PyTorch's own pieces, timed
    side by side on CPU ranks (gloo)."""
    parser = argparse.ArgumentParser(prog="python -m minipar bench torch3d", description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="2x1x2,2x2x2,2x2x2v2",
                        help="comma-separated dp x pp x tp; a suffix vN: interleaved, N stages per pp rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4, help="with pp > 1 (pp = 1 runs one batch)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--fsdp", action="store_true", help="PyTorch's dp as fully_shard instead of replicate")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout")
    a = parser.parse_args(argv)
    dp_kind = "fsdp" if a.fsdp else "replicate"
    if not a.json:
        print(f"TinyGPT {a.layers}L/{a.embd}h, vocab 256, global batch {a.batch}x{a.seq}, Adam, float32, CPU "
              f"ranks (gloo); {a.iters} alternating steps; torch dp = {dp_kind}")
    for text in a.layouts.split(","):
        dims, _, v = text.lower().partition("v")
        layout = tuple(int(d) for d in dims.split("x"))
        row = run(layout, v=int(v or 1), micro_batches=a.micro_batches, layers=a.layers, embd=a.embd,
                  batch=a.batch, seq=a.seq, iters=a.iters, data_parallel=dp_kind)
        row["torch_dp"] = dp_kind
        if a.json:
            print(json.dumps(row))
        else:
            print(f"  dp x pp x tp = {row['layout']} ({row['ranks']} ranks): minipar {row['minipar_ms']:8.2f} ms  "
                  f"torch {row['torch_ms']:8.2f} ms  ratio minipar/torch {row['ratio_minipar_over_torch']:.3f}  "
                  f"(max |Δloss| over {row['steps']} steps {row['max_loss_diff']:.2g})")
    return 0


def _record_torch_side(argv=None) -> int:
    """The PyTorch-side runs of docs/library.md (2×2×2 side by side, DDP over TP with a DeviceMesh), made now and
    written to their record."""
    from .recorded import main as record_main
    return record_main(argv)


# torch-side: the recorded runs of docs/library.md's "PyTorch's own pieces" (recorded.py)
BENCHMARKS = {"torch3d": main, "torch-side": _record_torch_side}
