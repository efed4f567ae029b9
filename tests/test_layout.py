"""The shape of the code, held by tests (CONTRIBUTING.md, "How the pieces fit").

* The library never imports course code (``minipar.course``): the course is built on the library, and a
  learner can take the library alone.
* Library files stay readable: at most :data:`LINE_BUDGET` lines, except the few in :data:`EXEMPT`.
* Every strategy is started the same way: ``run(..., *, world_size | devices, <keyword-only config>)``,
  which calls the module's ``validate`` (before any process starts).
* Notebooks show public, documented code: no ``inspect.getsource`` of a private name.
* The pieces every loop repeats live once (:mod:`minipar.loop`); one rank palette for the course.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minipar"
LINE_BUDGET = 300
EXEMPT = {
    # every collective wrapper with its traffic model, and the send/recv rings, on one page to compare
    "comm.py": "the reference table of every collective (wrappers + the hand-written rings)",
    # not a strategy: starting, streaming and stopping processes, root-cause errors, torchrun
    "launcher.py": "the process machinery every chapter runs on, read as a whole",
}

STRATEGIES = ["minipar.data.dp", "minipar.data.ddp", "minipar.data.parameter_server", "minipar.data.zero",
              "minipar.data.fsdp", "minipar.pipeline.runtime", "minipar.pipeline.pipedream", "minipar.tensor.gpt",
              "minipar.tensor.matmul_split", "minipar.sequence.context_parallel", "minipar.tensor.multidim_mlp",
              "minipar.moe.expert_parallel", "minipar.hybrid.parallel3d"]


def library_files() -> list:
    return sorted(p for p in PACKAGE.rglob("*.py") if "course" not in p.relative_to(PACKAGE).parts)


def _imports(path: Path) -> list:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names += [("." * node.level) + module] + [("." * node.level) + module + "." + a.name for a in node.names]
    return names


def test_the_library_never_imports_course_code():
    offenders = [f"{p.relative_to(ROOT)}: {name}" for p in library_files() if p.name != "__main__.py"
                 for name in _imports(p) if re.search(r"(^|\.)course(\.|$)", name)]
    assert not offenders, offenders


def test_library_files_fit_the_line_budget():
    over = {str(p.relative_to(PACKAGE)): n for p in library_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > LINE_BUDGET
            and str(p.relative_to(PACKAGE)) not in EXEMPT}
    assert not over, f"over {LINE_BUDGET} lines (split the file, or exempt it with a reason): {over}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_is_started_by_one_verb_with_keyword_only_configuration(name):
    module = importlib.import_module(name)
    assert callable(getattr(module, "run", None)), f"{name} has no run(...)"
    assert callable(getattr(module, "validate", None)), f"{name} has no validate(...)"
    params = list(inspect.signature(module.run).parameters.values())
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    assert keyword_only and ({"world_size", "devices"} & set(keyword_only)), (name, keyword_only)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert len(positional) <= 3, f"{name}.run: configuration must be keyword-only, got {positional}"
    assert "validate(" in inspect.getsource(module.run), f"{name}.run must validate before it launches"


def test_notebooks_show_no_private_code():
    """Neither ``getsource(mod._name)`` nor a cell that shows source and names a private attribute
    (``for fn in (comm._exchange, ...): print(getsource(fn))`` — how chapter 00 once showed one)."""
    shown = re.compile(r"getsource\(([\w.]+)\)")
    named = re.compile(r"\b[A-Za-z]\w*(?:\.\w+)*\._[a-z]\w*")
    private = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            text = "".join(cell["source"])
            for target in shown.findall(text):
                if any(part.startswith("_") for part in target.split(".")):
                    private.append(f"{path.name} cell {i}: {target}")
            if cell["cell_type"] == "code" and "getsource(" in text:
                private += [f"{path.name} cell {i}: {name}" for name in named.findall(text)]
    assert not private, private


def test_loop_pieces_and_the_palette_live_once():
    texts = {p: p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py") if not p.name.startswith("test_")}
    reshape_loss = [str(p.relative_to(ROOT)) for p, t in texts.items()
                    if re.search(r"cross_entropy\(\w+\.reshape\(-1, \w+\.shape\[-1\]\)", t)]
    assert reshape_loss == ["minipar/loop.py"], reshape_loss
    palettes = [str(p.relative_to(ROOT)) for p, t in texts.items() if re.search(r"^RANK_COLOURS\s*=", t, re.M)]
    assert palettes == ["minipar/course/plotting.py"], palettes
    shard_defs = [str(p.relative_to(ROOT)) for p, t in texts.items() if "def shard_batch(" in t]
    assert shard_defs == ["minipar/loop.py"], shard_defs
