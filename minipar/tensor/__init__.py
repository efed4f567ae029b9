"""Tensor parallelism: one layer's matrices split across the ranks of a tensor-parallel group.

Chapter 01's hand-written matmul splits (``matmul_split``), Megatron's column- and row-parallel layers with
the conjugate operators f and g (``operators``, ``layers``), the vocabulary-parallel embedding and loss
(``vocab``), the tiny GPT made tensor-parallel (``gpt``) and Megatron sequence parallelism (``sequence``).
"""
