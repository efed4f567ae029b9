"""Sequence (context) parallelism for long inputs: the sequence itself is split across ranks, attention
included — ring self-attention (Colossal-AI), causal ring attention with zig-zag load balancing, and
DeepSpeed-Ulysses; :mod:`.context_parallel` trains the tiny GPT with any of them (chapter 06b)."""
