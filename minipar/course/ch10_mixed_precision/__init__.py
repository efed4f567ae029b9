"""Chapter 10: mixed precision, FP32 → FP16 → BF16."""
