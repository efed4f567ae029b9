"""One layout: how many ranks along each mesh dimension, and how a step runs on them.

Validation, the 3D trainer, ``python -m minipar train``, checkpoints, the byte formulas and the planner all
take a :class:`Layout`; none spells dp/pp/tp separately. The mesh dimensions are :data:`MESH_DIMS` (in
:mod:`minipar.mesh`'s order, outermost first), so::

    world_size = dp · pp · cp · tp                 global batch = dp · micro_batch · micro_batches

Expert parallelism is *folded* (Megatron-Core's MoE parallel folding with expert-TP = 1, torchtitan's sparse
mesh): the ep ranks that share a pipeline stage are borrowed from its dp × cp × tp ranks, so ep adds no ranks
and must divide dp · cp · tp; each expert is replicated over ``expert_data_parallel = dp · cp · tp / ep`` of
them (the tp ranks of a stage hand the MoE layer different tokens: :mod:`minipar.hybrid.experts`).

Adding a mesh dimension is adding a field here and its name to ``minipar.mesh.DEFAULT_ORDER`` (which
:data:`MESH_DIMS` is); a strategy that does not run it yet refuses it in its own ``validate``
(:meth:`Layout.refuse`), so nothing else changes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .mesh import DEFAULT_ORDER
from .validation import positive_int

__all__ = ["Layout", "MESH_DIMS", "ZERO_STAGES"]

MESH_DIMS = DEFAULT_ORDER                      # the mesh's order, outermost first: tp innermost (one node)
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Layout:
    """Degrees of each parallelism (``dp``, ``tp``, ``pp``, ``cp``, ``ep``), ``v`` virtual stages per pipeline
    rank, ``zero`` stage, ``sp`` (sequence parallelism in the TP group), ``recompute`` mode, ``micro_batch``
    (rows per micro-batch, for the cost model) and ``micro_batches`` (m per step), ``schedule``, and
    ``cp_method``: how the cp ranks attend (``ring``, ``ring-zigzag``, ``ulysses``, ``rsa``; chapter 06b)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    v: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    recompute: str = "none"
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    cp_method: str = "ring"

    @property
    def sizes(self) -> dict:
        """{mesh dimension: degree}, outermost first: what :class:`minipar.mesh.Mesh` takes for the dense mesh.
        ``"ep"`` is 1 there: ep is folded into dp × cp (see the module's docstring), it adds no ranks."""
        return {d: 1 if d == "ep" else getattr(self, d) for d in MESH_DIMS}

    @property
    def expert_data_parallel(self) -> int:
        """How many ranks hold a replica of each expert: dp · cp · tp / ep (Megatron-Core's expert-DP size)."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    devices = world_size

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.micro_batches

    def check(self) -> "Layout":
        """Raise ``ValueError`` for a value no strategy can run (a degree < 1, an unknown ZeRO stage);
        return ``self``. What depends on a model or a strategy is each ``validate``'s business."""
        for name in (*MESH_DIMS, "v", "micro_batch", "micro_batches"):
            positive_int(f"Layout.{name}", getattr(self, name))
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.sp, bool):
            raise ValueError(f"sp must be True or False, got {self.sp!r}")
        if not isinstance(self.schedule, str):
            raise ValueError(f"schedule must be a name, got {self.schedule!r}")
        if not isinstance(self.cp_method, str):
            raise ValueError(f"cp_method must be a name, got {self.cp_method!r}")
        if (self.dp * self.cp * self.tp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp·cp·tp = {self.dp * self.cp * self.tp}: expert parallelism "
                             f"borrows its ranks from a stage's data-, context- and tensor-parallel ranks (folding), "
                             f"it adds none")
        return self

    def refuse(self, *dims: str, why: str) -> None:
        """``ValueError`` if any of ``dims`` is > 1: a strategy that does not run those dimensions yet."""
        used = [f"{d}={getattr(self, d)}" for d in dims if getattr(self, d) != 1]
        if used:
            raise ValueError(f"{', '.join(used)}: {why}")

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """Every field (JSON-ready): what a checkpoint's manifest records."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "Layout":
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown layout field(s) {sorted(unknown)}")
        return cls(**fields)

    @classmethod
    def of(cls, layout: "Layout | None" = None, defaults: dict | None = None, **fields) -> "Layout":
        """``layout`` itself, or one built from keyword ``fields`` (``defaults`` fill what is not given) —
        the keyword form the chapters' ``Trainer3D(rank, n, recipe, dp=2, pp=2, tp=2)`` keeps working
        with. Both at once is an error."""
        if layout is not None:
            if fields:
                raise ValueError(f"give a Layout or keyword degrees, not both (got {sorted(fields)} too)")
            if not isinstance(layout, cls):
                raise ValueError(f"layout must be a minipar.layout.Layout, got {type(layout).__name__}")
            return layout
        return cls.from_dict({**(defaults or {}), **fields})

    def __str__(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"v={self.v}"] if self.v > 1 else []
        parts += [f"cp={self.cp}", self.cp_method] if self.cp > 1 else []
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        parts += [f"zero={self.zero}"] if self.zero else []
        parts += ["sp"] if self.sp else []
        parts += [f"recompute={self.recompute}"] if self.recompute != "none" else []
        parts += [f"b={self.micro_batch}", f"m={self.micro_batches}"]
        parts += [self.schedule] if self.pp > 1 else []
        return " ".join(parts)
