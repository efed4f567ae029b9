"""Chapter 08 — Hybrid parallelism: data × pipeline × tensor parallelism (+ ZeRO-1) on a device mesh."""
