"""``python -m minipar train --replicas R``: the hybrid command's run as R fault-tolerant replica groups.

    python -m minipar train --replicas 3 --tp 2 --steps 20 --json     # 3 replicas of 2 ranks: 6 processes

One JSON object per committed step on standard output: ``step`` (1-based, as the plain run's), ``loss`` (the
mean over the quorum's rows), ``replicas`` (how many were live in the step's quorum), ``quorum`` (which),
``seconds``; then one ``{"final": ...}`` object per replica that trained to the end: its ``generation`` (times
restarted) and the sha256 of its parameters (equal digests: identical parameters). Progress, deaths and
restarts go to standard error. A replica's death is not an error: exit 0. A rank that raises, or a run left
without a quorum, is: exit 1, one line naming the rank (:mod:`.supervisor`).
"""
from __future__ import annotations

import hashlib
import json
import signal
import sys

import torch

from ..launcher import RankError
from . import flags, replicas
from .lighthouse import NoQuorum

__all__ = ["main", "params_digest"]


def params_digest(params: dict) -> str:
    """sha256 over the parameters' names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(args, recipe, layout) -> int:
    """Run the checked command (``args`` parsed, ``recipe`` and ``layout`` built and validated)."""
    def committed(this, losses):
        members = [r for r, _ in this.members]
        loss = sum(losses.values()) / len(losses) if losses else None
        healed = sorted(this.heal)
        shown = f"  healed {healed} from {sorted(set(this.heal.values()))}" if healed else ""
        shown_loss = "(no member left to say)" if loss is None else f"{loss:.6f}"
        print(f"step {this.step + 1:4d}/{args.steps}  loss {shown_loss}  replicas {len(members)}/{args.replicas} "
              f"{members}{shown}", file=sys.stderr, flush=True)
        if args.json:
            line = {"step": this.step + 1, "loss": loss, "replicas": len(members), "quorum": members,
                    "seconds": this.decided - this.started} | ({"healed": healed} if healed else {})
            print(json.dumps(line), flush=True)

    def stop(signum, frame):                    # SIGTERM: through the supervisor's cleanup (no process left)
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        result = replicas.run(recipe, replicas=args.replicas, layout=layout, timeout=args.timeout,
                              restarts=flags.RESTARTS if args.replica_restarts is None else args.replica_restarts,
                              join_timeout=flags.QUORUM_TIMEOUT if args.quorum_timeout is None else args.quorum_timeout,
                              on_commit=committed, on_event=lambda text: print(text, file=sys.stderr, flush=True))
    except (RankError, NoQuorum) as exc:
        print(f"python -m minipar train: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    digests = {r: params_digest(p) for r, p in sorted(result.params.items())}
    for r, digest in digests.items():
        if args.json:
            print(json.dumps({"final": True, "replica": r, "generation": result.generations[r],
                              "params_sha256": digest}), flush=True)
    same = len(set(digests.values())) == 1
    print(f"{len(digests)} replicas ended {'with identical parameters' if same else 'DIFFERENT'}; "
          f"{len(result.deaths)} lost, {sum(result.generations.values())} restarted", file=sys.stderr)
    return 0 if same else 1
