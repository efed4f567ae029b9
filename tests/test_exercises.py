"""The exercise machinery: exercises/ is generated from solutions/, and every check fails on its stub.

Generic over every ``solutions/*.ipynb``, so a new chapter's exercises are covered without touching this
file. Each solution notebook runs here too, then its stubs, in one kernel the module shares (SharedKernel):
its check cells must pass.
(``pytest solutions --nbval-lax`` runs them alone.)
"""
from __future__ import annotations

import json
import nbformat
import pytest

from minipar.course import exercises as ex

SOLUTIONS = sorted((ex.ROOT / "solutions").glob("*.ipynb"))
EXPECTED_ERRORS = {"NotImplementedError", "ExerciseError"}


def _nb(cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    for i, c in enumerate(nb.cells):
        c.id = f"c{i}"
    return nb


def _synthetic():
    body = ("def f(x):\n    \"\"\"Double x.\"\"\"\n    y = x\n    ### BEGIN SOLUTION\n    y = 2 * x\n"
            "    return y\n    ### END SOLUTION\n")
    code = nbformat.v4.new_code_cell(body)
    code.outputs = [nbformat.v4.new_output("stream", text="hi\n")]
    code.execution_count = 3
    check = nbformat.v4.new_code_cell("check(f)", metadata={"tags": ["check"]})
    answer = nbformat.v4.new_markdown_cell("Why?\n\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION")
    return _nb([nbformat.v4.new_markdown_cell("# Title"), code, check, answer])


# ---------------------------------------------------------------------------------------------------
# The generator itself, on a synthetic notebook
# ---------------------------------------------------------------------------------------------------

def test_stub_keeps_the_region_indentation_and_the_code_around_it():
    out = ex.make_exercise(_synthetic(), "99_x_exercises.ipynb")
    code = out.cells[2]
    assert code.source == ("def f(x):\n    \"\"\"Double x.\"\"\"\n    y = x\n    # YOUR CODE HERE\n"
                           "    raise NotImplementedError()\n")
    assert code.outputs == [] and code.execution_count is None
    namespace = {}
    exec(code.source, namespace)  # the stub is valid Python and raises when called
    with pytest.raises(NotImplementedError):
        namespace["f"](1)


def test_check_cells_are_tagged_to_raise_and_a_note_leads():
    out = ex.make_exercise(_synthetic(), "99_x_exercises.ipynb")
    assert out.cells[0].id == ex.NOTE_ID and "../solutions/99_x_exercises.ipynb" in out.cells[0].source
    assert out.cells[3].metadata["tags"] == ["check", "raises-exception"]
    assert "raises-exception" not in out.cells[2].metadata.get("tags", [])
    assert out.cells[4].source == "Why?\n\nYOUR ANSWER HERE"
    assert "BEGIN SOLUTION" not in ex.render(out) and "y = 2 * x" not in ex.render(out)


def test_output_is_deterministic_and_idempotent_on_tags():
    nb = _synthetic()
    once = ex.render(ex.make_exercise(nb, "a.ipynb"))
    assert once == ex.render(ex.make_exercise(nb, "a.ipynb"))
    nb.cells[2].metadata["tags"] = ["check", "raises-exception"]  # already tagged: not tagged twice
    assert ex.make_exercise(nb, "a.ipynb").cells[3].metadata["tags"] == ["check", "raises-exception"]


@pytest.mark.parametrize("source, problem", [
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "without an"),
    ("def f():\n    return 1\n    ### END SOLUTION\n", "without a"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    ### END SOLUTION\n", "nested"),
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "inside a function"),
    ("def f():\n    x = 1  ### BEGIN SOLUTION\n", "alone on its line"),
])
def test_malformed_regions_are_refused_with_the_place(source, problem):
    with pytest.raises(ValueError, match=problem):
        ex.stub_source(source, "solutions/x.ipynb cell 1")


def test_check_mode_reports_stale_missing_and_orphan_files(tmp_path):
    sol, exe = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    nbformat.write(_synthetic(), sol / "99_x_exercises.ipynb")
    args = ["--solutions", str(sol), "--exercises", str(exe)]
    assert ex.main(args + ["--check"]) == 1                      # missing
    assert ex.main(args) == 0
    assert ex.main(args + ["--check"]) == 0
    assert ex.generate(sol, exe) == []                           # nothing to rewrite
    (exe / "99_x_exercises.ipynb").write_text("{}")
    assert ex.main(args + ["--check"]) == 1                      # edited by hand
    ex.generate(sol, exe)
    (exe / "98_gone_exercises.ipynb").write_text("{}")
    assert any("no solution" in p for p in ex.stale(sol, exe))   # its solution was removed


# ---------------------------------------------------------------------------------------------------
# The course's own solutions/ and exercises/
# ---------------------------------------------------------------------------------------------------

def test_exercises_folder_is_generated_from_solutions():
    bad = ex.stale()
    assert not bad, f"exercises/ is out of date, run `python -m minipar exercises`: {bad}"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_notebook_is_well_formed(path):
    nb = nbformat.read(path, as_version=4)
    checks = [c for c in nb.cells if c.cell_type == "code" and ex.CHECK_TAG in c.metadata.get("tags", [])]
    regions = sum(ex.count_regions(c.source) for c in nb.cells)
    assert checks, f"{path.name} has no cell tagged 'check'"
    assert regions, f"{path.name} has no {ex.BEGIN} region"
    for i, cell in enumerate(nb.cells):
        ex.stub_source(cell.source, f"{path.name} cell {i}", cell.cell_type)   # balanced, not nested
        assert ex.RAISES_TAG not in cell.metadata.get("tags", []), \
            f"{path.name} cell {i}: a solution cell must not be expected to raise"
    from minipar.course import chapters
    assert path.stem in {c.name for c in chapters()}, \
        f"{path.name}: name it after its chapter (the notebook's name, minipar/course/chNN_topic/)"


def _kernel():
    import sys
    sys.path.insert(0, str(ex.ROOT / "tools"))
    from notebook_client import SharedKernel
    return SharedKernel(timeout=120, allow_errors=True, kernel_name="python3")


@pytest.fixture(scope="module")
def kernel():
    shared = _kernel()
    yield shared
    shared.close()


def test_the_shared_kernel_leaves_nothing_to_the_next_notebook(kernel, tmp_path):
    """What one notebook leaves in the shared kernel (tools/notebook_client.SharedKernel, also make test's site
    build): a name, torch's default dtype and random state, a figure, the folder; the next starts as a fresh
    kernel does, its first cell numbered [1]. ``fresh``: torch.rand(3) right after torch's own start."""
    import torch
    fresh = torch.rand(3, generator=torch.Generator().manual_seed(torch.Generator().initial_seed())).tolist()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    messy = nbformat.v4.new_code_cell("import os, torch, matplotlib.pyplot as plt\nleft = 1\n"
                                      "torch.set_default_dtype(torch.float64)\ntorch.rand(5)\nplt.figure()\n"
                                      "os.chdir('..')")
    look = nbformat.v4.new_code_cell("import os, torch, matplotlib.pyplot as plt\n"
                                     "print('left' in dir(), torch.get_default_dtype(), torch.rand(3).tolist(), "
                                     "plt.get_fignums(), os.path.basename(os.getcwd()))")
    kernel.run(_nb([messy]), tmp_path / "a")
    kernel.run(_nb([look]), tmp_path / "b")
    assert look.execution_count == 1, look.execution_count
    assert look.outputs[0]["text"].strip() == f"False torch.float32 {fresh} [] b", look.outputs


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_the_solution_runs_and_every_check_fails_on_its_stubs(kernel, path):
    """The solution notebook runs with no error (every check passes); then the exercise notebook, run as a
    learner who wrote nothing would: each check must fail (on the stub: NotImplementedError, or an
    ExerciseError), every other cell must run."""
    solution = nbformat.read(path, as_version=4)
    exercise = ex.make_exercise(nbformat.read(path, as_version=4), path.name)   # in memory: see test above
    kernel.run(solution, ex.ROOT / "solutions")
    kernel.run(exercise, ex.ROOT / "exercises")
    problems = []
    for i, cell in enumerate(solution.cells):
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if cell.cell_type == "code" and errors:
            problems.append(f"solution cell {i} raised {errors[0].ename}: {errors[0].evalue}\n{cell.source}")
    for i, cell in enumerate(exercise.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        is_check = ex.CHECK_TAG in cell.metadata.get("tags", [])
        if is_check and not errors:
            problems.append(f"cell {i} (check) passed on the stub:\n{cell.source}")
        elif is_check and errors[0].ename not in EXPECTED_ERRORS:
            problems.append(f"cell {i} (check) raised {errors[0].ename}: {errors[0].evalue}, not one of "
                            f"{sorted(EXPECTED_ERRORS)}")
        elif not is_check and errors:
            problems.append(f"cell {i} (not a check) raised {errors[0].ename}: {errors[0].evalue}\n"
                            f"{cell.source}")
    assert not problems, f"{path.name}:\n" + "\n\n".join(problems)


def test_json_of_exercises_is_plain_nbformat():
    for path in sorted((ex.ROOT / "exercises").glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        assert nb["nbformat"] == 4
        nbformat.validate(nbformat.reads(path.read_text(encoding="utf-8"), as_version=4))
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), path.name


def test_committed_notebooks_have_cell_ids_and_no_outputs():
    """nbformat 4.5 requires an id on every cell (a cell pasted in by hand can lack one: nbformat then warns
    and will refuse); notebooks are committed without outputs."""
    problems = []
    for folder in ("notebooks", "solutions", "exercises"):
        for path in sorted((ex.ROOT / folder).glob("*.ipynb")):
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            problems += [f"{folder}/{path.name} cell {i}: no id" for i, c in enumerate(cells) if "id" not in c]
            problems += [f"{folder}/{path.name} cell {i}: has outputs" for i, c in enumerate(cells)
                         if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not problems, "\n".join(problems)
