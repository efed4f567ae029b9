"""Chapter 04: pipeline parallelism."""
