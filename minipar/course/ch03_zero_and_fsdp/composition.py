"""Chapter 03: per-parameter FSDP composed with replication — ``fully_shard`` on the big layers, ``replicate``
on the rest (torchtitan does so for small parameters in some layouts). Each ``Linear`` and ``Embedding`` of a
small float64 language model is a unit, sharded on dim 0; its two LayerNorms are in no unit, so they are
replicated: whole on every rank, their gradients averaged by one all-reduce at the end of the backward. Trained
on N ranks with AdamW and compared with one device; :meth:`Composition.check` raises if the run differs from one
device, a norm is sharded, or a norm's gradient differs between ranks."""
from __future__ import annotations

import torch
import torch.nn as nn

from minipar import comm, launch
from minipar.course.checks import fail
from minipar.data.fsdp import FSDP
from minipar.loop import shard_batch

__all__ = ["LM", "big_layers", "run", "Composition"]

VOCAB, DIM, BATCH, SEQ, STEPS = 16, 8, 8, 4, 3


class LM(nn.Module):
    """Embedding -> LayerNorm -> Linear residual -> LayerNorm -> Linear head, float64."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb, self.norm, self.mid = nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM)
        self.norm2, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1 if p.dim() == 1 else 0))
        self.double()

    def forward(self, idx):
        h = self.emb(idx)
        h = h + torch.tanh(self.mid(self.norm(h)))
        return self.head(self.norm2(h))


def big_layers(model: nn.Module) -> list:
    """The units: every ``Linear`` and ``Embedding`` (what ``fully_shard`` is called on)."""
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def _train(model, rank=0, world_size=1):
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norm_grads = []
    for _ in range(STEPS):
        x, y = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
        x, y = shard_batch((x, y), rank, world_size)
        nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        norms = [n for n, _ in model.named_parameters() if "norm" in n]
        norm_grads.append(torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if n in norms]))
        opt.step()
        opt.zero_grad()
    return norm_grads


def _on_rank(rank, world_size):
    model = FSDP(LM(), per_parameter=True, units=big_layers)
    shapes = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
    with comm.recording() as log:
        norm_grads = _train(model, rank, world_size)
    return model.state_dict(), norm_grads, shapes, log.by_op()


class Composition:
    """One run: per-rank (state dict, norms' gradients per step, shapes, {op: (calls, bytes)}) and one device's."""

    def __init__(self, per_rank, reference, reference_grads):
        self.per_rank, self.reference, self.reference_grads = per_rank, reference, reference_grads

    def __str__(self):
        _, _, shapes, ops = self.per_rank[0]
        off = max((p - self.reference[n]).abs().max().item() for params, *_ in self.per_rank for n, p in params.items())
        rows = [f"  {name:12s} {str(shape):10s} {'replicated' if 'norm' in name else 'sharded'}"
                for name, shape in shapes.items()]
        calls = ", ".join(f"{op} x{c}" for op, (c, _) in sorted(ops.items()))
        return "\n".join([f"rank 0's parameters over {len(self.per_rank)} ranks:", *rows,
                          f"collectives in {STEPS} steps: {calls}",
                          f"largest difference from one device after {STEPS} AdamW steps: {off:.1e}"])

    def check(self) -> None:
        for rank, (params, grads, shapes, _) in enumerate(self.per_rank):
            if shapes["norm.weight"] != (DIM,):
                fail("a LayerNorm in no unit", "whole on every rank", shapes["norm.weight"], "the norm was sharded")
            for step, (g, first) in enumerate(zip(grads, self.per_rank[0][1])):
                if not torch.equal(g, first):
                    fail(f"the norms' gradients on rank {rank}, step {step}", "the same bits as rank 0's",
                         "different", "the replicated gradients were not all-reduced")
                if not torch.allclose(g, self.reference_grads[step], atol=1e-12, rtol=0):
                    fail(f"the norms' gradients, step {step}", "one device's mean gradient", "different",
                         "summed instead of averaged, or not synchronised")
            for name, p in params.items():
                if not torch.allclose(p, self.reference[name], atol=1e-12, rtol=0):
                    fail(f"{name} after training", "one device's", "different", "a gradient not averaged")


def run(world_size: int = 4) -> Composition:
    reference = LM()
    grads = [g.clone() for g in _train(reference)]
    return Composition(launch(_on_rank, world_size, quiet=True), reference.state_dict(), grads)
