import os

import pytest


def child_pids() -> list:
    """Live child processes of this process (Linux), zombies excluded."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().split(")")[-1].split()[0] == "Z"
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                # multiprocessing's resource tracker (started by the spawn test) lives as long as we do
                tracker = b"resource_tracker" in f.read()
            if not zombie and not tracker:
                alive.append(pid)
        except OSError:
            pass
    return alive


@pytest.fixture
def one_thread():
    """Bit-exact comparisons need a fixed reduction order: one intra-op thread, as every rank uses."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_leftover_processes():
    yield
    import time
    deadline = time.time() + 5
    while child_pids() and time.time() < deadline:
        time.sleep(0.05)
    assert child_pids() == [], f"processes left behind: {child_pids()}"


# The modules that take most CPU in make test's parallel tests (CPU-seconds measured 2026-11-30 on 2 cores, after
# that day's cuts: test_train_command ~300, test_course ~95, test_parallel5d_16 ~90, test_exercises ~84, ch08's
# torch_side ~80, ...). make test hands whole modules to its two workers (--dist loadscope) in collection order
# (--no-loadscope-reorder); xdist's own order, most tests first, left the few-test, long modules for last, with
# one worker idle at the end. Heaviest first, then the rest by test count, as xdist would.
HEAVY_FIRST = ("tests/test_train_command.py", "tests/test_course.py", "tests/test_parallel5d_16.py",
               "tests/test_exercises.py", "minipar/course/ch08_hybrid_parallelism/test_torch_side.py",
               "tests/test_parallel5d_moe.py", "minipar/course/ch09b_five_dimensions_and_moe/test_chapter.py",
               "tests/test_checkpoint.py", "tests/test_parallel3d.py", "tests/test_parallel5d.py",
               "tests/test_pipeline_runtime.py", "tests/test_launch.py",
               "minipar/course/ch04_pipeline_parallelism/test_tour.py",
               "minipar/course/ch04b_zero_bubble_and_v_schedules/test_tour.py")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (make test): the cells of one notebook share a kernel, so nbval's items of a notebook
    go to one worker together; and the modules are ordered heaviest first (HEAVY_FIRST)."""
    for item in items:
        path = str(getattr(item, "path", "") or "")
        if path.endswith(".ipynb"):
            item.add_marker(pytest.mark.xdist_group(name=path))
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    module = {id(item): item.nodeid.split("::")[0] for item in items}
    count = {}
    for name in module.values():
        count[name] = count.get(name, 0) + 1
    items.sort(key=lambda item: (HEAVY_FIRST.index(module[id(item)]) if module[id(item)] in HEAVY_FIRST
                                 else len(HEAVY_FIRST), -count[module[id(item)]], module[id(item)]))


def start_kernel_retrying(start, tries: int = 3):
    """``start`` (nbval's ``start_new_kernel``), tried up to ``tries`` times. Jupyter picks a kernel's ports by
    binding port 0 and letting go, and the kernel binds them a second later: a socket opened in between (these
    tests open gloo connections all the time, each on an ephemeral port) can take one, and the kernel dies
    ("Kernel died before replying to kernel_info"; jupyter_client issue #276, the port race). Seen once in a
    make test run: all five cells of a solution notebook errored. nbval starts a notebook's kernel once; a fresh
    try gets a fresh KernelManager, so fresh ports."""
    def retrying(*args, **kwargs):
        for attempt in range(1, tries + 1):
            try:
                return start(*args, **kwargs)
            except RuntimeError:
                if attempt == tries:
                    raise
    return retrying


def pytest_configure(config):
    try:
        import nbval.kernel
    except ImportError:
        return
    if not getattr(nbval.kernel.start_new_kernel, "retrying", False):
        nbval.kernel.start_new_kernel = start_kernel_retrying(nbval.kernel.start_new_kernel)
        nbval.kernel.start_new_kernel.retrying = True


@pytest.fixture(scope="session")
def tour_row(tmp_path_factory):
    """A tour row (``python -m minipar tour``'s name) run once per test session and shared: a chapter's tour
    test checks the row (equal to one device, its bytes, its memory) and appendix A's cost model is compared
    with the same run. Under pytest-xdist the workers share it through a file in the session's temporary
    folder (the row pickled; a lock per row, so a worker that needs a row another is running waits for it)."""
    import fcntl
    import pickle
    import re
    from minipar.course.tour import strategies
    runs = {name: run for _, name, run in strategies()}
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    done = {}

    def row(name: str):
        if name in done:
            return done[name]
        if shared is None:
            done[name] = runs[name]()
            return done[name]
        path = shared / ("tour-row-" + re.sub(r"[^A-Za-z0-9]+", "-", name) + ".pickle")
        with open(f"{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                path.write_bytes(pickle.dumps(runs[name]()))
            done[name] = pickle.loads(path.read_bytes())
        return done[name]
    return row
