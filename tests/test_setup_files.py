"""Set-up files agree with each other: environment.yml installs what pyproject.toml asks for, with the
same torch pin as the Makefile, and CI calls the README's test command."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _environment_pip_lines() -> list:
    lines, in_pip = [], False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if re.match(r"\s*- pip:\s*$", line):
            in_pip = True
        elif in_pip and re.match(r"\s{6,}- ", line):
            lines.append(line.split("- ", 1)[1].strip())
        elif in_pip and line.strip():
            in_pip = False
    return lines


def test_environment_yml_asks_for_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in ("course", "test"):
        wanted |= {_name(r) for r in project["optional-dependencies"][extra]}
    pip_lines = _environment_pip_lines()
    listed = {_name(r) for r in pip_lines if not r.startswith("-e")}
    assert listed == wanted
    assert "-e .[course,test]" in pip_lines


def test_torch_pin_is_the_same_everywhere():
    pin = re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert pin == "torch==2.13.0"
    assert pin in _environment_pip_lines()


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci/run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()
