"""What every chapter's pictures share: one colour per rank, the same in every figure of the course."""

__all__ = ["RANK_COLOURS", "rank_colour"]

# matplotlib's "deep" palette, eight ranks; rank r is drawn in RANK_COLOURS[r % 8] in every chapter
RANK_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]
