"""Hybrid parallelism: data × pipeline × tensor (+ sequence) parallelism on one device mesh, ZeRO-1 over the
data-parallel group, checkpoints that move between layouts, and the ``python -m minipar train`` command.

* :mod:`minipar.hybrid.parallel3d` — one training step on a mesh dp × pp × tp, composed from
  :mod:`minipar.mesh`, :mod:`minipar.tensor.gpt`, :mod:`minipar.pipeline` and :mod:`minipar.data`.
* :mod:`minipar.hybrid.checkpoint` — save the training state from any layout, load it into any other.
* :mod:`minipar.hybrid.cli` — the training command (local processes or ``torchrun``).
"""
