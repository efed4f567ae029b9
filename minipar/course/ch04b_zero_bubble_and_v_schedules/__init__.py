"""Chapter 04b: zero bubble and the V schedules (ZB-H1, ZB-V, DualPipeV, V-Half, V-Min)."""
