"""Build the course site: every chapter executed now, rendered to static HTML with all its outputs.

    .venv/bin/python tools/site.py [--out build/site] [--jobs 2] [-k 04_]

Why nbconvert + nbclient and not Jupyter Book: both are already installed with JupyterLab (no new
dependency, nothing fetched at build time), each chapter renders to one self-contained page with its pictures
embedded, and the build is a short script the course can read. Jupyter Book 1.x (Sphinx, MyST-NB, a theme)
would add about forty packages for a sidebar and search.

What the site has:
* ``index.html``: the chapter map (number, title, summary, route, minutes to read, seconds to run: from
  ``minipar/course/syllabus.py``, beside the seconds this build measured), linked;
* ``notebooks/NN_topic.html``: each chapter, executed at build time (outputs, figures, widgets' first view);
* ``glossary.html``: every chapter's glossary table (English, 中文, chapter) in one place, with the terms of
  ``docs/glossary.md`` that no chapter's table has;
* ``cli.html``, ``library.html``: ``docs/cli.md`` (the train and bench commands) and ``docs/library.md``;
* ``figures.html``: every figure under figures/, by chapter;
* ``exercises/``, ``solutions/``: the notebooks themselves, so a chapter's links to them download them;
* ``manifest.json``: what the build saw per chapter (cells, outputs, images, errors), used by the test.

A widget cannot run without a kernel, so its page shows the widget's first view (what its Output areas
held after the cell ran), marked as such. Any error output fails the build (exit status 1) and is listed.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # this checkout's minipar (the syllabus), also when another is installed
sys.path.insert(0, str(ROOT / "tools"))  # notebook_client, also when this file is imported by a test
from minipar.course import syllabus  # noqa: E402
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*(Error|Exception): ")


def chapters(root: Path = ROOT, pattern: str = "") -> list[Path]:
    return [p for p in sorted((root / "notebooks").glob("*.ipynb")) if pattern in p.name]


def kernel_env(threads: int | None = None) -> dict:
    """A chapter kernel's environment: figures inline; ``threads`` intra-op threads (None: torch's default)."""
    env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def client_options(timeout: int) -> dict:
    """What a chapter's nbclient client is made with (its start-up wait: see :func:`execute`)."""
    return dict(timeout=timeout, startup_timeout=300, kernel_name="python3", allow_errors=True,
                store_widget_state=True)


def execute(path: Path, timeout: int = 600, threads: int | None = None, tries: int = 2, shared=None) -> dict:
    """Run one notebook top to bottom in a fresh kernel (in its own folder); return it as a dict. ``threads``:
    the kernel's intra-op threads (OMP_NUM_THREADS; None: torch's default, one per core). A cell that takes more
    than ``timeout`` seconds (a chapter's whole run is under 30 alone; its launches end a deadlock themselves within
    their collective timeout; beside make test's tests a chapter has taken 277 s), or a kernel that dies, is run
    again once in a fresh kernel, and the log says so; so is one whose kernel does not start or answer (nbclient's
    RuntimeError; its start-up wait is 300 s here, not 60: beside make test's tests the load reaches ~30 on two
    cores). The client is :class:`notebook_client.SlicedClient`: nbclient's own can miss a widget cell's reply and
    wait out the whole timeout (nbclient issue #312). ``shared``: a :class:`notebook_client.SharedKernel` the
    first try runs in (make test's build: one kernel for every chapter); the second try is a fresh kernel."""
    import nbformat
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from notebook_client import SlicedClient

    env = kernel_env(threads)
    for attempt in range(1, tries + 1):
        nb = nbformat.read(path, as_version=4)
        start = time.monotonic()
        try:
            if shared is not None and attempt == 1:
                shared.run(nb, path.parent)
            else:
                SlicedClient(nb, resources={"metadata": {"path": str(path.parent)}},
                             **client_options(timeout)).execute(env=env)
        except (CellTimeoutError, DeadKernelError, RuntimeError) as exc:
            if shared is not None:
                shared.close()                  # the next chapter starts a fresh one
            if attempt == tries:
                raise
            print(f"site: {path.stem}: {type(exc).__name__} after {time.monotonic() - start:.0f} s "
                  f"({str(exc).splitlines()[0][:120]}); once more in a fresh kernel", flush=True)
            continue
        nb.metadata["minipar_seconds"] = round(time.monotonic() - start, 1)
        nb.metadata["minipar_tries"] = attempt
        return nbformat.from_dict(nb)


def _widget_outputs(model_id: str, state: dict, seen=None) -> list:
    """The outputs a widget shows: its Output areas' contents, children first to last."""
    seen = set() if seen is None else seen
    if model_id in seen or model_id not in state:
        return []
    seen.add(model_id)
    model = state[model_id]
    if model.get("model_name") == "OutputModel":
        return list(model["state"].get("outputs", []))
    found = []
    for child in model["state"].get("children", []):
        if isinstance(child, str) and child.startswith("IPY_MODEL_"):
            found += _widget_outputs(child[len("IPY_MODEL_"):], state, seen)
    return found


def freeze_widgets(nb) -> tuple[int, list[str]]:
    """Replace each widget view by what it first showed (a site has no kernel). Returns how many widgets,
    and the first views that show an error message instead of a picture or a number."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    frozen, errors = 0, []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(out)
                continue
            shown = _widget_outputs(view["model_id"], state)
            if shown:
                frozen += 1
                text = "".join(o.get("text", "") for o in shown if o.get("output_type") == "stream")
                if ERROR_TEXT.search(text):
                    errors.append(f"cell {i}: the widget's first view is an error: {text.strip()[:300]}")
                outputs.append({"output_type": "display_data", "metadata": {}, "data": {
                    "text/html": "<p class='minipar-frozen'><em>Interactive in JupyterLab: this is the widget's "
                                 "first view.</em></p>"}})
                outputs += shown
            elif "text/plain" in out.get("data", {}):      # e.g. a finished progress bar: its text
                outputs.append({**out, "data": {"text/plain": out["data"]["text/plain"]}})
        cell.outputs = [_as_output(o) for o in outputs]
    nb.metadata.pop("widgets", None)  # the page needs no widget manager (it would be fetched from a CDN)
    return frozen, errors


def _as_output(o):
    import nbformat
    return nbformat.from_dict(o)


def summarize(nb) -> dict:
    errors, outputs, images = [], 0, 0
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            outputs += 1
            if out.output_type == "error":
                errors.append(f"cell {i}: {out.ename}: {out.evalue}"[:500])
            elif out.output_type == "stream" and out.name == "stderr" and "Traceback" in out.text:
                errors.append(f"cell {i}: traceback on stderr: {out.text[-300:]}")
            images += sum(1 for k in out.get("data", {}) if k.startswith("image/"))
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    return {"cells": len(nb.cells), "code_cells": sum(c.cell_type == "code" for c in nb.cells),
            "unexecuted": sum(1 for c in nb.cells if c.cell_type == "code" and c.source.strip()
                              and c.get("execution_count") is None),
            "outputs": outputs, "images": images, "errors": errors,
            "figures": sorted(set(re.findall(r"\]\(\.\./figures/([^)\s]+\.png)\)", markdown))),
            "predict_leaks": predict_leaks(nb),
            "seconds": nb.metadata.get("minipar_seconds")}


_GUESS = re.compile(r"^(\w+) = None\b", re.M)
_REVEALED = re.compile(r"measured (-?[\d,.]+(?:e[-+]?\d+)?)")


def _output_text(cell) -> str:
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", []))


def predict_leaks(nb) -> list[str]:
    """Executed cells that print a predict cell's answer before its reveal: the number ``reveal`` reports as
    measured (3 characters or more, so that a lone "4" does not count) in an output between the two."""
    leaks = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "# Predict first" not in cell.source:
            continue
        for name in _GUESS.findall(cell.source):
            j = next((j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "code"
                      and re.search(rf"\breveal\(\s*{name}\b", nb.cells[j].source)), None)
            answers = {a for a in _REVEALED.findall(_output_text(nb.cells[j])) if len(a) >= 3} if j else set()
            for k in range(i + 1, j or i + 1):
                shown = _output_text(nb.cells[k])
                found = sorted(a for a in answers if a in shown or a.replace(",", "") in shown)
                if found:
                    leaks.append(f"cell {k} prints {found} before {name} is revealed in cell {j}")
    return leaks


def render(nb) -> str:
    from nbconvert import HTMLExporter
    exporter = HTMLExporter(template_name="lab", embed_images=True)
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"path": str(ROOT / "notebooks")}})
    body = re.sub(r'href="([\w.-]+)\.ipynb', r'href="\1.html', body)  # links between chapters
    body = re.sub(r'href="\.\./docs/(cli|library|glossary)\.md', r'href="../\1.html', body)  # the doc pages
    # a link to a library source file: the site has no copy of the repository, so the name stays, unlinked
    return re.sub(r'<a href="\.\./minipar/[^"]*">(.*?)</a>', r'\1', body, flags=re.S)


_NAV_STYLE = ("padding:6px 16px;border-bottom:1px solid #ddd;font-family:system-ui,sans-serif;font-size:14px;"
              "line-height:1.6;background:#fafafa")


def chapter_nav(chapters: list, current: str | None = None, prefix: str = "") -> str:
    """The navigation every page carries: the course, glossary and figures pages; the previous and next
    chapter (on a chapter's page); and the list of every chapter, the current one in bold. ``chapters``:
    [(stem, title)] in order; ``prefix``: the path from the page to the site's root ("../" from notebooks/)."""
    link = lambda stem, text: f"<a href='{prefix}notebooks/{stem}.html'>{html.escape(text)}</a>"  # noqa: E731
    top = " · ".join(f"<a href='{prefix}{page}.html'>{name}</a>" for page, name in (
        ("index", "minipar course"), ("glossary", "glossary"), ("figures", "figures"), ("cli", "commands"),
        ("library", "library")))
    stems = [stem for stem, _ in chapters]
    if current in stems:
        i = stems.index(current)
        if i > 0:
            top += f" · <span class='minipar-prev'>← {link(*chapters[i - 1])}</span>"
        if i + 1 < len(chapters):
            top += f" · <span class='minipar-next'>{link(*chapters[i + 1])} →</span>"
    listing = []
    for stem, title in chapters:
        short = title.split("·", 1)[-1].split(":")[0].strip() or stem     # the title before its colon
        item = f"<b>{html.escape(short)}</b>" if stem == current else link(stem, short)
        listing.append(f"<span class='minipar-chapter'>{html.escape(stem.split('_')[0])} {item}</span>")
    listing = " · ".join(listing)
    return (f"<nav class='minipar-nav' style='{_NAV_STYLE}'><div>{top}</div>"
            f"<div class='minipar-chapters'>chapters: {listing}</div></nav>")


def with_nav(page: str, chapters: list, current: str) -> str:
    """A rendered chapter page with :func:`chapter_nav` at the top and the previous/next links at the bottom."""
    nav = chapter_nav(chapters, current, prefix="../")
    page = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav, page, count=1)
    return page.replace("</body>", nav.replace("minipar-nav", "minipar-nav minipar-bottom") + "</body>", 1)


def _build_one(args) -> tuple[str, dict, str]:
    """One chapter executed and rendered: (stem, what the manifest says of it, its page). A chapter that could
    not be executed (its second try failed too) or rendered is a page and a manifest entry saying why, with the
    error in ``errors``: the other chapters are still built, and the build fails at its end, naming it."""
    path, timeout, threads, shared = args
    try:
        nb = execute(path, timeout, threads, shared=shared)
        frozen, widget_errors = freeze_widgets(nb)
        info = summarize(nb)
        info.update(widgets_frozen=frozen, title=describe(nb), glossary=glossary(nb))
        info["errors"] += widget_errors
        return path.stem, info, render(nb)
    except Exception as exc:                        # noqa: BLE001 — any reason, said in the manifest and the log
        import traceback
        why = f"not built: {type(exc).__name__}: {exc}"[:500]
        print(f"site: {path.stem}: {why}\n{traceback.format_exc()[-2000:]}", flush=True)
        info = {"cells": 0, "code_cells": 0, "unexecuted": 0, "outputs": 0, "images": 0, "errors": [why],
                "figures": [], "predict_leaks": [], "seconds": None, "widgets_frozen": 0, "title": "",
                "glossary": []}
        return path.stem, info, f"<html><body><h1>{html.escape(path.stem)}</h1><p>{html.escape(why)}</p></body></html>"


def describe(nb) -> str:
    """The chapter's title, from its first cell (the rest of what the map shows is the syllabus's)."""
    first = nb.cells[0].source if nb.cells else ""
    return next((l.lstrip("# ").strip() for l in first.splitlines() if l.startswith("# ")), "")


def glossary(nb) -> list[tuple[str, str]]:
    """The rows of the chapter's glossary table (English | 中文)."""
    rows = []
    for cell in nb.cells:
        if cell.cell_type != "markdown" or not re.search(r"^#+\s*Glossary", cell.source, re.M | re.I):
            continue
        table = cell.source[re.search(r"^#+\s*Glossary", cell.source, re.M | re.I).end():]
        for line in table.splitlines():
            parts = [p.strip() for p in line.strip().strip("|").split("|")]
            if len(parts) >= 2 and line.strip().startswith("|") and not set("".join(parts)) <= set("-: ") \
                    and parts[0].lower() != "english":
                rows.append((parts[0], parts[1]))
    return rows


_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}
img{max-width:100%}figure{display:inline-block;margin:8px;max-width:520px}figcaption{font-size:90%}"""


def _page(title: str, body: str, chapters: list = ()) -> str:
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{chapter_nav(list(chapters))}{body}</body></html>")


def course_chapters(root: Path = ROOT) -> list:
    """[(stem, "NN · title")] of every chapter of the course, titles from the syllabus: a site built with ``-k``
    still links every chapter, where the full site has it."""
    return [(p.stem, f"{p.stem.split('_')[0]} · {syllabus.about(p.stem.split('_')[0]).title}")
            for p in chapters(root)]


def _titles(manifest: dict) -> list:
    return course_chapters()


def _map_row(stem: str, built: dict) -> str:
    number = stem.split("_")[0]
    a = syllabus.about(number)
    measured = f" ({built[stem]['seconds']} s here)" if built.get(stem, {}).get("seconds") is not None else ""
    return (f"<tr><td>{html.escape(number)}</td><td><a href='notebooks/{stem}.html'>{html.escape(a.title)}</a></td>"
            f"<td>{html.escape(a.summary)}</td><td>{html.escape(a.route)}</td><td>{a.minutes} min</td>"
            f"<td>{a.run_seconds} s{measured}</td></tr>")


def write_index(out: Path, manifest: dict) -> None:
    rows = "".join(_map_row(p.stem, manifest["chapters"]) for p in chapters(ROOT))
    core, elective = syllabus.route_minutes()
    body = ("<h1>minipar: distributed training, run and measured on CPU ranks</h1>"
            f"<p>Built {html.escape(manifest['built'])}: every chapter linked below that this build ran was "
            "executed for this site, its outputs are the ones it printed and drew. Open the notebooks in "
            "JupyterLab (<code>make lab</code>) to change and rerun them. Also here: <a href='cli.html'>the "
            "commands</a> (<code>train</code>, <code>bench</code>), <a href='library.html'>the library</a>, "
            "<a href='glossary.html'>the glossary</a>, <a href='figures.html'>every figure</a>.</p>"
            f"<p>Two routes: the <b>core path</b>, about {syllabus.hours(core)}, and <b>electives</b>, about "
            f"{syllabus.hours(elective)} in all. Minutes are to read and do the exercises (an estimate); run is "
            "the seconds Run All takes on two cores, as the chapter states it (and as this build took).</p>"
            "<h2>Chapter map</h2><table><tr><th>#</th><th>chapter</th><th>what it does</th><th>route</th>"
            f"<th>minutes</th><th>run</th></tr>{rows}</table>")
    (out / "index.html").write_text(_page("minipar course", body, _titles(manifest)), encoding="utf-8")


def write_glossary(out: Path, manifest: dict) -> None:
    rows = []
    for stem, info in manifest["chapters"].items():
        for en, zh in info["glossary"]:
            rows.append((en.lower(), f"<tr><td>{html.escape(en)}</td><td>{html.escape(zh)}</td>"
                                     f"<td><a href='notebooks/{stem}.html'>{html.escape(stem)}</a></td></tr>"))
    known = {en for en, _ in rows}
    for en, zh, where in doc_glossary():
        if en.lower() not in known:
            links = ", ".join(_chapter_link(n.strip()) for n in where.split(","))
            rows.append((en.lower(), f"<tr><td>{html.escape(en)}</td><td>{html.escape(zh)}</td><td>{links}</td></tr>"))
    body = ("<h1>Glossary · 术语表</h1><table><tr><th>English</th><th>中文</th><th>chapter</th></tr>"
            + "".join(r for _, r in sorted(rows)) + "</table>")
    (out / "glossary.html").write_text(_page("minipar glossary", body, _titles(manifest)), encoding="utf-8")


def _chapter_link(number: str) -> str:
    stem = next((p.stem for p in chapters(ROOT) if p.stem.split("_")[0] == number), None)
    return f"<a href='notebooks/{stem}.html'>{html.escape(stem)}</a>" if stem else html.escape(number)


def doc_glossary(path: Path = ROOT / "docs" / "glossary.md") -> list[tuple[str, str, str]]:
    """(English, 中文, chapters) of each row of the course glossary's table."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(parts) == 3 and not set("".join(parts)) <= set("-: ") \
                and parts[0].lower() != "english":
            rows.append(tuple(parts))
    return rows


def write_doc_pages(out: Path, chapters: list = ()) -> None:
    """docs/cli.md and docs/library.md as cli.html and library.html."""
    from nbconvert.filters import markdown2html
    for name in ("cli", "library"):
        text = (ROOT / "docs" / f"{name}.md").read_text(encoding="utf-8")
        title = text.splitlines()[0].lstrip("# ").strip()
        (out / f"{name}.html").write_text(_page(title, markdown2html(text), chapters), encoding="utf-8")


def write_figures(out: Path, root: Path, chapters: list = ()) -> list[str]:
    names = sorted(p.name for p in (root / "figures").glob("*.png")) if (root / "figures").is_dir() else []
    if names:
        shutil.copytree(root / "figures", out / "figures", dirs_exist_ok=True)
    body = "<h1>Figures</h1><p>Made by <code>python -m minipar figures</code>.</p>" + "".join(
        f"<figure><a href='figures/{n}'><img src='figures/{n}' alt='{n}'></a><figcaption>{n}</figcaption></figure>"
        for n in names)
    (out / "figures.html").write_text(_page("minipar figures", body, chapters), encoding="utf-8")
    return names


def copy_exercise_notebooks(out: Path, root: Path) -> list[str]:
    """exercises/ and solutions/ beside the chapter pages, so a chapter's "Exercises" link downloads the notebook
    (a static page cannot run it: open it in JupyterLab)."""
    copied = []
    for folder in ("exercises", "solutions"):
        for path in sorted((root / folder).glob("*.ipynb")):
            (out / folder).mkdir(exist_ok=True)
            shutil.copy2(path, out / folder / path.name)
            copied.append(f"{folder}/{path.name}")
    return copied


class _Inline:
    """Stands in for a process pool when one notebook at a time is asked for."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def map(fn, items):
        return map(fn, items)


def shared_kernel(timeout: int = 600):
    """One kernel for every chapter, run one after another (make test's build, where the chapters' seconds are
    not a learner's anyway): 22 kernel starts fewer, about 8 s of CPU each. ``make site`` keeps a fresh kernel
    per chapter, as a learner has."""
    from notebook_client import SharedKernel, SlicedClient
    return SharedKernel(SlicedClient, env=kernel_env(), **client_options(timeout))


def build(out: Path, notebooks: list[Path], jobs: int = 2, timeout: int = 600, log=print, alone: bool = True,
          one_kernel: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "notebooks").mkdir(exist_ok=True)
    manifest = {"built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "chapters": {},
                "selected": [p.stem for p in notebooks]}     # all chapters, or those of `-k`
    # jobs kernels share the cores: each gets its share of threads (2 kernels × 2 threads on 2 cores would
    # wait on each other far longer than a second thread saves on the chapters' small tensors)
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
    shared = shared_kernel(timeout) if one_kernel and jobs == 1 else None
    work = [(p, timeout, threads, shared) for p in notebooks]
    manifest["kernels_at_once"], manifest["threads_per_kernel"] = jobs, threads or "default"
    manifest["one_kernel"] = shared is not None
    manifest["alone"] = alone           # False: other work shared the cores (make test), seconds not a learner's
    pages = {}
    with ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else _Inline() as pool:
        try:
            for stem, info, page in pool.map(_build_one, work):
                pages[stem] = page
                manifest["chapters"][stem] = info
                log(f"site: {stem}: {info['seconds']} s, {info['outputs']} outputs, {info['images']} images, "
                    f"{len(info['errors'])} errors")
        finally:
            if shared is not None:
                shared.close()
    for stem, page in pages.items():      # every title is known now: each page links to every chapter
        (out / "notebooks" / f"{stem}.html").write_text(with_nav(page, _titles(manifest), stem), encoding="utf-8")
    manifest["figures"] = write_figures(out, ROOT, _titles(manifest))
    manifest["notebooks_to_download"] = copy_exercise_notebooks(out, ROOT)
    write_index(out, manifest)
    write_glossary(out, manifest)
    write_doc_pages(out, _titles(manifest))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "site"))
    ap.add_argument("--jobs", type=int, default=2, help="notebooks executed at once")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one cell may take (then: once more)")
    ap.add_argument("-k", default="", help="only chapters whose file name contains this")
    ap.add_argument("--beside-other-work", action="store_true",
                    help="other work shares the cores (make test's tests): record that the seconds are not a learner's")
    ap.add_argument("--one-kernel", action="store_true",
                    help="every chapter in one kernel, one after another (make test: 22 kernel starts fewer)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    manifest = build(Path(args.out), chapters(ROOT, args.k), args.jobs, args.timeout,
                     alone=not args.beside_other_work, one_kernel=args.one_kernel)
    errors = [f"{stem}: {e}" for stem, info in manifest["chapters"].items() for e in info["errors"]]
    print(f"site: {len(manifest['chapters'])} chapters in {time.monotonic() - start:.0f} s -> "
          f"{Path(args.out) / 'index.html'}")
    if errors:
        print("site: errors in the executed chapters:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
