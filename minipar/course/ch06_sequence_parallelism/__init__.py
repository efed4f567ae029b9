"""Chapter 06: sequence parallelism (Megatron)."""
