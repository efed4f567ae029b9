"""Chapter 05: tensor parallelism (Megatron)."""
