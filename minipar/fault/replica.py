"""What each rank of a replica runs: its own process group (the replica's dp × pp × cp × tp mesh), a
:class:`~minipar.hybrid.parallel3d.Trainer3D` whose optimizer is a :class:`~.quorum.CommitGate`, and the loop

    register with the committed steps -> quorum -> heal (if behind) -> step q.step on this replica's rows
    -> committed (next step) or aborted (the same step again, with the next quorum)

until ``steps`` are committed. Replica r of R trains on rows [r·B/R, (r+1)·B/R) of each global batch B
(:func:`replica_recipe`); a step's rows are therefore the live replicas' rows.
"""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import faulthandler
import io
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layout import Layout
from ..loop import shard_batch
from ..recipe import Recipe
from ..hybrid.parallel3d import Trainer3D
from . import heal
from .quorum import CommitGate, FaultPlan, QuorumClient, StepAborted

__all__ = ["ReplicaSpec", "replica_recipe", "train_replica", "replica_main", "COORDINATOR", "result_path",
           "output_path", "read_result"]

COORDINATOR = "lighthouse.store"      # the lighthouse's FileStore, in the supervisor's folder


@dataclass
class ReplicaSpec:
    """What every replica trains: the global ``recipe`` (batch B), ``replicas`` R groups of ``layout``,
    ``steps`` to commit; ``timeout`` s for a collective; ``plan``: a planted failure, or None."""
    recipe: Recipe
    replicas: int
    layout: Layout
    steps: int
    timeout: float = 60.0
    plan: FaultPlan | None = None


def replica_recipe(recipe: Recipe, replicas: int, replica: int) -> Recipe:
    """``recipe`` with replica ``replica``'s contiguous B/R rows of every global batch."""
    return dataclasses.replace(recipe, batches=[shard_batch(b, replica, replicas) for b in recipe.batches])


def train_replica(spec: ReplicaSpec, replica: int, generation: int, rank: int, coordinator) -> dict:
    """One rank's loop (module docstring); returns {"params", "generation", "committed", "stats": {"reduced": [(n,
    payload bytes)] per cross-replica all-reduce, "healed_bytes" received, "state_bytes": this rank's state}}."""
    recipe, world = replica_recipe(spec.recipe, spec.replicas, replica), spec.layout.world_size
    trainer = Trainer3D(rank, world, recipe, layout=spec.layout)
    client = QuorumClient(coordinator, replica=replica, generation=generation, rank=rank, world_size=world,
                          timeout=spec.timeout)
    gate = trainer.optimizer = CommitGate(trainer.optimizer, trainer.params, client, spec.plan)
    reporter = trainer.mesh.is_last_stage and all(trainer.mesh.coord(d) == 0 for d in ("dp", "cp", "tp"))
    committed = 0
    while committed < spec.steps:
        if spec.plan is not None:
            spec.plan.fire(replica, generation, rank, committed, "before_register")
        quorum = client.next_quorum(committed)
        ok, why, received, heal_s = True, "", None, None
        try:
            received, heal_s = heal.exchange(trainer, client, quorum, committed)
        except RuntimeError as exc:           # the source died mid-stream: heal again next round
            ok, why = False, f"healing failed: {str(exc).splitlines()[0][:200]}"
        if not heal.replica_agrees(ok, world):   # load only what every rank of the replica received
            client.vote(False, why or "another rank of this replica failed to heal")
            client.decision()
            continue
        if received is not None:
            committed = heal.load_state(trainer, received)
        gate.arm(quorum, heal_s if received is not None else None)
        try:
            loss = trainer.step(*recipe.batches[quorum.step], quorum.step)
        except StepAborted:
            continue
        committed = quorum.step + 1
        if reporter:
            client.report_loss(quorum.step, loss)
    return {"params": trainer.full_params(), "generation": generation, "committed": committed,
            "stats": {"reduced": gate.reduced, "healed_bytes": client.healed_bytes,
                      "state_bytes": len(heal.state_of(trainer, committed))}}


def replica_main(replica: int, generation: int, rank: int, spec: ReplicaSpec, workdir: str) -> None:
    """The process of local rank ``rank`` of replica ``replica`` (``generation``: how many times it was
    restarted): output to its file, the result (or the error) to its result file, then ``os._exit``."""
    if sys.platform.startswith("linux"):      # the kernel kills this rank if the supervisor dies: no orphans
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    torch.set_num_threads(1)
    out = open(output_path(workdir, replica, generation, rank), "w", buffering=1)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)   # the supervisor asks a stuck rank where it is
    path = result_path(workdir, replica, generation, rank)
    try:
        world, timeout = spec.layout.world_size, datetime.timedelta(seconds=spec.timeout)
        store = dist.FileStore(os.path.join(workdir, f"replica{replica}-gen{generation}.store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        coordinator = dist.FileStore(os.path.join(workdir, COORDINATOR), -1)
        coordinator.set_timeout(datetime.timedelta(hours=1))     # the lighthouse answers every round
        _write(path, ("ok", train_replica(spec, replica, generation, rank, coordinator)))
        if store.add("left", 1) == world:                          # the replica's ranks leave together
            store.set("all_left", "1")
        store.wait(["all_left"])
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, which names the rank
        _write(path, ("error", (f"{type(exc).__name__}: {exc}", traceback.format_exc(), time.time())))
    finally:
        out.flush()
        os._exit(0)          # no interpreter teardown: destroying a group whose peers are gone can block


def result_path(workdir: str, replica: int, generation: int, rank: int) -> str:
    return os.path.join(workdir, f"result-r{replica}-g{generation}-l{rank}.pt")


def output_path(workdir: str, replica: int, generation: int, rank: int) -> str:
    return os.path.join(workdir, f"out-r{replica}-g{generation}-l{rank}.txt")


def _write(path: str, obj) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path + ".tmp", "wb") as f:
        f.write(buf.getvalue())
    os.replace(path + ".tmp", path)             # atomic: the supervisor never reads half a result


def read_result(path: str):
    """("ok", value), ("error", (message, traceback, time)) or ("missing", None)."""
    if not os.path.exists(path):
        return "missing", None
    with open(path, "rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=False)
