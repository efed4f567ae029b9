"""Recomputation's time cost: training steps of the same model and batch with no, selective and full
recomputation (``minipar.recompute``), and PyTorch's own per-block ``torch.utils.checkpoint`` applied by
hand for comparison with minipar's full mode, timed alternately on one rank.

    python -m minipar bench recompute                       # 4 blocks, h=128, s=256, batch 8
    python -m minipar bench recompute --seq 512 --iters 20

Prints the median step time of each mode, its ratio to no recomputation, and the FLOPs counted for the
same step (``FlopCounterMode``, for every row, PyTorch's checkpoint included): full recomputation adds one forward of every block (~ +1/3 of the blocks'
FLOPs), selective only QKᵀ. The time ratio is what a learner should compare with the FLOP ratio: on a
CPU the non-matmul work (softmax, GeLU, LayerNorm, the checkpoint's bookkeeping) also gets recomputed.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils.checkpoint import checkpoint

from minipar.course.bench import alternating_medians
from minipar.loop import lm_loss

__all__ = ["bench_rank", "main"]


def _torch_checkpointed(model):
    """PyTorch's way, by hand: wrap every block's call in torch.utils.checkpoint (what full mode does)."""
    forward = model.forward

    def checkpointed(idx):
        x = model.embed(idx)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return model.head(model.ln_f(x))
    model.forward = checkpointed
    return model, forward


def bench_rank(rank, world_size, layers=4, embd=128, heads=4, seq=256, batch=8, iters=15, warmup=3):
    from minipar.models import GPTConfig, TinyGPT
    from minipar.recompute import MODES, apply_recompute, step_flops
    cfg = GPTConfig(n_layer=layers, n_embd=embd, n_head=heads, block_size=seq, vocab_size=256)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(256, (batch, seq), generator=g), torch.randint(256, (batch, seq), generator=g)
    models = {m: apply_recompute(TinyGPT(cfg), m) for m in MODES}
    models["torch checkpoint per block"] = _torch_checkpointed(TinyGPT(cfg))[0]
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}

    def step_of(name):
        model, opt = models[name], opts[name]

        def step():
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            lm_loss(logits, y).backward()
            opt.step()
        return step
    medians = alternating_medians({k: step_of(k) for k in models}, iters=iters, warmup=warmup)
    flops = {m: step_flops(apply_recompute(TinyGPT(cfg), m), x, y) for m in MODES}
    # counted on PyTorch's own checkpointing too (its recomputed forwards run under the counter in backward)
    flops["torch checkpoint per block"] = step_flops(_torch_checkpointed(TinyGPT(cfg))[0], x, y)
    return medians, flops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench recompute", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args(argv)
    from minipar.launcher import launch
    medians, flops = launch(bench_rank, 1, args.layers, args.embd, 4, args.seq, args.batch, args.iters,
                            timeout=600)[0]
    base = medians["none"]
    print(f"TinyGPT {args.layers}L, h={args.embd}, s={args.seq}, batch {args.batch}; one rank, "
          f"{torch.get_num_threads()} thread(s) here, 1 in the rank; median of {args.iters} alternating steps")
    print(f"{'mode':28}{'median ms':>10}{'× none':>8}{'GFLOP':>8}{'× none':>8}")
    for name, sec in medians.items():
        f = flops[name]
        print(f"{name:28}{sec * 1e3:10.1f}{sec / base:8.2f}{f / 1e9:8.2f}{f / flops['none']:8.2f}")
    return 0


BENCHMARKS = {"recompute": main}
