"""Chapter 03: sharded data parallelism, ZeRO-1/2/3 → FSDP."""
