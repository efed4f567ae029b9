"""What every chapter's pictures share: one colour per rank, the same in every figure of the course."""

__all__ = ["RANK_COLOURS", "rank_colour", "save_figure"]

# matplotlib's "deep" palette, eight ranks; rank r is drawn in RANK_COLOURS[r % 8] in every chapter
RANK_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def save_figure(fig, path, *, dpi: int = 120, tight_layout: bool = False, bbox_inches=None) -> None:
    """Write ``fig`` to ``path`` and close it (a figure generator makes many; open ones keep their memory)."""
    import matplotlib.pyplot as plt
    if tight_layout:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi, bbox_inches=bbox_inches)
    plt.close(fig)
