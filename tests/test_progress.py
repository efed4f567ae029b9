"""minipar.progress.bar: a tqdm bar in terminals and notebooks, rank 0 only inside launched ranks."""
import io

import pytest

pytest.importorskip("tqdm")

from minipar import launch
from minipar.progress import bar


def test_bar_yields_every_item_and_counts_them():
    b = bar(range(5), desc="steps", disable=False, file=io.StringIO())
    assert list(b) == [0, 1, 2, 3, 4] and b.n == 5


def test_bar_is_silent_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    assert list(bar(range(3), desc="quiet")) == [0, 1, 2]
    assert "quiet" not in capsys.readouterr().err          # pytest's stderr is no terminal


def test_forced_bar_draws_desc_and_total(capsys):
    for _ in bar(range(3), desc="forced", disable=False):
        pass
    err = capsys.readouterr().err
    assert "forced" in err and "3/3" in err


def test_manual_bar_with_total():
    out = io.StringIO()
    with bar(total=4, desc="manual", disable=False, file=out) as b:
        for _ in range(4):
            b.update()
    assert "4/4" in out.getvalue()


def _train(rank, world_size, steps):
    total = 0
    for step in bar(range(steps), desc="training"):
        total += step
    return total


def test_only_rank_0_draws_inside_launched_ranks(capsys):
    assert launch(_train, 2, 4) == [6, 6]
    out = capsys.readouterr().out
    assert "[rank 0] training: 100%" in out and "4/4" in out
    assert "[rank 1]" not in out


def test_streamed_bar_comes_as_lines(capsys):
    launch(_train, 2, 3, stream=True)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("[rank 0] training: 100%") for line in lines)
    assert not any("\r" in line for line in lines)
