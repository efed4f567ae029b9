"""A minipar checkpoint in ``torch.distributed.checkpoint`` (DCP) format, so the ecosystem's tools load it.

    python -m minipar export-dcp CKPT_DIR OUT_DIR        # the checkpoint CKPT_DIR/latest names, as DCP
    python -m torch.distributed.checkpoint.format_utils dcp_to_torch OUT_DIR model.pt   # then, e.g., one file

A minipar checkpoint (:mod:`minipar.hybrid.checkpoint`) holds full tensors under the reference model's names, one
file per pipeline stage (and per ep rank of an MoE model's experts), so the export needs no resharding: it
verifies every file against the manifest, merges them into one state dict and writes it with ``dcp.save``::

    {"model": {name: tensor}, "optim": {"exp_avg": {name: tensor}, "exp_avg_sq": {...}, "step": float},
     "step": the global step}

A DCP checkpoint is a ``.metadata`` file (every tensor's shape, dtype and where its bytes are) and ``.distcp``
data files; ``dcp.load(state_dict, checkpoint_id=OUT_DIR)`` fills a state dict of the same structure in place,
each tensor from the byte ranges its chunks name, so a sharded reader (DTensors on any mesh) takes only its
pieces. minipar's own load keeps its resharding (:func:`~minipar.hybrid.checkpoint.load`: TP rows and columns, a
fused QKV's three row blocks, ZeRO's flat slices), which are not boxes of one tensor as DCP's chunks are; the
export is a one-process step after training (``no_dist``: no process group needed).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp

from .checkpoint import latest, read_manifest, verify

__all__ = ["state_dict_of", "export_to_dcp", "load_dcp_model", "main"]


def state_dict_of(folder: str) -> dict:
    """The checkpoint in ``folder`` (a ``step-N`` folder) as one state dict (see the module docstring), after
    :func:`verify` (sizes and SHA-256 against the manifest)."""
    manifest = read_manifest(folder)
    verify(folder, manifest)
    model, optim = {}, {}
    for name, entry in sorted(manifest["files"].items()):
        if "tensors" not in entry:                          # rng.pt, the manifest itself
            continue
        shard = torch.load(os.path.join(folder, name), weights_only=True)
        model |= shard["params"]
        for key, tensors in shard["optimizer"].items():
            optim.setdefault(key, {}).update(tensors)
    optim |= manifest["optimizer_scalars"]
    return {"model": model, "optim": optim, "step": manifest["step"]}


def export_to_dcp(directory: str, out: str) -> str:
    """Write the checkpoint ``directory/latest`` names (or ``directory`` itself, a ``step-N`` folder) to ``out``
    in DCP's format; return ``out``."""
    folder = directory if os.path.exists(os.path.join(directory, "manifest.json")) else latest(directory)
    state = state_dict_of(folder)
    with _one_process():
        dcp.save(state, checkpoint_id=out, no_dist=True)
    return out


def load_dcp_model(out: str, model: torch.nn.Module) -> int:
    """Load the parameters of the DCP checkpoint ``out`` into ``model`` with ``dcp.load`` (in place, by name);
    return its step."""
    state = {"model": {n: p.detach().clone() for n, p in model.named_parameters()}, "step": 0}
    with _one_process():
        dcp.load(state, checkpoint_id=out, no_dist=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state["model"][n])
    return state["step"]


@contextlib.contextmanager
def _one_process():
    """DCP warns that it assumes one process when no process group exists: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minipar export-dcp", description="write a minipar checkpoint in "
                                "torch.distributed.checkpoint's format")
    p.add_argument("checkpoint", help="a --save folder (its latest checkpoint) or one step-N folder")
    p.add_argument("out", help="the DCP folder to write")
    args = p.parse_args(argv)
    print(export_to_dcp(args.checkpoint, args.out))
    return 0
