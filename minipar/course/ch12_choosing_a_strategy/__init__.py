"""Chapter 12: choosing a strategy — a cost model, a planner and the source articles' decision guide."""
