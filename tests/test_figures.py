"""The figure generator: every registered figure (``minipar/figures/chNN_*.py``'s ``FIGURES``) is made by
``minipar.figures.generate`` into a temporary folder and is a non-empty PNG. One test per figure, so a slow
or broken chapter is named; the committed ``figures/`` holds a PNG for every registered figure."""
import pytest

from minipar import figures

NAMES = sorted(figures.all_figures())
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_figures_are_registered_with_png_names():
    assert NAMES, "no figure registered"
    for name in NAMES:
        assert name.endswith(".png") and name[:2].isdigit() and name[2] == "_", name


@pytest.mark.parametrize("name", NAMES)
def test_generator_writes_a_nonempty_png(name, tmp_path):
    written = figures.generate(str(tmp_path), select=name)
    path = tmp_path / name
    assert str(path) in written and path.exists(), name
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, f"{name}: {len(data)} bytes, not a PNG picture"


def test_every_registered_figure_is_committed_in_figures_folder():
    from minipar.exercises import ROOT
    missing = [n for n in NAMES if not (ROOT / "figures" / n).exists()]
    assert not missing, f"run `python -m minipar figures` and commit: {missing}"
