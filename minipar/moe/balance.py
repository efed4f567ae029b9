"""Keeping the router in check beyond Switch's loss: the router z-loss, the balance loss counted per sequence or
per batch, and balancing with no loss at all.

* **Router z-loss** (ST-MoE: Zoph et al. 2022, arXiv:2202.08906, eq. 5), for B tokens with router logits x (B, E)::

      L_z = c_z · (1/B) Σ_t (log Σ_j exp x_tj)²          (ST-MoE: c_z = 1e-3)

  It penalises large logits, not imbalance: the softmax's exponentials stay in a range bfloat16 rounds well,
  which ST-MoE found to remove the training instabilities of large sparse models without hurting quality.

* **Sequence-wise vs batch-wise balance loss** (DeepSeek-V3: arXiv:2412.19437, eqs. 17–20; DeepSeek-V2's
  expert-level loss, arXiv:2405.04434, has the same form). For a set of T tokens, each sent to its top K of E
  experts, with s'_t the token's normalised router scores (here: the softmax probabilities)::

      f_i = E / (K·T) · #{t : i among token t's top K},   P_i = (1/T) Σ_t s'_ti,   L = α · Σ_i f_i · P_i

  *Sequence-wise*: T is one sequence's tokens and L is averaged over the sequences — every sequence must be
  balanced on its own (V3's "complementary" loss, with a tiny α). *Batch-wise*: T is the whole batch — only the
  batch must be, so a sequence may favour the experts its domain needs (V3 §4.5.3 finds batch-wise balancing
  lets experts specialise by domain). With K = 1 the batch-wise loss is Switch's α·E·Σ f_i·P_i.

* **Auxiliary-loss-free balancing** (DeepSeek-V3 §2.1.2; Wang et al. 2024, arXiv:2408.15664): a bias b_i per
  expert is added to the scores **only to choose** the top K; the gate still uses the unbiased score, so b never
  enters the output and never gets a gradient. After each step, with c_i the tokens expert i was given::

      b_i ← b_i + γ · sign(mean_j c_j − c_i)        (V3: γ = 0.001, then 0)

  An overloaded expert's bias falls and it is chosen less; no term pulls the language-model gradient away from
  the task. :func:`minipar.moe.router.route` takes the bias, :class:`minipar.moe.layer.MoELayer` holds it
  (``MoEConfig(bias_rate=γ)``) and :meth:`minipar.moe.layer.MoEGPT.update_routing_bias` applies this rule.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["z_loss", "sequence_balance_loss", "batch_balance_loss", "update_bias"]


def z_loss(logits: torch.Tensor, weight: float = 1e-3) -> torch.Tensor:
    """ST-MoE's router z-loss c_z · mean_t (logsumexp_j x_tj)² over the tokens' router logits (…, E)."""
    return weight * logits.logsumexp(dim=-1).pow(2).mean()


def sequence_balance_loss(probs: torch.Tensor, expert: torch.Tensor, seq_len: int, alpha: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, α Σ_i f_i P_i per sequence, averaged over sequences.

    ``probs`` (T, E) normalised scores, ``expert`` (T, K) the chosen experts, tokens sequence by sequence
    (T = sequences · ``seq_len``)."""
    t, e = probs.shape
    if seq_len < 1 or t % seq_len:
        raise ValueError(f"{t} tokens do not split into sequences of {seq_len}")
    k = expert.shape[-1]
    chosen = F.one_hot(expert, e).sum(dim=1).to(probs.dtype).view(-1, seq_len, e)   # (sequences, S, E)
    f = e / (k * seq_len) * chosen.sum(dim=1)                  # a count: no gradient flows through it
    p = probs.view(-1, seq_len, e).mean(dim=1)
    return alpha * (f * p).sum(dim=-1).mean()


def batch_balance_loss(probs: torch.Tensor, expert: torch.Tensor, alpha: float) -> torch.Tensor:
    """The same loss over the whole batch as one set of tokens (V3 §4.5.3's batch-wise loss)."""
    return sequence_balance_loss(probs, expert, probs.shape[0], alpha)


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """b ← b + γ · sign(mean load − load), in place (DeepSeek-V3 §2.1.2). ``load``: tokens per expert."""
    load = load.to(bias.dtype)
    return bias.add_(rate * torch.sign(load.mean() - load))

