"""Chapter 13: when it goes wrong — hangs, desyncs, stragglers, silent wrong gradients, seeds and NaNs."""
