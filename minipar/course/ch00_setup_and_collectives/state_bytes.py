"""The bytes of a real mixed-precision Adam step, counted tensor by tensor (chapter 00 §1).

A TinyGPT takes one step in bf16 with the library's :class:`~minipar.precision.mixed.MixedPrecision`
(chapter 10): bf16 weights and gradients after the backward, an fp32 master copy and Adam's two fp32 moments
after the step. ZeRO's count (Rajbhandari et al. 2020, §3.1) is 2 + 2 + 12 = 16 bytes per parameter; it
leaves out the fp32 master gradients, which live only during the step, and Adam's one step counter per tensor.
"""
from __future__ import annotations

import torch

from minipar.memory import measured_model_state_bytes
from minipar.models import GPTConfig, TinyGPT
from minipar.precision.mixed import MixedPrecision

__all__ = ["mixed_adam_state_bytes"]


def mixed_adam_state_bytes() -> tuple:
    """({what: bytes}, number of parameters, Adam's step counters) after one mixed-precision Adam step."""
    model = TinyGPT(GPTConfig(), seed=0)
    mixed = MixedPrecision(model, lambda params: torch.optim.Adam(params, lr=1e-3), dtype=torch.bfloat16)
    idx = torch.randint(0, model.cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    mixed.backward(model.loss(idx[:, :-1], idx[:, 1:]))
    compute_copy = measured_model_state_bytes(mixed.compute)                  # after the backward
    mixed.step()                                                              # fp32 master gradients live only in here
    master_copy = measured_model_state_bytes(mixed.master, mixed.optimizer)   # after the step
    measured = {"bf16 weights": compute_copy["params"], "bf16 gradients": compute_copy["grads"],
                "fp32 master weights": master_copy["params"], "Adam's two moments": master_copy["optimizer"]}
    return measured, model.num_parameters(), [s["step"] for s in mixed.optimizer.state.values()]
