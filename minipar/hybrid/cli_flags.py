"""The flags of ``python -m minipar train`` (:func:`build_parser`); what each means and how they are checked
before any process starts is in :mod:`minipar.hybrid.cli` and :mod:`minipar.hybrid.preflight`."""
from __future__ import annotations

import argparse

import torch

from ..fault import flags as replica_flags
from . import context
from .parallel3d import TRAINER_SCHEDULES

__all__ = ["DTYPES", "KEEP", "build_parser", "add_moe_flags"]

DESCRIPTION = "``python -m minipar train``: train the tiny GPT on a dp × pp × tp mesh from the shell."
DTYPES = {"float32": torch.float32, "float64": torch.float64}
KEEP = 3                                 # --keep's default: checkpoints left in --save


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line, exit 2 (argparse's own errors too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m minipar train", description=DESCRIPTION,
                allow_abbrev=False)              # --step 4 is an error, not --steps 4
    layout = p.add_argument_group("layout (dp × pp × cp × tp ranks)")
    layout.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    layout.add_argument("--pp", type=int, default=1, help="pipeline stages")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    layout.add_argument("--sp", action="store_true", help="sequence parallelism inside the TP group")
    layout.add_argument("--cp", type=int, default=1, help="context-parallel degree (s/cp tokens per rank)")
    layout.add_argument("--cp-method", default="ring", choices=context.METHODS,
                        help="how the cp ranks attend (chapter 06b)")
    layout.add_argument("--ep", type=int, default=1, help="expert-parallel degree (borrowed from a stage's dp × cp × tp ranks: must divide dp·cp·tp)")
    layout.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                        help="ZeRO stage over the DP group: 1 optimizer state, 2 + gradients, 3 + parameters "
                             "(sharded between steps; gathered and reduced once per step, not per micro-batch)")
    layout.add_argument("--schedule", default="1f1b", choices=TRAINER_SCHEDULES)
    layout.add_argument("--virtual-stages", type=int, default=1, dest="v", help="chunks per rank (interleaved)")
    layout.add_argument("--micro-batches", type=int, default=8, help="m, per step")
    layout.add_argument("--nproc-per-node", type=int, default=None, dest="local_world_size",
                        help="ranks per node for a local launch (default: all on one); torchrun's "
                             "LOCAL_WORLD_SIZE under torchrun")
    layout.add_argument("--strict-nodes", action="store_true", help="refuse a tp group that spans nodes")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=20, help="train until this global step")
    train.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    train.add_argument("--seq-len", type=int, default=16)
    train.add_argument("--n-layer", type=int, default=4)
    train.add_argument("--n-head", type=int, default=4)
    train.add_argument("--n-embd", type=int, default=32)
    add_moe_flags(train)
    train.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--invariant", action="store_true", help="every reduction in one canonical tree order: "
                       "any layout prints one process's losses bit for bit (minipar.invariant)")
    train.add_argument("--save", metavar="DIR", help="save a checkpoint at the end (and every --save-every)")
    train.add_argument("--save-every", type=int, default=None, metavar="N", help="also save every N steps")
    train.add_argument("--async-checkpoint", action="store_true", help="save in the background: training waits "
                       "only for a copy in host memory, the files are written beside the next steps")
    train.add_argument("--check-gradients", action="store_true", help="before every optimizer step the data-"
                       "parallel replicas compare fingerprints of their reduced gradients; a mismatch (silent data "
                       "corruption) is named and the step replayed (needs dp·cp > 1, no --zero, no --experts)")
    train.add_argument("--keep", type=int, default=None, metavar="N", help=f"keep the newest N checkpoints in "
                       f"--save (default {KEEP}; never the one 'latest' names; 0: keep all)")
    train.add_argument("--wait-for-lock", type=float, default=None, metavar="SECONDS",
                       help="another run holds --save: wait up to SECONDS for it to finish (default 0: refuse)")
    train.add_argument("--overwrite", action="store_true",
                       help="let --save replace another run's checkpoint, or a later step")
    train.add_argument("--resume", metavar="DIR", help="continue from the checkpoint in DIR (any layout); a "
                                                       "folder with no checkpoint yet starts at step 0")
    train.add_argument("--data", metavar="FILE", help="train on this UTF-8 text (its last tenth held out)")
    train.add_argument("--tokens", default="byte", choices=("byte", "char"), help="--data read as bytes or characters")
    train.add_argument("--eval-every", type=int, default=10, metavar="N",
                       help="with --data: the held-out loss every N steps (and at the last)")
    train.add_argument("--json", action="store_true", help="one JSON object per step on standard output")
    train.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                       help="auto: NCCL on one GPU per rank when CUDA is available, else gloo on the CPU; gloo: "
                            "the CPU; nccl: the GPUs (an error without them). The GPU path is checked on CPU "
                            "by a device watch, not yet run on a GPU")
    train.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait")
    replica_flags.add_flags(p)
    return p


def add_moe_flags(group) -> None:
    """The mixture-of-experts flags (:class:`minipar.moe.layer.MoEConfig`'s experts, k, capacity_factor,
    dropless, shared, granularity and bias_rate)."""
    group.add_argument("--experts", type=int, default=0, help="experts per MoE FFN (0: the dense GPT)")
    group.add_argument("--top-k", type=int, default=1, help="experts per token")
    group.add_argument("--capacity-factor", type=float, default=1.25, help="C = ceil(k·T/E·cf) slots per expert; "
                       "with --cp > 1 the run equals one device only at cf ≥ E/k (no token dropped)")
    group.add_argument("--dropless", action="store_true", help="no capacity: every token reaches its experts "
                       "(uneven all-to-alls, split sizes exchanged first; --capacity-factor unused)")
    group.add_argument("--shared-experts", type=int, default=0, metavar="S",
                       help="shared experts every token passes through, outside the router (DeepSeekMoE)")
    group.add_argument("--granularity", type=int, default=1, metavar="M", help="fine-grained experts: each "
                       "expert's FFN hidden = the dense FFN's / M (M must divide the FFN multiple, 4)")
    group.add_argument("--bias-rate", type=float, default=0.0, metavar="GAMMA", help="loss-free balancing: "
                       "a routing bias moved by γ after each step (DeepSeek-V3: 1e-3; 0: off); needs "
                       "--micro-batches 1, and no --save/--resume (the bias is not in a checkpoint)")
