"""``python -m minipar --help`` says what each command does and ``python -m minipar bench --help`` what each
benchmark does, one entry each, as ``git`` and ``torchrun`` do (issue 51); an unknown name exits 2 with the
same list on standard error."""
import os
import re
import subprocess
import sys

from minipar.__main__ import COMMANDS, main
from minipar.course import bench


def _entries(text: str, names) -> dict:
    """{name: its description} from a listing of ``  name  what it does`` lines (continuations indented)."""
    found = {}
    for block in re.split(r"\n(?=  \S)", text.split("\n\n")[1].split(":\n", 1)[1]):
        name, _, what = block.strip().partition(" ")
        found[name] = " ".join(what.split())
    assert set(found) == set(names), (sorted(found), sorted(names))
    return found


def test_minipar_help_describes_every_command(capsys):
    assert main(["--help"]) == 0
    described = _entries(capsys.readouterr().out, COMMANDS)
    assert all(len(what) > 20 for what in described.values()), described
    assert "bench --help" in described["bench"] and "torchrun" in described["train"]


def test_minipar_help_also_names_and_describes_every_benchmark(capsys):
    """The top-level help lists what ``bench`` runs too, each benchmark with its line from ``bench --help``."""
    assert main(["--help"]) == 0
    block = capsys.readouterr().out.split("\n\n")[2]
    assert block.startswith("benchmarks (python -m minipar bench NAME):"), block
    described = _entries("\n\n" + block, bench.benchmarks())
    assert described == {name: " ".join(bench.describe(run).split()) for name, run in bench.benchmarks().items()}


def test_bench_help_gives_each_benchmark_its_own_line(capsys):
    assert bench.main(["--help"]) == 0
    described = _entries(capsys.readouterr().out, bench.benchmarks())
    assert all(len(what) > 20 for what in described.values()), described
    assert len(set(described.values())) == len(described), described      # no two share a module's line
    assert not any("``" in what or ":func:" in what or "python -m" in what for what in described.values())


def test_an_unknown_command_or_benchmark_is_refused_with_the_list(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and all(name in err for name in COMMANDS)
    assert main(["bench", "tpp"]) == 2
    assert "unknown benchmark 'tpp'" in capsys.readouterr().err


def test_python_dash_m_minipar_help_is_the_same_listing():
    shown = subprocess.run([sys.executable, "-m", "minipar", "--help"], capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert all(f"\n  {name} " in shown.stdout for name in COMMANDS)
