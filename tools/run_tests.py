"""`make test`: every check of the project, in about 20 minutes on CI's two cores (9 on faster ones).

    .venv/bin/python tools/run_tests.py            # what `make test` runs (after tools/setup_browser.sh)

Three streams share the two cores, because none of them keeps both busy alone: the tests on two pytest workers (a
module's tests stay on one worker, so its fixtures are made once; each solution notebook runs there, then its
stubs, in one kernel: tests/test_exercises.py), the site build (every chapter executed, one after another in one
kernel, tools/notebook_client.SharedKernel: rank start-ups leave a core idle), and the browser test (JupyterLab in
headless Chromium: mostly waiting). When all three are done, the tests marked ``serial`` run alone (they signal
their own process, or time what this machine does), then the site test reads the build. Each stream's output goes
to ``build/test-logs/<stream>.log`` and is printed after the streams end, in a fixed order; the last lines are a
table of each stage's seconds and result.

The chapters' seconds in this build are not a learner's (the tests shared the cores): the manifest says so and
the site test skips its timing check; ``make site`` builds alone and checks each chapter's stated seconds.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "test-logs"
SITE = ROOT / "build" / "site"
TESTS = ["tests", "minipar/course", "--ignore=tests/browser", "--ignore=tests/test_site.py"]


def streams(python: str) -> dict:
    """The commands that run side by side: name -> argv."""
    return {
        "tests": [python, "-m", "pytest", "-q", "-n", "2", "--dist", "loadscope", "--no-loadscope-reorder",
                  "-m", "not serial", *TESTS,
                  "--durations=15"],                                      # the log names the slowest
        "site": [python, "tools/site.py", "--out", str(SITE), "--jobs", "1", "--beside-other-work", "--one-kernel"],
        "browser": [python, "-m", "pytest", "-q", "tests/browser"],
    }


def after(python: str) -> dict:
    """The commands that run alone, in order, once the streams are done."""
    return {
        "serial tests": [python, "-m", "pytest", "-q", "-m", "serial", *TESTS],
        "site test": [python, "-m", "pytest", "-q", "tests/test_site.py"],
    }


def run_side_by_side(commands: dict, env: dict) -> dict:
    """Start every command at once (each writing its log); wait for all. name -> (exit code, seconds)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    started, procs, files = time.monotonic(), {}, {}
    for name, argv in commands.items():
        files[name] = open(LOGS / f"{name.replace(' ', '-')}.log", "w")
        procs[name] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=files[name], stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
    done = {}
    try:
        while len(done) < len(procs):
            for name, proc in procs.items():
                if name not in done and proc.poll() is not None:
                    done[name] = (proc.returncode, time.monotonic() - started)
                    files[name].close()
            time.sleep(0.2)
    finally:                                    # interrupted: nothing left behind
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def show(name: str) -> None:
    path = LOGS / f"{name.replace(' ', '-')}.log"
    print(f"\n===== {name} ({path.relative_to(ROOT)}) =====", flush=True)
    print(path.read_text(errors="replace").rstrip(), flush=True)


def compile_sources(python: str, env: dict) -> None:
    """Byte-compile the project's own Python once, before anything starts. Every kernel, torchrun rank and
    command the tests start imports minipar; where PYTHONDONTWRITEBYTECODE is set (this project's sandboxes
    set it) each of them would compile it from source again: about 1 s of CPU a process on two slow cores,
    some 150 processes. The streams may write bytecode (pytest's rewritten test modules); __pycache__ is
    ignored by git."""
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([python, "-m", "compileall", "-q", "-j", "2", "minipar", "tests", "tools", "conftest.py"],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def one_thread(env: dict) -> dict:
    """``env`` with one intra-op thread (OMP_NUM_THREADS=1) for every process the streams start: pytest's workers,
    the chapters' kernels, JupyterLab's. Every rank runs on one thread already (minipar.launch); the processes
    that start them ran torch's default, one thread per core. With the three streams on two cores (load 10 to 30),
    an operator split over two threads waits for the second to get a core, and libgomp's waiting thread spins:
    measured under a load of 3 extra busy processes, tests/test_flash, test_models, test_gpu_script and
    test_mixed_precision took 45.5 CPU-s and 111 s with two threads, 18.4 CPU-s and 66 s with one (a TinyGPT
    training step 794 ms against 8.8 ms). The serial tests after the streams run alone and keep the default."""
    return dict(env, OMP_NUM_THREADS="1")


def main() -> int:
    python = sys.executable
    env = dict(os.environ, MINIPAR_SITE_DIR=str(SITE), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    compile_sources(python, env)
    results = run_side_by_side(streams(python), one_thread(env))
    for name in streams(python):
        show(name)
    for name, argv in after(python).items():
        if name == "site test" and results["site"][0] != 0:     # it would only say "no site there", 70 times
            (LOGS / "site-test.log").write_text("not run: the site build failed (its log is above)\n")
            results[name] = (None, 0.0)
            continue
        began = time.monotonic()
        results[name] = (run_side_by_side({name: argv}, env)[name][0], time.monotonic() - began)
        show(name)
    failed_stages = [name for name, (code, _) in results.items() if code not in (0, None)]
    for name in failed_stages:                  # last, so that a log's tail (all CI may show) says why
        print(f"\n===== why {name} failed: the end of {LOGS.name}/{name.replace(' ', '-')}.log =====")
        print("\n".join(tail(name, 25)))
    print("\nmake test, stage by stage (the first three side by side):")
    for name, (code, seconds) in results.items():
        said = "not run" if code is None else "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"  {name:13s} {seconds:7.1f} s  {said}")
    print(f"  {'in all':13s} {time.monotonic() - start:7.1f} s")
    passed, failed = counted()
    print(f"\npytest: {passed} passed, {failed} failed")    # every pytest run's closing line, added up
    return 1 if failed_stages else 0


def tail(name: str, lines: int) -> list:
    """The last ``lines`` non-blank lines of a stage's log, each cut to 300 characters."""
    text = (LOGS / f"{name.replace(' ', '-')}.log").read_text(errors="replace")
    return [line[:300] for line in text.splitlines() if line.strip()][-lines:]


def counted() -> tuple:
    """(passed, failed) summed over every pytest log's closing line ("3 failed, 2180 passed, 1 skipped in 590.1s";
    errors count as failed)."""
    summary = re.compile(r"\b\d+ (passed|failed|errors?)\b.* in [\d.]+s")
    passed = failed = 0
    for path in sorted(LOGS.glob("*.log")):
        closing = [line for line in path.read_text(errors="replace").splitlines() if summary.search(line)]
        if closing:
            passed += sum(int(n) for n in re.findall(r"(\d+) passed", closing[-1]))
            failed += sum(int(n) for n in re.findall(r"(\d+) (?:failed|errors?)\b", closing[-1]))
    return passed, failed

if __name__ == "__main__":
    sys.exit(main())
