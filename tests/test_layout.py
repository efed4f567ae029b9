"""The shape of the code, held by tests (CONTRIBUTING.md, "How the pieces fit").

* The library never imports course code (``minipar.course``): the course is built on the library, and a
  learner can take the library alone.
* Library files stay readable: at most :data:`LINE_BUDGET` lines, except the few in :data:`EXEMPT`.
* The library has no import cycle, function-level imports counted; it imports its own modules at module level
  only (a function-level import is for a heavy optional dependency); no chapter package imports another.
* Every strategy is started the same way: ``run(..., *, world_size | devices, <keyword-only config>)``,
  which calls the module's ``validate`` (before any process starts).
* Notebooks show public, documented code: no ``inspect.getsource`` of a private name.
* The pieces every loop repeats live once (:mod:`minipar.loop`); one rank palette for the course.
"""
from __future__ import annotations

import ast
import functools
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
    # not a strategy: starting, streaming and stopping processes, root-cause errors, torchrun
    "launcher.py": ("the process machinery every chapter runs on, read as a whole", None),
}

# DataParallel is threads in one process (``dp.run(recipe, devices=4)``): the one strategy without ranks.
IN_PROCESS_STRATEGIES = ["minipar.data.dp"]


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """Each file parsed once per session: a dozen tests read the same trees (ast.walk never changes them)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _defines_parallel_train(path: Path) -> bool:
    tree = _tree(path)
    return any(isinstance(node, ast.FunctionDef) and node.name == "parallel_train" for node in tree.body)


def strategy_modules() -> list:
    """Every library module that defines ``parallel_train`` at top level is a strategy, found, not listed."""
    found = [_module_name(p) for p in PACKAGE.rglob("*.py")
             if "course" not in p.relative_to(PACKAGE).parts and _defines_parallel_train(p)]
    return sorted(found) + IN_PROCESS_STRATEGIES


def library_files() -> list:
    return sorted(p for p in PACKAGE.rglob("*.py") if "course" not in p.relative_to(PACKAGE).parts)


def _imports(path: Path) -> list:
    tree = _tree(path)
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
    def budget(path):
        return EXEMPT.get(str(path.relative_to(PACKAGE)), (None, LINE_BUDGET))[1] or float("inf")
    over = {str(p.relative_to(PACKAGE)): n for p in library_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > budget(p)}
    assert not over, f"over {LINE_BUDGET} lines (split the file, or exempt it with a reason): {over}"


def test_strategies_are_found_by_their_parallel_train():
    found = set(strategy_modules())
    assert {"minipar.data.ddp", "minipar.data.hsdp", "minipar.data.zeropp", "minipar.data.powersgd",
            "minipar.data.diloco", "minipar.hybrid.runner"} <= found, sorted(found)


@pytest.mark.parametrize("name", strategy_modules())
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


def test_the_library_takes_recipes_and_results_from_the_ground_floor():
    """``Recipe`` and ``RunResult`` (and the ready-made recipes) live in :mod:`minipar.recipe`; the equivalence
    harness (:mod:`minipar.check`) re-exports them for the chapters, and a library module imports them from
    the ground floor, not from the harness."""
    records = {"Recipe", "RunResult", "default_loss", "gpt_recipe", "mlp_recipe"}
    offenders = []
    for path in library_files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "check":
                offenders += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name in records]
    assert not offenders, offenders


# Names that once meant two things in two modules (another signature, another quantity): one definition each.
ONE_MEANING = ["activation_bytes_formula", "activation_elements", "model_state_bytes", "Deadlock", "SCHEDULES",
               "predicted_bytes_sent", "megatron_seeds", "DropoutStreams"]


def test_one_name_means_one_thing():
    defined = {}
    for path in library_files():
        for node in _tree(path).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
            for name in set(names) & set(ONE_MEANING):
                defined.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice, twice


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


# ------------------------------------------------------------------------------------------------------
# The import graph: every import statement, at module level or inside a function, is an edge
# ------------------------------------------------------------------------------------------------------

def import_edges(paths) -> dict:
    """{module: {(imported minipar module, inside a function?)}} for the files ``paths``: ``from a import b``
    counts as importing ``a.b`` when that is a module of ours, else ``a``; relative imports resolved."""
    return {_module_name(path): _file_edges(path) for path in paths}


@functools.lru_cache(maxsize=None)
def _known_modules() -> frozenset:
    return frozenset(_module_name(p) for p in PACKAGE.rglob("*.py"))


@functools.lru_cache(maxsize=None)
def _file_edges(path: Path) -> frozenset:
    """One file's edges, found once per session: five tests walk the library's import graph (it was parsed and
    walked again for each)."""
    known = _known_modules()
    name, tree = _module_name(path), _tree(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node, nested in _import_statements(tree, False):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add((target, nested))
    return frozenset(found)


def _import_statements(node, nested: bool):
    """Every import statement under ``node``, with whether it sits inside a function (a def at any depth).
    Statements only hold statements: the walk skips every expression (ast.walk visited them all, and walked each
    function's subtree again to find what is nested)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, nested
        elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
            yield from _import_statements(child, nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def cycles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _ in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_library_has_no_import_cycle():
    edges = import_edges(p for p in library_files() if not p.name.startswith("test_"))
    assert not cycles(edges), cycles(edges)


# The floors: an arrow between folders points one way only
GROUND_FLOOR = ["minipar.hooks", "minipar.calls", "minipar.comm", "minipar.comm_log", "minipar.wire", "minipar.rings",
                "minipar.flight", "minipar.launcher", "minipar.mesh", "minipar.layout", "minipar.validation"]


def _imports_of(modules) -> dict:
    edges = import_edges(p for p in library_files() if not p.name.startswith("test_"))
    return {m: {t for t, _ in edges[m]} for m in modules}


def test_the_ground_floor_imports_no_instrument_and_no_model_above_it():
    """comm, its log and hooks, the launcher: no arrow up to the measurement wing (minipar.observe), the
    machine model (minipar.machine) or the debug tools, whose instruments register through minipar.hooks."""
    up = {m: sorted(t for t in found if t.startswith(("minipar.observe", "minipar.machine", "minipar.debug")))
          for m, found in _imports_of(GROUND_FLOOR).items()}
    assert not any(up.values()), {m: t for m, t in up.items() if t}
    assert _imports_of(["minipar.hooks"])["minipar.hooks"] == set()        # the interface imports nothing of ours


def test_the_machine_model_observes_nothing():
    machine = [m for m in import_edges(PACKAGE.glob("machine/*.py")) if m.startswith("minipar.machine")]
    assert len(machine) >= 8, machine
    up = {m: sorted(t for t in found if t.startswith("minipar.observe")) for m, found in _imports_of(machine).items()}
    assert not any(up.values()), {m: t for m, t in up.items() if t}


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {("b", False)}, "b": {("c", True)}, "c": {("a", False)}, "d": {("a", False)}}) == [["a", "b", "c"]]
    assert cycles({"a": {("b", True)}, "b": set()}) == []


def test_the_library_imports_its_own_modules_at_module_level():
    edges = import_edges(p for p in library_files() if not p.name.startswith("test_"))
    inside = sorted(f"{m} -> {t}" for m, found in edges.items() for t, nested in found if nested)
    assert not inside, inside


def test_no_chapter_package_imports_another():
    offenders = []
    for chapter in sorted((PACKAGE / "course").glob("ch*_*")):
        edges = import_edges(chapter.rglob("*.py"))
        offenders += [f"{m} -> {t}" for m, found in edges.items() for t, _ in found
                      if re.match(r"minipar\.course\.ch\d\d", t) and not t.startswith(f"minipar.course.{chapter.name}")]
    assert not offenders, offenders
