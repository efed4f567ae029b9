"""Chapter 07: multi-dimensional tensor parallelism — 2D (SUMMA), 2.5D (Tesseract), 3D, measured against 1D."""
