"""Chapter 11: recomputation and memory."""
