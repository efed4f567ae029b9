"""Chapter 09b — Five dimensions and MoE on one mesh: dp × pp × cp × tp, with ep folded in."""
