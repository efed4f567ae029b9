"""Chapter 02: data parallelism, DP → parameter server → DDP."""
