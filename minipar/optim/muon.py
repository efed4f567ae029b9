"""Muon on one device: Newton–Schulz orthogonalisation of each hidden weight matrix's momentum, AdamW for the
rest — the reference every sharded Muon (:mod:`.muon_sharded`, :mod:`.muon_tp`) must equal.

For a hidden matrix W (A×B) with gradient G, momentum μ, learning rate γ, weight decay λ (PyTorch's
``torch.optim.Muon``, whose step :class:`Muon` repeats line for line)::

    M ← M + (1−μ)(G − M)                        momentum (torch's lerp form of M ← μM + (1−μ)G)
    U = G + μ(M − G)  (Nesterov)  or  U = M
    X₀ = U / max(‖U‖_F, ε)   (Uᵀ when A > B)      now every singular value is ≤ 1
    X_{k+1} = a·X_k + (b·X_kX_kᵀ + c·(X_kX_kᵀ)²)·X_k,   k < 5,   (a, b, c) = (3.4445, −4.7750, 2.0315)
    W ← (1 − γλ)·W − γ·s(A, B)·O,   O = X₅ (transposed back)
    s = √max(1, A/B)  (Keller Jordan's)   or   s = 0.2·√max(A, B)  (Moonlight's "match_rms_adamw")

O ≈ U·V ᵀ of U = U·Σ·Vᵀ: the update with its singular values pushed towards 1. **Why a shard is not enough:**
‖U‖_F is a norm over the whole matrix, and X·Xᵀ mixes every row with every other; Newton–Schulz on a block
of rows is the orthogonalisation of a different matrix (:mod:`.muon_sharded` measures by how much).

Which parameters: Muon for the 2-D weights of the hidden layers only; AdamW for biases, the input layer (an
embedding's role) and the output head, as Keller Jordan's and Moonlight's recipes do (:func:`hidden_matrix_names`).

Precision: ``torch.optim.Muon`` runs Newton–Schulz in bfloat16. With ``ns_dtype=torch.bfloat16`` (the
default) :class:`MuonWithAdamW` *is* ``torch.optim.Muon`` + ``torch.optim.AdamW``; any other ``ns_dtype``
uses :class:`Muon`, the same step with the iteration in that dtype (``None``: the parameter's), so that a
float64 run can be compared with a sharded one to 1e-10 — one bfloat16 rounding flipped by a reordered
gradient sum would otherwise differ by 2⁻⁸ (tests/test_muon.py checks :class:`Muon` in bfloat16 against
PyTorch's bit for bit).

Sources: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024,
kellerjordan.github.io/posts/muon); Liu et al., "Muon is Scalable for LLM Training" (Moonlight, 2025,
arXiv:2502.16982): weight decay and the update scale 0.2·√max(A, B); PyTorch's ``torch.optim.Muon``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..recipe import Recipe, mlp_recipe

__all__ = ["MuonConfig", "newton_schulz", "momentum_update", "scaled_lr", "apply_update", "Muon",
           "MuonWithAdamW", "MuonFactory", "hidden_matrix_names", "muon_recipe", "SIZES"]

SIZES = (16, 64, 96, 64, 8)          # the MLP the tests and the tour train: two hidden matrices, 96×64 and 64×96


@dataclass(frozen=True)
class MuonConfig:
    """Muon's hyperparameters (``torch.optim.Muon``'s names and defaults, but Keller Jordan's lr) and AdamW's."""
    lr: float = 0.02
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple = (3.4445, -4.775, 2.0315)
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_dtype: torch.dtype | None = torch.bfloat16        # torch's; None: the update's own dtype
    adam_lr: float = 1e-2
    adam_betas: tuple = (0.9, 0.95)
    adam_eps: float = 1e-8
    adam_weight_decay: float = 0.0


def newton_schulz(update: torch.Tensor, cfg: MuonConfig) -> torch.Tensor:
    """The orthogonalised ``update`` (the formula above, torch's ``_zeropower_via_newtonschulz`` computed in
    ``cfg.ns_dtype``). ``update`` must be the whole matrix."""
    if update.dim() != 2:
        raise ValueError(f"Newton–Schulz needs a matrix, got shape {tuple(update.shape)}")
    a, b, c = cfg.ns_coefficients
    x = update.to(cfg.ns_dtype or update.dtype)
    tall = update.shape[0] > update.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=cfg.eps)
    for _ in range(cfg.ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def momentum_update(grad: torch.Tensor, buf: torch.Tensor, cfg: MuonConfig) -> torch.Tensor:
    """Move the momentum ``buf`` in place and return the update U to orthogonalise (elementwise: a shard of
    the gradient and of the buffer gives the same shard of U)."""
    buf.lerp_(grad, 1 - cfg.momentum)
    return grad.lerp(buf, cfg.momentum) if cfg.nesterov else buf


def scaled_lr(cfg: MuonConfig, shape) -> float:
    """γ·s(A, B) for a matrix of ``shape`` (A, B): the whole matrix's shape, wherever its rows are."""
    rows, cols = shape[:2]
    if cfg.adjust_lr_fn in (None, "original"):
        return cfg.lr * math.sqrt(max(1, rows / cols))
    if cfg.adjust_lr_fn == "match_rms_adamw":
        return cfg.lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown adjust_lr_fn {cfg.adjust_lr_fn!r}; use None, 'original' or 'match_rms_adamw'")


@torch.no_grad()
def apply_update(param: torch.Tensor, ortho: torch.Tensor, cfg: MuonConfig, shape) -> None:
    """W ← (1 − γλ)W − γ·s·O on ``param`` (the matrix or any piece of it; ``shape`` is the whole matrix's)."""
    param.mul_(1 - cfg.lr * cfg.weight_decay)
    param.add_(ortho, alpha=-scaled_lr(cfg, shape))


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s step with Newton–Schulz in ``cfg.ns_dtype`` (see the module docstring)."""

    def __init__(self, params, cfg: MuonConfig):
        super().__init__(params, {})
        self.cfg = cfg
        if any(p.dim() != 2 for g in self.param_groups for p in g["params"]):
            raise ValueError("Muon steps 2-D matrices only; give the others to AdamW")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                apply_update(p, newton_schulz(momentum_update(p.grad, buf, self.cfg), self.cfg), self.cfg, p.shape)


class MuonWithAdamW:
    """Muon for the hidden matrices, AdamW for the other parameters, stepped together; ``named_params`` are
    (name, parameter) pairs and ``hidden`` the names Muon gets."""

    def __init__(self, named_params, hidden, cfg: MuonConfig):
        named = list(named_params)
        matrices = [p for n, p in named if n in hidden]
        others = [p for n, p in named if n not in hidden]
        if cfg.ns_dtype == torch.bfloat16:                    # PyTorch's own, as it is
            muon = torch.optim.Muon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                                    nesterov=cfg.nesterov, ns_coefficients=cfg.ns_coefficients, eps=cfg.eps,
                                    ns_steps=cfg.ns_steps, adjust_lr_fn=cfg.adjust_lr_fn)
        else:
            muon = Muon(matrices, cfg)
        self.optimizers = [muon] + ([adamw(others, cfg)] if others else [])

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def adamw(params, cfg: MuonConfig) -> torch.optim.AdamW:
    """AdamW for the parameters Muon does not take (elementwise: it steps a shard as it steps the whole)."""
    return torch.optim.AdamW(params, lr=cfg.adam_lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                             weight_decay=cfg.adam_weight_decay)


def hidden_matrix_names(model: nn.Module) -> set:
    """Names of the weights Muon steps: 2-D weights of ``nn.Linear`` layers, less the output head (the last
    Linear) and, in a model without an ``nn.Embedding``, the input layer (the first Linear: the embedding's
    role). Embeddings, norms and biases are AdamW's."""
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    has_embedding = any(isinstance(m, nn.Embedding) for m in model.modules())
    hidden = linear[:-1] if has_embedding else linear[1:-1]
    return {f"{name}.weight" for name in hidden}


class MuonFactory:
    """A recipe's optimizer factory: ``factory(model.parameters())`` -> :class:`MuonWithAdamW`. Parameters
    arrive without names, in ``model.named_parameters()`` order; the names are read once from ``model()``.
    Strategies read ``.config``, ``.hidden`` and ``.names``."""

    def __init__(self, model, cfg: MuonConfig):
        built = model()
        self.config, self.hidden = cfg, hidden_matrix_names(built)
        self.names = [n for n, _ in built.named_parameters()]

    def __call__(self, params):
        params = list(params)
        if len(params) != len(self.names):
            raise ValueError(f"{len(params)} parameters for a model of {len(self.names)}")
        return MuonWithAdamW(zip(self.names, params), self.hidden, self.config)


def muon_recipe(steps: int = 3, batch_size: int = 16, sizes=SIZES, dtype=torch.float64, seed: int = 0,
                **config) -> Recipe:
    """:func:`minipar.recipe.mlp_recipe` trained with Muon + AdamW (``config``: :class:`MuonConfig` fields;
    in float64 Newton–Schulz runs in float64 unless ``ns_dtype`` says otherwise)."""
    base = mlp_recipe(steps=steps, batch_size=batch_size, sizes=sizes, seed=seed)
    cfg = MuonConfig(**{"ns_dtype": None if dtype == torch.float64 else torch.bfloat16, **config})
    batches = [(x.to(dtype), y.to(dtype)) for x, y in base.batches]
    return replace(base, batches=batches, optimizer=MuonFactory(base.model, cfg), dtype=dtype,
                   name=f"MLP {list(sizes)}, Muon + AdamW")
