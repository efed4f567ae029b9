"""Mixture of experts: the router (top-1 / top-k, capacity, dropping, load-balancing loss), the MoE layer
and MoE tiny GPT, and expert parallelism (experts spread over ranks, tokens moved by all-to-all), alone or
combined with data parallelism.

* :mod:`minipar.moe.router` — :func:`~minipar.moe.router.route`, capacity, the Switch loss;
* :mod:`minipar.moe.layer` — :class:`~minipar.moe.layer.MoELayer`, :class:`~minipar.moe.layer.MoEGPT`,
  :func:`~minipar.moe.layer.moe_recipe`;
* :mod:`minipar.moe.expert_parallel` — ``run(recipe, *, world_size, ep=...)``;
* :mod:`minipar.moe.dropless` — dropless EP: no capacity, tokens permuted by expert, uneven all-to-alls (split
  sizes exchanged first), a grouped GEMM over the local experts (MegaBlocks, Megatron-Core);
* :mod:`minipar.moe.allgather` — the all-gather token dispatcher beside the all-to-all (Megatron-Core);
* :mod:`minipar.moe.expert_tp` — expert-TP: every expert's FFN split over tp ranks, beside EP;
* :mod:`minipar.moe.balance` — the router z-loss (ST-MoE), the sequence-wise and batch-wise balance loss and
  auxiliary-loss-free balancing (DeepSeek-V3);
* :mod:`minipar.moe.eplb` — :func:`~minipar.moe.eplb.rebalance_experts`, DeepSeek's expert-parallel load
  balancer (redundant experts packed onto GPUs).
"""
