"""Chapter 14: shrinking communication — bytes against loss (PowerSGD, DiLoCo and streaming DiLoCo beside DDP
and ZeRO-3)."""
