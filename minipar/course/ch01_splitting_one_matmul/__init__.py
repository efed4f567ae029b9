"""Chapter 01: splitting one matmul."""
