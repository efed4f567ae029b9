"""Chapter 00: setup and collectives."""
