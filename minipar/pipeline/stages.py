"""Cut a reference model into pipeline stages: one tensor in, one tensor out.

``split_model(model, n_stages)`` returns ``n_stages`` :class:`Stage` modules, built from the model's own
layers (so a pipeline starts from exactly the single-device weights). Layers are cut into equal
consecutive groups by :func:`stage_layers`, the one cut (the 3D trainer's stages, :class:`minipar.hybrid.
parallel3d.HybridStage`, take their tensor-parallel blocks by it too); with ``p`` ranks and ``v`` chunks per rank, stage ``s`` goes to the rank the schedule's
placement names (:mod:`minipar.pipeline.actions`: ``s % p``, round robin, *并行策略简介*'s layout; or the V). For
the tiny GPT, stage 0 also holds the embeddings and the last stage the final LayerNorm and the LM head (the
pipeline API constraint of the Hugging Face guide: a model as a sequence of stages with tensors in and out).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..loop import lm_loss
from ..models import MLP, TinyGPT, TokenPositionEmbedding
from ..validation import positive_int
from .actions import stages_of

__all__ = ["Stage", "stage_layers", "split_model", "stage_loss", "boundary_shapes", "assign"]


class Stage(nn.Module):
    """``parts`` applied in order; ``param_names`` maps this module's parameter names to the reference's."""

    def __init__(self, index: int, parts: list, names: list, gelu_after: list):
        super().__init__()
        self.index = index
        self.parts = nn.ModuleList(parts)
        self._part_names = names                      # reference prefix of each part ("blocks.3", ...)
        self._gelu_after = gelu_after                  # MLP: GeLU after this part?

    def forward(self, x):
        for part, gelu in zip(self.parts, self._gelu_after):
            x = part(x)
            if gelu:
                x = F.gelu(x)
        return x

    @property
    def param_names(self) -> dict:
        """{local name: name in the reference model}."""
        out = {}
        for i, (prefix, part) in enumerate(zip(self._part_names, self.parts)):
            for name, _ in part.named_parameters():
                out[f"parts.{i}.{name}"] = f"{prefix}.{name}" if prefix else name
        return out

    def reference_params(self) -> dict:
        """{reference name: detached copy} for :class:`minipar.recipe.RunResult`."""
        names = self.param_names
        return {names[n]: p.detach().clone() for n, p in self.named_parameters()}


class _Embed(TokenPositionEmbedding, nn.Module):
    """Token + position embeddings of a :class:`TinyGPT` through its embedding seam (its own modules,
    shared, not copied)."""

    def __init__(self, model: TinyGPT):
        super().__init__()
        self.cfg, self.tok_emb, self.pos_emb, self.drop = model.cfg, model.tok_emb, model.pos_emb, model.drop

    def forward(self, idx):
        return self.embed(idx)


def _layers(model):
    """[(reference prefix, module, gelu after)] of the model's layers, and the pieces around them."""
    if isinstance(model, MLP):
        n = len(model.layers)
        return [(f"layers.{i}", layer, i < n - 1) for i, layer in enumerate(model.layers)], [], []
    if isinstance(model, TinyGPT):
        if model.cfg.tie_weights:
            raise ValueError("tied embedding and head weights would live on the first and the last stage; "
                             "splitting them needs an all-reduce of their gradient (not implemented here): "
                             "use tie_weights=False")
        blocks = [(f"blocks.{i}", b, False) for i, b in enumerate(model.blocks)]
        return blocks, [("", _Embed(model), False)], [("ln_f", model.ln_f, False), ("head", model.head, False)]
    raise ValueError(f"split_model knows MLP and TinyGPT, got {type(model).__name__}")


def stage_layers(n_layers: int, n_stages: int) -> list:
    """The one cut: for each of ``n_stages`` stages, the slice of the ``n_layers`` layers it holds — equal
    consecutive groups (stage 0 also holds what comes before them, the last stage what comes after)."""
    if n_layers % positive_int("n_stages", n_stages):
        raise ValueError(f"{n_layers} layers cannot be cut into {n_stages} equal stages: the number of "
                         f"layers must be divisible by p·v = {n_stages}")
    per = n_layers // n_stages
    return [slice(s * per, (s + 1) * per) for s in range(n_stages)]


def split_model(model: nn.Module, n_stages: int) -> list:
    """``n_stages`` stages of equal numbers of layers (MLP Linear layers, GPT blocks)."""
    layers, head, tail = _layers(model)
    stages = []
    for s, held in enumerate(stage_layers(len(layers), n_stages)):
        parts = layers[held]
        if s == 0:
            parts = head + parts
        if s == n_stages - 1:
            parts = parts + tail
        stages.append(Stage(s, [m for _, m, _ in parts], [n for n, _, _ in parts], [g for _, _, g in parts]))
    return stages


def assign(stages: list, p: int, rank: int, placement: str = "loop") -> dict:
    """{stage index: stage} that rank ``rank`` of ``p`` holds, by the schedules' one placement
    (:func:`minipar.pipeline.actions.stages_of`: ``"loop"``, s % p == rank; ``"v"``, stages r and 2p-1-r)."""
    held = stages_of(rank, p, len(stages) // p, placement)
    return {s.index: s for s in stages if s.index in held}


def stage_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss on the last stage's output, as :func:`minipar.check.default_loss` computes it."""
    if targets.dtype == torch.long:
        return lm_loss(output, targets)
    return F.mse_loss(output, targets)


def boundary_shapes(stages: list, example: torch.Tensor) -> list:
    """[(shape, dtype)] of the tensor entering each stage for a micro-batch like ``example`` (entry 0 is the
    input itself). Computed by running the stages once on ``example`` without autograd, torch's
    generators restored afterwards (a dropout's draw leaves no trace): no communication, nothing kept. (The meta
    device gives the same shapes without computing, but its Python shape functions cost some 15 times a tiny
    stage's real forward here, on every rank of every run.)"""
    x = example
    shapes = [(tuple(example.shape), example.dtype)]
    gpu = [example.device] if example.device.type == "cuda" else []      # its generator restored too
    with torch.no_grad(), torch.random.fork_rng(devices=gpu):
        for stage in stages[:-1]:
            x = stage(x)
            shapes.append((tuple(x.shape), x.dtype))
    return shapes
