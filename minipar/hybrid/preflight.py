"""What ``python -m minipar train`` checks before any process starts: every flag (exit 2, one line naming the
flag), the checkpoint ``--resume`` would load (of this run: model config, seed, dtype and data the same; a
folder with no checkpoint yet starts at step 0) and the folder ``--save`` would write (created, test-written,
never another run's checkpoint or a later step without ``--overwrite``), and where the groups sit on the
nodes (:func:`check_nodes`)."""
from __future__ import annotations

import argparse
import hashlib
import math
import os

from ..datasets import held_out, text_tokens
from ..layout import Layout
from ..mesh import Mesh
from . import checkpoint, guard

__all__ = ["CORPUS_TOKENS", "POSITIVE", "NODE_BOUND", "check_flags", "check_moe_flags", "text_data", "with_moe",
           "resume_point", "take_folder", "check_save", "groups_across_nodes", "check_nodes"]

CORPUS_TOKENS = 4096                     # minipar.check.gpt_recipe's Markov corpus
POSITIVE = ("dp", "pp", "tp", "v", "micro_batches", "steps", "batch_size", "seq_len", "n_layer", "n_head",
            "n_embd", "save_every", "local_world_size", "eval_every", "cp", "ep", "top_k", "granularity")
NODE_BOUND = ("tp",)                     # groups that talk every layer: across nodes they run at network speed


def check_flags(parser: argparse.ArgumentParser, args) -> None:
    """``ValueError`` naming the flag, for a value no layout can use (the layout's own rules come after)."""
    flag = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    for dest in POSITIVE:
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ValueError(f"{flag[dest]} must be a positive integer, got {value}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.n_embd % args.n_head:
        raise ValueError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    for dest, given in (("save_every", args.save_every is not None), ("keep", args.keep is not None),
                        ("wait_for_lock", args.wait_for_lock is not None), ("overwrite", args.overwrite)):
        if given and not args.save:            # it would change nothing: say so rather than ignore it
            raise ValueError(f"{flag[dest]} needs --save DIR")
    if args.wait_for_lock is not None and not (math.isfinite(args.wait_for_lock) and args.wait_for_lock >= 0):
        raise ValueError(f"--wait-for-lock must be a finite number of seconds >= 0, got {args.wait_for_lock}")
    if args.experts < 0:
        raise ValueError(f"--experts must be >= 0 (0: the dense GPT), got {args.experts}")
    if getattr(args, "dropless", False) and not args.experts:
        raise ValueError("--dropless needs an MoE model (--experts > 0): a dense GPT has no tokens to drop")
    check_moe_flags(args)
    if args.keep is not None and args.keep < 0:
        raise ValueError(f"--keep must be >= 0 (0: keep every checkpoint), got {args.keep}")
    if args.sp and args.tp == 1:
        raise ValueError("--sp splits the sequence over the tp group, and --tp 1 has none: it would change "
                         "nothing; drop --sp or set --tp > 1")


def check_moe_flags(args) -> None:
    """``--shared-experts``, ``--granularity`` and ``--bias-rate``: an MoE model's, in range, and loss-free
    balancing only where the trainer can move and keep its bias."""
    if args.shared_experts < 0:
        raise ValueError(f"--shared-experts must be >= 0, got {args.shared_experts}")
    if not (math.isfinite(args.bias_rate) and args.bias_rate >= 0):
        raise ValueError(f"--bias-rate must be a finite number >= 0 (0: off), got {args.bias_rate}")
    given = [f for f, on in (("--shared-experts", args.shared_experts), ("--granularity", args.granularity != 1),
                             ("--bias-rate", args.bias_rate)) if on]
    if given and not args.experts:
        raise ValueError(f"{given[0]} needs an MoE model (--experts > 0): a dense GPT has no experts")
    if args.bias_rate and args.micro_batches > 1:
        raise ValueError(f"--bias-rate with --micro-batches {args.micro_batches}: loss-free balancing moves its bias "
                         f"from one forward's load, and each rank would see only its last micro-batch's; use "
                         f"--micro-batches 1")
    if args.bias_rate and (args.save or args.resume):
        raise ValueError(f"--bias-rate with {'--save' if args.save else '--resume'}: loss-free balancing's routing "
                         f"biases are not saved in a checkpoint yet, and a resumed run would restart them at 0")


def text_data(args) -> dict | None:
    """``--data FILE``: {"train", "held_out": token ids, "vocab_size", "identity"} (the last tenth held out),
    or None without it; ``ValueError`` for a file that cannot be used, or a sequence longer than the text."""
    if not args.data:
        if args.seq_len > CORPUS_TOKENS - 2:
            raise ValueError(f"--seq-len {args.seq_len}: the corpus has {CORPUS_TOKENS} tokens, so a sequence and "
                             f"its next-token targets fit at most {CORPUS_TOKENS - 2}")
        return None
    tokens, vocab_size = text_tokens(args.data, args.tokens)
    train, held = held_out(tokens)
    for part, ids in (("training nine tenths", train), ("held-out tenth", held)):
        if len(ids) < args.seq_len + 2:
            raise ValueError(f"--data {args.data}: its {part} has {len(ids)} {args.tokens} tokens; --seq-len "
                             f"{args.seq_len} needs at least {args.seq_len + 2}")
    with open(args.data, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"train": train, "held_out": held, "vocab_size": vocab_size,
            "identity": {"source": "text", "sha256": digest, "tokens": args.tokens}}


def with_moe(identity: dict, args) -> dict:
    """``identity`` with ``--experts``, ``--top-k``, ``--capacity-factor`` and the other MoE flags in its config (what a checkpoint
    of an MoE run records: :func:`minipar.hybrid.guard.run_identity`)."""
    if not args.experts:
        return identity
    moe = argparse.Namespace(experts=args.experts, k=args.top_k, capacity_factor=args.capacity_factor,
                             dropless=getattr(args, "dropless", False), shared=getattr(args, "shared_experts", 0),
                             granularity=getattr(args, "granularity", 1),
                             bias_rate=getattr(args, "bias_rate", 0.0))
    return {**identity, "config": guard.run_identity(argparse.Namespace(**identity["config"]), seed=None, dtype="",
                                                     data={}, moe=moe)["config"]}


def resume_point(args, identity: dict) -> tuple:
    """(folder to load or None, its step): the checks of ``--resume``."""
    identity = with_moe(identity, args)
    if not os.path.exists(os.path.join(args.resume, "latest")):
        if os.path.isdir(args.resume) or (args.save and os.path.abspath(args.save) == os.path.abspath(args.resume)):
            return None, 0                       # no checkpoint yet: the first launch of a restartable run
        raise ValueError(f"cannot resume: {args.resume} is not a folder ({args.resume}/latest is missing)")
    folder = checkpoint.latest(args.resume)
    saved = checkpoint.read_manifest(folder)
    checkpoint.verify(folder, saved)
    diffs = guard.differences(saved, identity)
    if diffs:
        raise ValueError(f"cannot resume from {args.resume}: its checkpoint is of another run ({'; '.join(diffs)})")
    if saved["step"] >= args.steps:
        raise ValueError(f"--steps {args.steps}: the checkpoint in {args.resume} is already at step {saved['step']}")
    return args.resume, saved["step"]


def take_folder(args) -> str | None:
    """``--save``: create the folder and lock it for this run (:func:`minipar.hybrid.guard.lock_folder`, waiting
    ``--wait-for-lock`` seconds for a run that holds it; under torchrun, rank 0 only); the lock's path, or None
    without ``--save``."""
    if not args.save or os.environ.get("RANK", "0") != "0":
        return None
    guard.check_folder(args.save)
    return guard.lock_folder(args.save, wait=args.wait_for_lock or 0.0)


def check_save(args, identity: dict, start: int) -> None:
    """``--save``: the folder is created and test-written; another run's checkpoint there, or a later step,
    is replaced only with ``--overwrite``."""
    identity = with_moe(identity, args)
    guard.check_folder(args.save)
    if args.overwrite or not os.path.exists(os.path.join(args.save, "latest")):
        return
    try:
        saved = checkpoint.read_manifest(checkpoint.latest(args.save))
    except checkpoint.CheckpointError as exc:
        raise ValueError(f"--save {args.save} holds a checkpoint that cannot be read ({exc}); pass --overwrite "
                         f"to replace it") from None
    diffs = guard.differences(saved, identity)
    if diffs:
        raise ValueError(f"--save {args.save} holds another run's checkpoint ({'; '.join(diffs)}); choose another "
                         f"folder or pass --overwrite")
    if saved["step"] > start:
        raise ValueError(f"--save {args.save} holds step {saved['step']}, later than this run's start (step "
                         f"{start}): saving would move 'latest' back; --resume {args.save}, or pass --overwrite")


def groups_across_nodes(layout: Layout, world_size: int, local_world_size: int) -> dict:
    """{dim: [(group's ranks, nodes they sit on)]} for every group of the layout's mesh that spans nodes.
    Rank r sits on node r // local_world_size (torchrun and this launcher number ranks node by node)."""
    mesh, crossing = Mesh(world_size, devices_per_node=local_world_size, **layout.sizes), {}
    for dim, size in layout.sizes.items():
        for ranks in mesh.groups(dim) if size > 1 else []:
            if mesh.crosses_nodes(ranks):
                crossing.setdefault(dim, []).append((ranks, sorted({mesh.node_of(r) for r in ranks})))
    return crossing


def check_nodes(args, layout: Layout, world_size: int, torchrun: bool) -> list:
    """The lines to print about where the groups sit (rank 0 only), or ``ValueError`` with ``--strict-nodes``
    when a tp group spans nodes."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if torchrun else (args.local_world_size or world_size)
    crossing = groups_across_nodes(layout, world_size, local)
    bad = "; ".join(f"{d} group {ranks} spans nodes {nodes}" for d, groups in crossing.items() if d in NODE_BOUND
                    for ranks, nodes in groups)
    if bad and args.strict_nodes:
        raise ValueError(f"--strict-nodes: {bad} ({local} ranks per node)")
    lines = []
    if world_size > local:
        placed = "; ".join(f"{g} on node {sorted({r // local for r in g})}"
                           for g in Mesh(world_size, **layout.sizes).groups("tp"))
        lines.append(f"{-(-world_size // local)} nodes of {local} ranks; tp groups: {placed}")
    if bad:
        lines.append(f"warning: {bad} ({local} ranks per node): its collectives cross the network")
    return lines if os.environ.get("RANK", "0") == "0" else []
