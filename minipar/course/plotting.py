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


def show_with_alt(fig, alt: str) -> None:
    """Shows ``fig`` inline as a PNG whose HTML carries ``alt`` as its alternative text; outside a notebook, closes it."""
    import base64
    import html
    import io

    import matplotlib.pyplot as plt
    from IPython import get_ipython
    from IPython.display import display
    if get_ipython() is None:
        plt.close(fig)
        return
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode()
    display({"image/png": png, "text/plain": alt,
             "text/html": f'<img src="data:image/png;base64,{png}" alt="{html.escape(alt)}">'}, raw=True)
