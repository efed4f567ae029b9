"""Chapter 10b: FP8 training — scales, granularity, accumulation, and the bytes it saves."""
