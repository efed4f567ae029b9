"""``python -m minipar train``: train the tiny GPT on a dp × pp × tp mesh from the shell.

    python -m minipar train --dp 2 --pp 2 --tp 2 --schedule 1f1b --micro-batches 8 --steps 20
    python -m minipar train --dp 1 --pp 1 --tp 1 --steps 20 --json            # the single-device run
    python -m minipar train --dp 2 --cp 2 --tp 2 --cp-method ring-zigzag      # context parallelism too
    python -m minipar train --dp 2 --pp 2 --tp 2 --ep 2 --experts 4 --top-k 2  # MoE, experts over dp × cp
    python -m minipar train --dp 4 --ep 4 --experts 8 --dropless --micro-batches 4   # no capacity (dropless)
    python -m minipar train --dp 2 --ep 2 --experts 4 --shared-experts 1 --granularity 2   # DeepSeekMoE experts
    python -m minipar train --dp 2 --ep 2 --experts 4 --bias-rate 1e-3 --micro-batches 1    # loss-free balancing
    python -m minipar train --dp 2 --pp 2 --tp 2 --steps 2 --save ckpt        # then:
    python -m minipar train --dp 1 --pp 2 --tp 4 --steps 4 --resume ckpt      # continue in another layout
    python -m minipar train --steps 200 --save-every 10 --resume ckpt --save ckpt   # first launch = restart
    torchrun --nproc_per_node=8 -m minipar train --dp 2 --pp 2 --tp 2         # torchrun's ranks instead
    python -m minipar train --replicas 3 --tp 2 --json      # 3 fault-tolerant replica groups (minipar.fault)

It starts dp·pp·cp·tp local processes itself (:func:`minipar.launch`), or, when ``torchrun`` started it, runs on
this process's rank. ``--backend auto`` (the default) is NCCL with one GPU per rank (GPU ``LOCAL_RANK``) when
CUDA is available, else gloo on the CPU; ``--backend gloo`` is always the CPU; ``--backend nccl`` without a GPU,
or a local launch of more ranks than GPUs, exits with code 2. The CUDA path is written and checked on CPU by a
device watch (tests/test_device_path.py: every tensor the step creates names its device); it has not yet run
on a GPU. Progress (step, loss, tokens/s) goes to standard error as it happens; ``--json`` prints
one JSON object per step on standard output (``step``, ``loss``, ``tokens_per_s``, ``seconds``), so two
layouts can be compared by a script.

Before any process starts, every flag and the layout are checked (exit 2, one line); so is the checkpoint:
``--resume DIR`` refuses a checkpoint of another run (model config, seed, dtype or data differ: all listed)
and starts fresh from a folder with no checkpoint yet, so one command line is both the first launch and the
restart (torchrun ``--max-restarts``); ``--save DIR`` is created and test-written first, never replaces
another run's checkpoint or a later step without ``--overwrite``, and is locked while the run writes (a second
run on it is refused, naming the holder's pid and host, or waits ``--wait-for-lock`` seconds); ``--save-every N``
saves every N steps, ``--keep N`` keeps the newest N (default 3); a full disk names the file and the checkpoint
``latest`` still names.
Nodes: ranks are numbered node by node (``LOCAL_WORLD_SIZE`` under torchrun, ``--nproc-per-node`` for a
local launch that stands for several nodes); a tp group that spans nodes is named in a warning, or refused
with ``--strict-nodes``. Several nodes must ``--save`` onto a shared filesystem (the same folder on every
node): the ranks check it before training. ``SIGTERM`` stops the ranks and removes the launcher's folder.
``--data FILE`` trains on the learner's own UTF-8 text (``--tokens byte`` or ``char``); its last tenth is held
out, and its loss is logged beside the training loss every ``--eval-every`` steps (``eval_loss`` in ``--json``).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from ..recipe import gpt_recipe
from ..datasets import lm_batch, lm_batches
from .. import launcher
from ..launcher import RankError, choose_backend_and_device
from ..layout import Layout
from ..fault import command as replicated, flags as replica_flags, replicas
from . import checkpoint, experts, guard, preflight
from .async_checkpoint import AsyncCheckpointer
from ..debug import sdc
from .cli_flags import DTYPES, KEEP, build_parser
from .relay import ProgressRelay, write_progress
from .parallel3d import DEFAULTS, Trainer3D, validate
from .preflight import groups_across_nodes

__all__ = ["main", "build_parser", "make_recipe", "train_rank", "cuda_facts", "groups_across_nodes",
           "layout_of"]

def make_recipe(args, data: dict | None = None):
    """The tiny GPT (``--experts``: its MoE variant) on the Markov corpus, or on ``data`` (its vocabulary)."""
    shape = dict(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, n_head=args.n_head,
                 n_layer=args.n_layer, n_embd=args.n_embd, block_size=max(32, args.seq_len),
                 **({"vocab_size": data["vocab_size"]} if data else {}))
    recipe = (experts.hybrid_moe_recipe(layout_of(args), experts=args.experts, k=args.top_k, **shape,
              capacity_factor=args.capacity_factor, dropless=getattr(args, "dropless", False),
              shared=getattr(args, "shared_experts", 0), granularity=getattr(args, "granularity", 1),
              bias_rate=getattr(args, "bias_rate", 0.0))
              if getattr(args, "experts", 0) else gpt_recipe(**shape))
    if data:
        recipe.batches = lm_batches(data["train"], args.batch_size, args.seq_len, args.steps, seed=args.seed)
    recipe.dtype = DTYPES[args.dtype]
    return recipe


def layout_of(args) -> Layout:
    return Layout(dp=args.dp, pp=args.pp, tp=args.tp, sp=args.sp, zero=args.zero, schedule=args.schedule,
                  micro_batches=args.micro_batches, v=args.v, cp=args.cp, cp_method=args.cp_method, ep=args.ep)


def identity_of(args, recipe, data: dict | None = None) -> dict:
    data = {**(data["identity"] if data else {"source": "markov", "tokens": preflight.CORPUS_TOKENS}),
            "batch_size": args.batch_size, "seq_len": args.seq_len}
    return guard.run_identity(recipe.model().cfg, seed=args.seed, dtype=recipe.dtype, data=data)


def cuda_facts(backend: str) -> dict:
    """What torch.cuda says, asked only if ``backend`` may use a GPU: a forked gloo rank never touches CUDA."""
    ask = backend != "gloo" and torch.cuda.is_available()
    return dict(cuda_available=ask, device_count=torch.cuda.device_count() if ask else 0)


def train_rank(rank: int, world_size: int, recipe, *, layout: Layout | dict, steps: int, save: str | None = None,
               resume: str | None = None, save_every: int | None = None, keep: int | None = None,
               run: dict | None = None, async_save: bool = False, check_gradients: bool = False,
               held_out: tuple | None = None, eval_every: int = 10, as_json: bool = False, out_fd: int | str = 1,
               err_fd: int | str = 2, invariant: bool = False) -> list:
    """One rank of the command: build the mesh and the model on this rank's device (its process group's
    backend and ``LOCAL_RANK``), check the save folder is shared, load ``resume`` (a folder holding a
    checkpoint), train to ``steps``, save every ``save_every`` steps and at the end. The rank that holds the
    loss first (last stage, dp 0, tp 0) writes the progress lines; with ``held_out`` (inputs, targets) they
    carry the held-out loss every ``eval_every`` steps and at the last. ``async_save``: the saves are written on
    a thread while training goes on (:class:`AsyncCheckpointer`). ``check_gradients``: every step is checked for
    silent data corruption (:class:`minipar.debug.sdc.CheckedTrainer`). ``invariant``: the trainer's mode
    (:mod:`minipar.invariant_mode`), passed to each rank. Returns [(step, loss)]."""
    backend = dist.get_backend()                 # what the launcher or torchrun started
    _, device = choose_backend_and_device(backend, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                                          **cuda_facts(backend))
    if isinstance(layout, dict):                 # the keyword form, {"dp": 2, "pp": 2, "tp": 2, ...}
        layout = Layout.of(None, DEFAULTS, **layout)
    trainer = Trainer3D(rank, world_size, recipe, layout=layout, device=device, invariant=invariant)
    if save:
        guard.check_shared(save, trainer.device)
    start = checkpoint.load(trainer, resume) if resume else 0
    reporter = trainer.mesh.is_last_stage and all(trainer.mesh.coord(d) == 0 for d in ("dp", "cp", "tp"))
    tokens = recipe.batches[0][0].numel()
    history = []
    checked = sdc.CheckedTrainer(trainer) if check_gradients else None
    saver = AsyncCheckpointer(trainer, save, run=run, keep=keep) if save and async_save else None
    for step in range(start, steps):
        if saver:
            saver.step_started(step)
        t0 = time.perf_counter()
        loss = (checked or trainer).step(*recipe.batches[step], step)
        for found in (checked.findings if checked else []):
            if found.step == step and reporter:
                write_progress(err_fd, f"step {step + 1}: silent data corruption in rank {found.rank}'s gradient of "
                               f"{found.tensor} (found by {found.how}); the step was replayed\n")
        seconds = time.perf_counter() - t0
        evaluate = held_out is not None and ((step + 1) % eval_every == 0 or step + 1 == steps)
        held = held_out_loss(trainer, recipe, held_out, reporter) if evaluate else None
        if reporter:
            history.append((step + 1, loss))
            shown = f"  held-out {held:.6f}" if held is not None else ""
            write_progress(err_fd, f"step {step + 1:4d}/{steps}  loss {loss:.6f}{shown}  {tokens / seconds:,.0f} "
                           f"tokens/s\n")
            if as_json:
                line = {"step": step + 1, "loss": loss, "tokens_per_s": tokens / seconds, "seconds": seconds}
                line |= {"eval_loss": held} if held is not None else {}
                write_progress(out_fd, json.dumps(line) + "\n")
        if save and (step + 1 == steps or (save_every and (step + 1) % save_every == 0)):
            if saver:                                    # the previous write completes, this one starts
                saved, folder = saver.in_flight, saver.wait()
                saver.save(step + 1)
            else:
                saved, folder = step + 1, checkpoint.save(trainer, save, step + 1, run=run, keep=keep)
            if reporter and folder:
                write_progress(err_fd, f"saved step {saved} to {folder}\n")
    if saver:                                    # the last write: complete before the rank returns
        saved, folder = saver.in_flight, saver.finish()
        if reporter and folder:
            write_progress(err_fd, f"saved step {saved} to {folder}\n")
    return history


def held_out_loss(trainer, recipe, batch: tuple, reporter: bool) -> float | None:
    """The loss of the current parameters on the held-out ``batch`` (a collective): every rank's stages, full
    (:meth:`Trainer3D.full_params`), gathered as objects; ``reporter`` puts them into one reference model and
    runs it forward. Outside the step: its bytes are not the strategy's."""
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, trainer.full_params())
    if not reporter:
        return None
    model = recipe.model().to(dtype=recipe.dtype)
    model.load_state_dict({name: t for piece in pieces for name, t in piece.items()})
    model.eval()
    with torch.no_grad():
        return float(recipe.loss(model, *batch))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    layout = layout_of(args)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    lock = None
    try:
        preflight.check_flags(parser, args)
        replica_flags.check_flags(args)
        data = preflight.text_data(args)
        recipe = make_recipe(args, data)
        try:
            validate(recipe, world_size=layout.world_size, layout=layout, invariant=args.invariant)
            if args.replicas:                    # and each replica's B/R rows on the layout
                replicas.validate(recipe, replicas=args.replicas, layout=layout)
        except ValueError as exc:
            raise ValueError(f"this layout cannot work: {exc}") from None
        if args.async_checkpoint and not args.save:
            raise ValueError("--async-checkpoint writes the checkpoints of --save: give --save DIR")
        if args.check_gradients and (args.zero or args.experts or layout.dp * layout.cp == 1):
            raise ValueError("--check-gradients compares data-parallel replicas: it needs dp·cp > 1, and no --zero "
                             "(each gradient shard on one rank) or --experts")
        if torchrun and int(os.environ["WORLD_SIZE"]) != layout.world_size:
            shape = " × ".join(f"{d} {n}" for d, n in layout.sizes.items() if n > 1) or "one rank"
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes, but the layout ({shape}) has "
                             f"{layout.world_size} ranks")
        placement = preflight.check_nodes(args, layout, layout.world_size, torchrun)
        identity = identity_of(args, recipe, data)
        lock = preflight.take_folder(args)       # before reading it: nobody else writes there from now on
        resume, start = preflight.resume_point(args, identity) if args.resume else (None, 0)
        if args.save:
            preflight.check_save(args, identity, start)
        backend = _backend(args, layout.world_size, torchrun)
    except ValueError as exc:                    # CheckpointError is one
        if lock:
            guard.unlock_folder(lock)
        parser.error(str(exc).replace("\n", " "))
    if args.replicas:                            # R fault-tolerant replica groups: minipar.fault
        return replicated.main(args, recipe, layout)
    for line in placement:
        print(line, file=sys.stderr)
    if args.resume and resume is None:
        print(f"no checkpoint in {args.resume} yet: starting at step 0", file=sys.stderr)
    held = lm_batch(data["held_out"], args.batch_size, args.seq_len, 0, seed=args.seed) if data else None
    try:                                         # the --save folder is this run's until it ends
        return _launch(args, recipe, layout, backend, torchrun, resume=resume, held_out=held,
                       eval_every=args.eval_every, run={"seed": args.seed, "data": identity["data"]},
                       invariant=args.invariant)
    finally:
        if lock:
            guard.unlock_folder(lock)


def _backend(args, world_size: int, torchrun: bool) -> str:
    try:
        backend, _ = choose_backend_and_device(args.backend, local_rank=0, **cuda_facts(args.backend))
    except ValueError as exc:
        raise ValueError(f"--backend {args.backend}: {exc}") from None
    gpus = cuda_facts(backend)["device_count"]
    if backend == "nccl" and not torchrun and world_size > gpus:
        raise ValueError(f"--backend {args.backend}: {world_size} ranks but {gpus} GPU(s) here, and NCCL cannot put "
                         f"two ranks on one GPU (use --backend gloo, or torchrun across machines)")
    return backend


def _launch(args, recipe, layout, backend, torchrun, **kwargs) -> int:
    # the ranks write progress to our stdout/stderr: forked ranks through duplicates of its descriptors,
    # spawned ones (NCCL) through files relayed here
    relay = ProgressRelay() if not torchrun and launcher.default_start_method(backend) == "spawn" else None
    fds = (1, 2) if torchrun else relay.paths if relay else (os.dup(1), os.dup(2))

    def stop(signum, frame):                    # SIGTERM: leave through launch's cleanup (ranks, temp folder)
        raise SystemExit(128 + signum)
    previous = None if torchrun else signal.signal(signal.SIGTERM, stop)
    try:
        launcher.launch(train_rank, layout.world_size, recipe, layout=layout, steps=args.steps, save=args.save,
               save_every=args.save_every, keep=KEEP if args.keep is None else args.keep,
               async_save=args.async_checkpoint, check_gradients=args.check_gradients, as_json=args.json,
               out_fd=fds[0], err_fd=fds[1], backend=backend, timeout=args.timeout, quiet=True, **kwargs)
    except RankError as exc:                    # a rank failed: its one-line reason, exit 1
        print(f"python -m minipar train: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        if not torchrun:
            signal.signal(signal.SIGTERM, previous)
        if relay:
            relay.close()
        elif not torchrun:
            os.close(fds[0]), os.close(fds[1])
    return 0
