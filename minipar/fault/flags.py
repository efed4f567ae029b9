"""The flags of ``python -m minipar train --replicas R`` (:func:`add_flags`) and what they refuse before any
process starts (:func:`check_flags`: ``ValueError`` naming the flag; the command exits 2)."""
from __future__ import annotations

import math
import os

__all__ = ["RESTARTS", "QUORUM_TIMEOUT", "add_flags", "check_flags"]

RESTARTS = 1                   # --replica-restarts' default
QUORUM_TIMEOUT = 10.0          # --quorum-timeout's default, seconds


def add_flags(parser) -> None:
    group = parser.add_argument_group("fault tolerance (replica groups, chapter 15)")
    group.add_argument("--replicas", type=int, default=None, metavar="R",
                       help="R >= 2 replica groups of the layout, data-parallel with each other, a quorum every step: "
                            "a replica whose rank dies is dropped and the others go on (its rows leave the batch)")
    group.add_argument("--replica-restarts", type=int, default=None, metavar="N",
                       help=f"with --replicas: times a dead replica is started again, healed from a live peer "
                            f"(default {RESTARTS})")
    group.add_argument("--quorum-timeout", type=float, default=None, metavar="SECONDS",
                       help=f"with --replicas: how long a step's quorum waits for a replica; a live replica that misses it "
                            f"is taken as hung: its stacks printed, stopped and restarted (default {QUORUM_TIMEOUT:g})")


def check_flags(args) -> None:
    """``ValueError`` for a replicated run that cannot work, or a replica flag without ``--replicas``."""
    if args.replicas is None:
        for flag, given in (("--replica-restarts", args.replica_restarts), ("--quorum-timeout", args.quorum_timeout)):
            if given is not None:
                raise ValueError(f"{flag} needs --replicas R")
        return
    if args.replicas < 2:
        raise ValueError(f"--replicas {args.replicas}: a replicated run needs at least 2 replica groups "
                         f"(without --replicas it is the plain run)")
    if args.replica_restarts is not None and args.replica_restarts < 0:
        raise ValueError(f"--replica-restarts must be >= 0, got {args.replica_restarts}")
    if args.quorum_timeout is not None and not (math.isfinite(args.quorum_timeout) and args.quorum_timeout > 0):
        raise ValueError(f"--quorum-timeout must be a positive number of seconds, got {args.quorum_timeout}")
    refused = {"--save": (args.save, "a replicated run does not write checkpoints yet (a replica heals from a live "
                                     "peer instead)"),
               "--resume": (args.resume, "a replicated run does not load checkpoints yet"),
               "--zero": (args.zero, "ZeRO fuses its optimizer step with its reduce-scatter, and the commit gate must "
                                     "come between the gradient and the step"),
               "--experts": (args.experts, "an MoE model's expert gradients are not gated yet"),
               "--data": (args.data, "the held-out evaluation is not replicated yet"),
               "--nproc-per-node": (args.local_world_size, "replica groups run on this machine only"),
               "--backend nccl": (args.backend == "nccl", "the quorum's groups are gloo groups, on the CPU"),
               "--invariant": (getattr(args, "invariant", False), "the replicas' gradient average is a plain gloo "
                                                                  "all-reduce, not the invariant mode's tree")}
    for flag, (given, why) in refused.items():
        if given:
            raise ValueError(f"--replicas with {flag}: {why}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ValueError("--replicas under torchrun: the replicated run starts and supervises its own processes "
                         "(run it with python -m minipar train)")
