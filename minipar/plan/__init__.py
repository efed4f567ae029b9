"""minipar.plan — which layout for this model on this cluster: a cost model, a planner and the source articles' rules.

Pure functions, no processes (chapter 12):

* :mod:`.model` — :class:`Transformer`, :func:`parameters`, :func:`activation_bytes_per_layer`,
  :func:`model_flops`, :func:`hardware_flops`, :func:`mfu`, :func:`model_state_bytes_formula` (the papers' formulas),
  :class:`MoETransformer`;
* :mod:`minipar.machine.cluster` (re-exported here) — :class:`Cluster`, the α-β cost of a collective;
  :func:`a100_cluster`, :func:`h100_cluster`: GPU clusters built from device and link cards
  (:mod:`minipar.machine.device`), on which the compute is :mod:`.operators` priced on the card;
* :mod:`.operators` — a layer at real size as the operators a framework runs (:class:`Kernels`);
* :mod:`.published` — published training runs and the planner's prediction of each (``bench published``);
* :mod:`.cost` — :class:`Layout`, :func:`estimate` (memory, time and MFU, term by term; its two sums in :mod:`.sums`); :mod:`.traffic` its
  bytes and seconds (tp, cp, ep, pp, dp), :mod:`.overlap` what of them a program hides (``overlap=``);
* :mod:`.planner` — :func:`plan` (the best layouts that fit, and why every other family lost);
* :mod:`.rules` — :func:`decide` (the source articles' decision guide as rules), :func:`family`;
* :mod:`.agreement` — :func:`rank_agreement`, :func:`kendall_tau`, :func:`agreement_text` (does a prediction rank strategies as a
  measurement or a replay does?).
"""
from .model import (GPT3_175B, NARAYANAN_1T, MoETransformer, Transformer, activation_bytes_per_layer, expert_parameters,
                    forward_flops, hardware_flops, hfu, layer_parameters, mfu, model_flops, model_state_bytes_formula,
                    parameters)
from .cost import Cluster, Estimate, Layout, collective_seconds, estimate, in_flight, stage_parameters, validate
from .overlap import OVERLAPS
from .operators import MEGATRON_2022, TORCHTITAN_EAGER, Kernels
from minipar.machine.cluster import a100_cluster, h100_cluster
from .agreement import agreement_text, kendall_tau, rank_agreement
from .planner import Plan, layouts, plan
from .rules import Advice, decide, family

__all__ = ["Transformer", "GPT3_175B", "NARAYANAN_1T", "parameters", "layer_parameters", "activation_bytes_per_layer",
           "forward_flops", "model_flops", "hardware_flops", "mfu", "hfu", "model_state_bytes_formula",
           "Cluster", "Layout", "Estimate", "estimate", "validate", "in_flight", "stage_parameters",
           "collective_seconds", "Plan", "plan", "layouts", "Advice", "decide", "family",
           "MoETransformer", "expert_parameters", "OVERLAPS", "kendall_tau", "rank_agreement",
           "agreement_text", "a100_cluster", "h100_cluster", "Kernels", "MEGATRON_2022", "TORCHTITAN_EAGER"]
