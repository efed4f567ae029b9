"""``python -m minipar train``: train the tiny GPT on a dp × pp × tp mesh from the shell.

    python -m minipar train --dp 2 --pp 2 --tp 2 --schedule 1f1b --micro-batches 8 --steps 20
    python -m minipar train --dp 1 --pp 1 --tp 1 --steps 20 --json            # the single-device run
    python -m minipar train --dp 2 --pp 2 --tp 2 --steps 2 --save ckpt        # then:
    python -m minipar train --dp 1 --pp 2 --tp 4 --steps 4 --resume ckpt      # continue in another layout
    torchrun --nproc_per_node=8 -m minipar train --dp 2 --pp 2 --tp 2         # torchrun's ranks instead

It starts dp·pp·tp local processes itself (:func:`minipar.launch`), or, when ``torchrun`` started it, runs on
this process's rank. ``--backend auto`` (the default) is NCCL with one GPU per rank (GPU ``LOCAL_RANK``) when
CUDA is available, else gloo on the CPU; ``--backend gloo`` is always the CPU; ``--backend nccl`` without a GPU,
or a local launch of more ranks than GPUs, exits with code 2. The CUDA path is written and checked on CPU by a
device watch (tests/test_device_path.py: every tensor the step creates names its device); it has not yet run
on a GPU. Progress (step, loss, tokens/s) goes to standard error as it happens; ``--json`` prints
one JSON object per step on standard output (``step``, ``loss``, ``tokens_per_s``, ``seconds``), so two
layouts can be compared by a script. ``--steps N`` trains until global step N; ``--resume DIR`` starts from
the step saved in DIR. Bad flags and layouts that cannot work exit with code 2 before any process starts.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from ..launcher import choose_backend_and_device
from . import checkpoint
from .parallel3d import SCHEDULES, Trainer3D, validate

__all__ = ["main", "build_parser", "make_recipe", "train_rank", "cuda_facts"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minipar train", description=__doc__.split("\n\n")[0])
    layout = p.add_argument_group("layout (dp × pp × tp ranks)")
    layout.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    layout.add_argument("--pp", type=int, default=1, help="pipeline stages")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    layout.add_argument("--sp", action="store_true", help="sequence parallelism inside the TP group")
    layout.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                        help="ZeRO stage over the DP group (1; 2 and 3 are refused with PP, with the reason)")
    layout.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    layout.add_argument("--virtual-stages", type=int, default=1, dest="v", help="chunks per rank (interleaved)")
    layout.add_argument("--micro-batches", type=int, default=8, help="m, per step")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=20, help="train until this global step")
    train.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    train.add_argument("--seq-len", type=int, default=16)
    train.add_argument("--n-layer", type=int, default=4)
    train.add_argument("--n-head", type=int, default=4)
    train.add_argument("--n-embd", type=int, default=32)
    train.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--save", metavar="DIR", help="save a checkpoint at the end")
    train.add_argument("--resume", metavar="DIR", help="continue from the checkpoint in DIR (any layout)")
    train.add_argument("--json", action="store_true", help="one JSON object per step on standard output")
    train.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                       help="auto: NCCL on one GPU per rank when CUDA is available, else gloo on the CPU; gloo: "
                            "the CPU; nccl: the GPUs (an error without them). The GPU path is checked on CPU "
                            "by a device watch, not yet run on a GPU")
    train.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    return p


def make_recipe(args):
    from ..check import gpt_recipe
    recipe = gpt_recipe(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=max(32, args.seq_len))
    recipe.dtype = DTYPES[args.dtype]
    return recipe


def cuda_facts(backend: str) -> dict:
    """What torch.cuda says, asked only if ``backend`` may use a GPU: a forked gloo rank never touches CUDA."""
    ask = backend != "gloo" and torch.cuda.is_available()
    return dict(cuda_available=ask, device_count=torch.cuda.device_count() if ask else 0)


def train_rank(rank: int, world_size: int, recipe, *, layout: dict, steps: int, save: str | None = None,
               resume: str | None = None, as_json: bool = False, out_fd: int = 1, err_fd: int = 2) -> list:
    """One rank of the command: build the mesh and the model on this rank's device (its process group's
    backend and ``LOCAL_RANK``), load, train to ``steps``, save. The rank that holds the loss first (last
    stage, dp 0, tp 0) writes the progress lines. Returns [(step, loss)]."""
    backend = dist.get_backend()                 # what the launcher or torchrun started
    _, device = choose_backend_and_device(backend, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                                          **cuda_facts(backend))
    trainer = Trainer3D(rank, world_size, recipe, **layout, device=device)
    start = checkpoint.load(trainer, resume) if resume else 0
    reporter = trainer.mesh.is_last_stage and trainer.mesh.coord("dp") == 0 and trainer.mesh.coord("tp") == 0
    tokens = recipe.batches[0][0].numel()
    history = []
    for step in range(start, steps):
        t0 = time.perf_counter()
        loss = trainer.step(*recipe.batches[step], step)
        seconds = time.perf_counter() - t0
        if reporter:
            history.append((step + 1, loss))
            os.write(err_fd, f"step {step + 1:4d}/{steps}  loss {loss:.6f}  {tokens / seconds:,.0f} tokens/s\n"
                     .encode())
            if as_json:
                line = {"step": step + 1, "loss": loss, "tokens_per_s": tokens / seconds, "seconds": seconds}
                os.write(out_fd, (json.dumps(line) + "\n").encode())
    if save:
        folder = checkpoint.save(trainer, save, steps)
        if reporter:
            os.write(err_fd, f"saved step {steps} to {folder}\n".encode())
    return history


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    recipe = make_recipe(args) if args.steps >= 1 else parser.error(f"--steps must be >= 1, got {args.steps}")
    world_size = args.dp * args.pp * args.tp
    layout = dict(dp=args.dp, pp=args.pp, tp=args.tp, sp=args.sp, zero=args.zero, schedule=args.schedule,
                  micro_batches=args.micro_batches, v=args.v)
    try:
        validate(recipe, world_size=world_size, **layout)
    except ValueError as exc:
        parser.error(f"this layout cannot work: {exc}")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun and int(os.environ["WORLD_SIZE"]) != world_size:
        parser.error(f"torchrun started {os.environ['WORLD_SIZE']} processes, but --dp {args.dp} × --pp "
                     f"{args.pp} × --tp {args.tp} = {world_size}")
    if args.resume:
        try:
            folder = checkpoint.latest(args.resume)
            saved = checkpoint.read_manifest(folder)
            checkpoint.verify(folder, saved)
        except checkpoint.CheckpointError as exc:
            parser.error(f"cannot resume: {exc}")
        if saved["step"] >= args.steps:
            parser.error(f"--steps {args.steps}: the checkpoint in {args.resume} is already at step {saved['step']}")
    try:
        backend, _ = choose_backend_and_device(args.backend, local_rank=0, **cuda_facts(args.backend))
    except ValueError as exc:
        parser.error(f"--backend {args.backend}: {exc}")
    gpus = cuda_facts(backend)["device_count"]
    if backend == "nccl" and not torchrun and world_size > gpus:
        parser.error(f"--backend {args.backend}: {world_size} ranks but {gpus} GPU(s) here, and NCCL cannot put two "
                     f"ranks on one GPU (use --backend gloo, or torchrun across machines)")
    from ..launcher import launch
    fds = (1, 2) if torchrun else (os.dup(1), os.dup(2))     # the ranks write progress to our stdout/stderr
    try:
        launch(train_rank, world_size, recipe, layout=layout, steps=args.steps, save=args.save,
               resume=args.resume, as_json=args.json, out_fd=fds[0], err_fd=fds[1], backend=backend,
               timeout=args.timeout, quiet=True)
    finally:
        if not torchrun:
            os.close(fds[0]), os.close(fds[1])
    return 0
