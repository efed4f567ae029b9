"""Chapter 09: mixture of experts and expert parallelism."""
