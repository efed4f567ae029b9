"""Checkpoints of a hybrid run that load into any other layout (dp × pp × cp × tp, ep folded over dp × cp × tp, ±
ZeRO-1, or one process).

What a checkpoint holds: the parameters, the optimizer state (Adam's two moments and its step count), the
global step (= the data position: batch k of the recipe is the k-th step's batch on every layout) and the
random-number state. On disk::

    DIR/latest                       "step-00000004"  (written last, by os.replace: atomic)
    DIR/step-00000004/manifest.json  format, step, the layout it was saved from, and what the run is: model
                                     config, seed, dtype, data (source, batch, sequence, position = step);
                                     for every file its size, SHA-256 and the tensors it holds with shapes
    DIR/step-00000004/stage-0.pt     one shard per pipeline stage of the saving layout: that stage's
    DIR/step-00000004/stage-1.pt     parameters and optimizer moments as FULL CPU tensors, reference names
    DIR/step-00000004/experts-1-ep0.pt  an MoE model: ep rank 0's experts of stage 1 and their moments (global names)
    DIR/step-00000004/rng.pt         torch's CPU RNG state of rank 0

A shard holds full tensors: TP pieces gathered over tp (``to_full``), ZeRO's flat shards over dp × cp (ZeRO-3's
freed parameters gathered for the save); the tensors are then the same along dp, cp and tp, and the rank at
coordinate 0 of every replicating dimension writes them (:func:`writes`): one writer per stage file. An expert
differs on every ep rank and is the same along its expert-data-parallel group: the rank at coordinate 0 of
expert-DP writes it (:data:`EXPERT_REPLICATED`), one writer per (stage, ep rank) file. A loading rank reads the
files holding its stages' tensors and cuts its pieces (``to_shard``: TP rows or columns — a fused QKV is three
row blocks, each split t ways — then its ZeRO slice); an expert is taken whole by the ranks that hold it at the
loading layout's ep. So any layout loads any other: the manifest names tensors, not ranks. Files hold CPU
copies whatever device trained; a load maps them onto the loading trainer's ``device`` (``map_location``).

Safety: everything is written to ``step-N.partial`` first; rank 0 renames it to ``step-N`` once every rank has
written (``step-N.1``, ``.2``, ... if a ``step-N`` exists already: ``latest`` may point at it), then replaces
``latest`` (a small file, ``os.replace``: readers see the old name or the new one, never none), and only then
removes older folders of the same step and, with ``keep=N``, every complete checkpoint but the newest N up to
the one ``latest`` names (:func:`prune`). A crash at any point leaves ``latest`` pointing at a complete
checkpoint; a write that fails for a full disk says which file and what ``latest`` still names
(:func:`~minipar.hybrid.guard.write_failed`). What a run is and the checks made before training are in
:mod:`minipar.hybrid.guard`. Loading checks every file against the manifest (missing, truncated, corrupt) and
every tensor against the model (missing, wrong shape) before touching a parameter: :class:`CheckpointError`
names the file. Nothing is loaded partially.

``torch.distributed.checkpoint`` (DCP) writes every rank's own shards with their offsets instead (no gather at
save time); :mod:`.dcp_export` writes a checkpoint in its format, and :mod:`.async_checkpoint` writes in the
background as DCP's ``async_save`` does (:func:`snapshot` first, :func:`write` on another thread).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import torch
import torch.distributed as dist

from ..tensor.operators import tp_rank, tp_size
from .guard import CheckpointError, barrier, run_identity, write_failed
from .reshard import optimizer_pieces, set_optimizer_state, tp_layouts, to_full, to_shard

__all__ = ["CheckpointError", "FORMAT", "STAGE_REPLICATED", "EXPERT_REPLICATED", "tp_layouts", "to_full", "to_shard", "writes", "save",
           "snapshot", "write", "load", "latest", "read_manifest", "verify", "prune"]

FORMAT = "minipar-3d-checkpoint/2"      # /2: the manifest records seed and data; the layout every field

# What a stage file holds (full tensors, TP gathered) is the same on every rank of the stage: along dp and cp
# (replicas; context parallelism shards activations, not parameters) and along tp (after the gather).
STAGE_REPLICATED = ("dp", "cp", "tp")
# An expert is held by one ep rank and replicated along its expert-data-parallel group ("edp") only: the ep
# groups fold over tp too (minipar.hybrid.experts), so the tp ranks hold different experts.
EXPERT_REPLICATED = ("edp",)


def writes(coords: dict, replicated: tuple) -> bool:
    """Whether the rank at mesh ``coords`` writes a tensor that is the same on every rank along the
    ``replicated`` dimensions: the rank at coordinate 0 of each, one per distinct copy: per stage for
    :data:`STAGE_REPLICATED`, per (stage, ep rank) for :data:`EXPERT_REPLICATED` (``coords`` with ``ep``, ``edp``)."""
    return all(coords.get(d, 0) == 0 for d in replicated)


def _files(trainer) -> dict:
    """{file name: (the parameters it holds, whether this rank writes it)} for this rank's stages: a stage's dense
    tensors (writer: coordinate 0 of dp, cp, tp), an MoE model's experts per ep rank (writer: expert-DP 0)."""
    ex, coords = trainer.experts, trainer.mesh.coords
    files = {}
    for s, stage in trainer.stages.items():
        params = list(stage.parameters())
        ids = ex.ids if ex else set()
        files[f"stage-{s}.pt"] = ([p for p in params if id(p) not in ids], writes(coords, STAGE_REPLICATED))
        held = [p for p in params if id(p) in ids]
        if held:
            files[f"experts-{s}-ep{ex.ep_rank}.pt"] = (held, writes({**coords, "ep": ex.ep_rank, "edp": ex.edp_rank},
                                                                    EXPERT_REPLICATED))
    return files


def snapshot(trainer) -> dict:
    """What this rank writes, copied to host memory (a collective: TP and ZeRO-3 gathers): {"shards", "scalars":
    Adam's step count, "rng": the CPU RNG state now}; training may go on once it returns (:mod:`.async_checkpoint`)."""
    layouts, tp_group = tp_layouts(trainer.model), trainer.tp_group
    (pieces, scalars), shards = optimizer_pieces(trainer), {}
    with trainer.readable_params():                          # ZeRO-3: gathered over dp × cp for the save
        for file, (held, mine) in _files(trainer).items():     # gather before anyone writes: collectives first
            params, states = {}, {}
            for p in held:                                   # to_full copies; files hold CPU tensors
                name = trainer.names[id(p)]
                params[name] = to_full(p, layouts[id(p)], tp_group).cpu()
                for k, v in pieces.get(id(p), {}).items():
                    states.setdefault(k, {})[name] = to_full(v, layouts[id(p)], tp_group).cpu()
            if mine:
                shards[file] = {"params": params, "optimizer": states}
    return {"shards": shards, "scalars": {k: float(v) for k, v in scalars.items()}, "rng": torch.get_rng_state()}


def save(trainer, directory: str, step: int, *, run: dict | None = None, crash_rank: int | None = None,
         keep: int | None = None) -> str:
    """Save ``trainer``'s state after ``step`` global steps into ``directory`` (a collective); return the folder.
    ``run``: :func:`run_identity`'s seed and data, for the manifest. ``crash_rank``: that rank kills itself halfway
    through writing its shard (the crash test). ``keep``: complete checkpoints kept (None or 0: all)."""
    return write(trainer, snapshot(trainer), directory, step, run=run, crash_rank=crash_rank, keep=keep,
                 wait=lambda: barrier(trainer.device))


def write(trainer, snap: dict, directory: str, step: int, *, wait, run: dict | None = None,
          crash_rank: int | None = None, keep: int | None = None) -> str:
    """Write :func:`snapshot`'s ``snap`` as checkpoint ``step`` (every rank; ``wait()``: a barrier of them all);
    ``trainer`` is read for what the run is (config, layout), never for its tensors."""
    rank, root = dist.get_rank(), os.path.join(directory, f"step-{step:08d}")
    partial = root + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    wait()
    for file, shard in snap["shards"].items():
        path = os.path.join(partial, file)
        if crash_rank == rank:
            with open(path, "wb") as f:                  # half a file, then the process dies
                f.write(b"\x00" * 100)
                f.flush()
            os.kill(os.getpid(), 9)
        _write(lambda: torch.save(shard, path), path, directory)
    wait()
    if rank == 0:
        rng, manifest = os.path.join(partial, "rng.pt"), os.path.join(partial, "manifest.json")
        _write(lambda: torch.save({"torch": snap["rng"]}, rng), rng, directory)
        _write(lambda: _write_manifest(trainer, partial, step, snap["scalars"], run or {}), manifest, directory)
        same_step = [root] + [f"{root}.{i}" for i in range(1, 1000)]
        root = next(name for name in same_step if not os.path.exists(name))
        os.rename(partial, root)
        tmp = os.path.join(directory, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(root))
        os.replace(tmp, os.path.join(directory, "latest"))      # the one moment the checkpoint changes
        for old in same_step:                                   # then the replaced copies of this step
            if old != root and os.path.isdir(old):
                shutil.rmtree(old, ignore_errors=True)
        prune(directory, keep)
    wait()
    return root


def _write(write, path: str, directory: str) -> None:
    """``write()``, or the error that says what failed: a full disk names ``path`` and the checkpoint
    ``latest`` still names (the half-written ``step-N.partial`` is never pointed at)."""
    try:
        write()
    except (OSError, RuntimeError) as exc:
        explained = write_failed(exc, path, directory)
        if explained is exc:
            raise
        raise explained from None


def prune(directory: str, keep: int | None) -> list:
    """Remove every complete checkpoint of ``directory`` but the newest ``keep`` (by step) up to the one ``latest``
    names, which stays; later steps are a replaced run's (``--overwrite``) and go too. Returns the removed names."""
    found = [(int(m[1]), int(m[2] or 0), name) for name in os.listdir(directory)
             if (m := re.fullmatch(r"step-(\d+)(?:\.(\d+))?", name)) and os.path.isdir(os.path.join(directory, name))]
    names = [name for *_, name in sorted(found)]                        # by step, then by copy of the step
    named = os.path.basename(latest(directory))
    end = names.index(named) + 1 if named in names else len(names)        # just past this run's newest
    old = names[:end][:-keep] + names[end:] if keep else []                # keep None or 0: every one stays
    for name in old:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return old


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(trainer, folder: str, step: int, scalars: dict, run: dict) -> None:
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        entry = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
        if name.startswith(("stage-", "experts-")):
            shard = torch.load(path, weights_only=True)
            entry["tensors"] = {n: list(v.shape) for n, v in shard["params"].items()}
        files[name] = entry
    who = run_identity(trainer.model.cfg, seed=run.get("seed"), dtype=trainer.recipe.dtype, data=run.get("data", {}),
                       moe=getattr(trainer.recipe.model(), "moe", None) if trainer.experts else None)
    manifest = {"format": FORMAT, "step": step, **who, "data": {**who["data"], "position": step},
                "layout": trainer.layout.as_dict(),
                "optimizer_scalars": {k: float(v) for k, v in scalars.items()},
                "files": files}
    with open(os.path.join(folder, "manifest.json.tmp"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(os.path.join(folder, "manifest.json.tmp"), os.path.join(folder, "manifest.json"))


# Load: every rank reads what it needs

def latest(directory: str) -> str:
    """The folder ``directory/latest`` points at."""
    pointer = os.path.join(directory, "latest")
    if not os.path.exists(pointer):
        raise CheckpointError(f"no checkpoint in {directory}: {pointer} is missing")
    with open(pointer) as f:
        return os.path.join(directory, f.read().strip())


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete checkpoint") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the manifest is corrupt") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def verify(folder: str, manifest: dict, expected_shapes: dict | None = None) -> None:
    """Every file present, of the right size and hash; every expected tensor present with its shape."""
    where = {}
    for name, entry in manifest["files"].items():
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing (the manifest lists it): a shard of the checkpoint is lost")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {entry['bytes']}: the file is "
                                  f"truncated or was overwritten")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: SHA-256 differs from the manifest's: the file is corrupt")
        for tensor, shape in entry.get("tensors", {}).items():
            where[tensor] = (path, tuple(shape))
    for tensor, shape in (expected_shapes or {}).items():
        if tensor not in where:
            raise CheckpointError(f"no shard of {folder} holds {tensor}: the checkpoint was saved from a "
                                  f"different model (config there: {manifest.get('config')})")
        path, saved = where[tensor]
        if saved != tuple(shape):
            raise CheckpointError(f"{path} holds {tensor} of shape {saved}, but the model's is {tuple(shape)}: "
                                  f"a checkpoint of a different model")
    extra = sorted(set(where) - set(expected_shapes or where))
    if extra:                                    # 4 layers into 2 would drop blocks 2 and 3 without a word
        raise CheckpointError(f"{where[extra[0]][0]} holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}, "
                              f"which the model does not have: the checkpoint was saved from a different model")


def load(trainer, directory: str) -> int:
    """Load the checkpoint ``directory/latest`` into ``trainer`` (any layout); return its step. Local: no
    communication (each rank reads what it needs and cuts its pieces)."""
    folder = latest(directory)
    manifest = read_manifest(folder)
    verify(folder, manifest, trainer.full_shapes)
    layouts, t, r = tp_layouts(trainer.model), tp_size(trainer.tp_group), tp_rank(trainer.tp_group)
    files = {n: os.path.join(folder, f) for f, e in manifest["files"].items() for n in e.get("tensors", {})}
    cache: dict = {}

    def full(kind, name, key=None):
        path = files[name]
        if path not in cache:
            cache[path] = torch.load(path, weights_only=True, map_location=trainer.device)
        shard = cache[path]
        return shard["params"][name] if kind == "params" else shard["optimizer"][key][name]

    dtype = trainer.recipe.dtype
    keys = set()
    for path in set(files.values()):
        full("params", next(n for n, p in files.items() if p == path))
        keys |= set(cache[path]["optimizer"])
    with torch.no_grad(), trainer.readable_params():       # ZeRO-3: write the gathered copy, then the shards
        for p in trainer.params:
            p.copy_(to_shard(full("params", trainer.names[id(p)]), layouts[id(p)], r, t).to(dtype))
        if trainer.zero is not None:
            trainer.zero.load_masters_from_parameters()
    pieces = {k: {id(p): to_shard(full("optimizer", trainer.names[id(p)], k), layouts[id(p)], r, t).to(dtype)
                  for p in trainer.params} for k in keys}
    # Adam's step count stays on the CPU (torch keeps it there unless the optimizer is capturable or fused)
    scalars = {k: torch.tensor(v, dtype=torch.float32, device="cpu") for k, v in manifest["optimizer_scalars"].items()}
    if keys:
        set_optimizer_state(trainer, pieces, scalars)
    torch.set_rng_state(torch.load(os.path.join(folder, "rng.pt"), weights_only=True, map_location="cpu")["torch"])
    return manifest["step"]
