"""06b · Long sequences: ring self-attention, ring attention with zig-zag load balancing, DeepSpeed-Ulysses."""
