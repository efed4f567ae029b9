"""Appendix A — How minipar measures: traces, replays, wire counting, spreads, calibration, recordings."""
