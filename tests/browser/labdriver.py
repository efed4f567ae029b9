"""Drive the course in JupyterLab through headless Chromium (Playwright with the system browser).

Used by tests/browser/test_lab.py; runnable by hand too:
    .venv/bin/python tests/browser/labdriver.py notebooks/04_pipeline_parallelism.ipynb
starts JupyterLab on a temporary copy of the course, runs every cell, moves every widget's sliders, and
prints what it saw (screenshots under tests/browser/artifacts/).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
SETUP = ROOT / "tools" / "setup_browser.sh"
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*(Error|Exception): ")


def find_chromium() -> str | None:
    """The system Chromium: $CHROMIUM, or chromium / chromium-browser / google-chrome on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def how_to_set_up() -> str:
    return (f"the browser test needs Chromium, a Chinese font and the playwright package: run "
            f"`{SETUP.relative_to(ROOT)}` (root: apt-get install -y chromium fonts-noto-cjk; pip install playwright; "
            f"idempotent), or set CHROMIUM=/path")


def chinese_fonts() -> list[str]:
    """Font families fontconfig offers for Chinese (none: the glossaries' 中文 show as empty boxes)."""
    try:
        out = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({line.split(",")[0].strip() for line in out.splitlines() if line.strip()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def course_path(item: Path) -> Path:
    """Where ``item`` lies in the course copy: its place in the repository, or notebooks/ for a notebook
    from elsewhere (a variant to test in place of the chapter of the same name)."""
    return item.relative_to(ROOT) if ROOT in item.parents else Path("notebooks") / item.name


# JupyterLab settings for a test: every cell in the DOM (no windowing), no news or update pop-ups.
_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}


@contextlib.contextmanager
def jupyterlab(course_files: list[Path]):
    """A JupyterLab server on a temporary copy of ``course_files`` (folders or files, relative layout kept);
    yields ``(base_url, token, root)``. The server and its kernels are stopped afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="minipar-lab-"))
    root = tmp / "course"
    for item in course_files:
        item = Path(item).resolve()
        target = root / course_path(item)
        if item.is_dir():
            shutil.copytree(item, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(item, target)
    settings = tmp / "settings"
    for name, value in _SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(value))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "ws"),
               JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               PYTHONUNBUFFERED="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
    port, token = _free_port(), "minipar-browser-test"
    log = open(tmp / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.allow_root=True",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp / "lab.log").read_text()[-3000:])
                time.sleep(0.3)
        yield base, token, root
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class SliderMove:
    cell: int
    label: str
    before: str
    after: str
    changed: bool


@dataclass
class ChapterRun:
    notebook: str
    cells: list = field(default_factory=list)        # [{"index", "count", "errors": [...]}]
    widget_cells: list = field(default_factory=list)  # cell indices that show widgets
    first_views: dict = field(default_factory=dict)   # cell index -> {"images", "text"}
    moves: list = field(default_factory=list)
    screenshots: list = field(default_factory=list)
    seconds: float = 0.0

    def errors(self) -> list[str]:
        found = [f"cell {c['index']}: {e}" for c in self.cells for e in c["errors"]]
        found += [f"cell {c['index']} did not run" for c in self.cells if c["count"] is None]
        return found


_JS_CELLS = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const cells = nb.content.model.cells, out = [];
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    const errors = [];
    for (const o of c.outputs.toJSON()) {
      if (o.output_type === 'error') errors.push(o.ename + ': ' + o.evalue);
      if (o.output_type === 'stream' && o.name === 'stderr' && /Traceback/.test(o.text)) errors.push(o.text.slice(-500));
    }
    out.push({index: i, count: c.executionCount, errors});
  }
  return out;
}"""

# What a widget cell shows, without the controls themselves: pictures and the text of its outputs.
_JS_VIEW = """(index) => {
  const nb = window.jupyterapp.shell.currentWidget;
  const node = nb.content.widgets[index].node;
  const area = node.querySelector('.jp-Cell-outputWrapper') || node;
  const images = [...area.querySelectorAll('img')].map(i => i.src.length + ':' + i.src.slice(-200));
  const texts = [...area.querySelectorAll('.jp-RenderedText, .jp-RenderedHTMLCommon, .jp-RenderedLatex')]
      .map(t => t.innerText.trim()).filter(t => t);
  return {images, text: texts.join('\\n')};
}"""


def run_chapter(page, base: str, token: str, notebook: str, shots: Path, *, run_cells: bool = True,
                move_sliders: bool = True, run_timeout: float = 600) -> ChapterRun:
    """Open ``notebook`` (a path relative to the course root), run every cell, record errors, and move every
    enabled slider of every widget, recording whether the picture or text around it changed."""
    result = ChapterRun(notebook)
    t0 = time.monotonic()
    shots.mkdir(parents=True, exist_ok=True)
    stem = Path(notebook).stem
    page.goto(f"{base}/lab/tree/{notebook}?reset&token={token}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.content"
                           " && window.jupyterapp.shell.currentWidget.content.widgets.length > 0",
                           timeout=60_000)
    page.evaluate("async () => { const nb = window.jupyterapp.shell.currentWidget;"
                  " await nb.context.ready; await nb.sessionContext.ready; }")
    if run_cells:
        # run-all resolves when the last cell is done (or after the first error); a cell that hangs ends the
        # wait after ``run_timeout`` seconds instead of hanging the test
        page.evaluate("() => { window.__miniparDone = false; window.jupyterapp.commands"
                      ".execute('notebook:run-all-cells').finally(() => { window.__miniparDone = true; }); }")
        page.wait_for_function("() => window.__miniparDone === true", timeout=run_timeout * 1000, polling=500)
        page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.session"
                               ".kernel.status === 'idle'", timeout=60_000)
    result.cells = page.evaluate(_JS_CELLS)
    page.screenshot(path=str(shots / f"{stem}_after_run.png"), full_page=True)
    result.screenshots.append(shots / f"{stem}_after_run.png")
    result.widget_cells = page.evaluate("""() => {
        const nb = window.jupyterapp.shell.currentWidget;
        return nb.content.widgets.map((w, i) => w.node.querySelector('.jupyter-widgets') ? i : -1)
                                 .filter(i => i >= 0); }""")
    for index in result.widget_cells:
        page.evaluate("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                      ".setAttribute('data-minipar-cell', String(i))", index)
        locator = page.locator(f"[data-minipar-cell='{index}']")
        locator.scroll_into_view_if_needed()
        view, deadline = page.evaluate(_JS_VIEW, index), time.monotonic() + 45
        while not (view["images"] or view["text"]) and time.monotonic() < deadline:  # still rendering
            time.sleep(0.25)
            view = page.evaluate(_JS_VIEW, index)
        result.first_views[index] = view
        shot = shots / f"{stem}_cell{index}_first_view.png"
        locator.screenshot(path=str(shot))
        result.screenshots.append(shot)
        if not move_sliders:
            continue
        sliders = locator.locator(".widget-slider:not(.mod-disabled)")
        for k in range(sliders.count()):
            slider = sliders.nth(k)
            label = slider.locator(".widget-label").inner_text().strip() or f"slider {k}"
            if slider.locator(".noUi-target[disabled]").count():
                continue
            before = page.evaluate(_JS_VIEW, index)
            handle = slider.locator(".noUi-handle").first
            handle.focus()
            at_max = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
            handle.press("ArrowLeft" if at_max else "ArrowRight")
            after, deadline = before, time.monotonic() + 60   # a slow machine redraws slowly
            while after == before and time.monotonic() < deadline:
                time.sleep(0.25)
                after = page.evaluate(_JS_VIEW, index)
            time.sleep(0.5)  # let a picture finish replacing itself before the next move or screenshot
            after = page.evaluate(_JS_VIEW, index)
            result.moves.append(SliderMove(index, label, json.dumps(before)[:300], json.dumps(after)[:300],
                                           after != before))
            shot = shots / f"{stem}_cell{index}_{re.sub(r'[^A-Za-z0-9]+', '_', label)}.png"
            locator.screenshot(path=str(shot))
            result.screenshots.append(shot)
    result.seconds = time.monotonic() - t0
    return result


@contextlib.contextmanager
def browser(chromium: str):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            page = b.new_page(viewport={"width": 1400, "height": 1000})
            yield page
        finally:
            b.close()


if __name__ == "__main__":
    chromium = find_chromium()
    if chromium is None:
        sys.exit(how_to_set_up())
    notebooks = sys.argv[1:] or ["notebooks/04_pipeline_parallelism.ipynb"]
    with jupyterlab([ROOT / "notebooks", ROOT / "figures"]) as (base, token, root), browser(chromium) as page:
        for nb in notebooks:
            r = run_chapter(page, base, token, nb, ARTIFACTS)
            print(nb, f"{r.seconds:.0f} s", "errors:", r.errors(), "widget cells:", r.widget_cells)
            for i, v in r.first_views.items():
                print("  first view of cell", i, "images:", len(v["images"]), "text:", v["text"][:200])
            for m in r.moves:
                print("  ", m.cell, m.label, "changed" if m.changed else "NO CHANGE")
