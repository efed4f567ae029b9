"""Sequence (context) parallelism for long inputs: the sequence itself is split across ranks, attention
included — ring self-attention (Colossal-AI), causal ring attention with zig-zag load balancing, and
DeepSpeed-Ulysses; :mod:`.context_parallel` trains the tiny GPT with any of them (chapter 06b). The
single-device kernel the ring runs on each block is FlashAttention-2 in PyTorch (:mod:`.flash`), and
:mod:`.chunked_loss` computes the cross-entropy over a large vocabulary without holding all the logits."""
