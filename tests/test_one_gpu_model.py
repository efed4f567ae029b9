"""One model of GPU time (issue 50): every GPU second in the library, the chapters and the tests comes from a
device card (:mod:`minipar.machine.device`, clusters from :func:`minipar.machine.cluster.gpu_cluster`), never
from a flat fraction of a GPU's peak. The retired flat-efficiency clusters are not called anywhere, and no
:class:`~minipar.machine.cluster.Cluster` is built by hand with a GPU's peak and no device card (a CPU rank's
FLOP/s, measured here or a test's small round number, may stand without one: :func:`this_machine`)."""
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHERE = ("minipar", "notebooks", "tests", "exercises", "solutions")
RETIRED = tuple(name + "(" for name in ("dgx_a100", "h100_nodes", "pcie_node"))   # spelled apart: not found here
GPU_PEAK = 1e13          # FLOP/s: above any CPU rank here (~1e10-1e11), below every GPU card (TITAN RTX: 1.3e14)


def _sources():
    """(path, Python source) of every .py file and every notebook's code cells under WHERE."""
    for top in WHERE:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, path.read_text()
        for path in sorted((ROOT / top).rglob("*.ipynb")):
            if ".ipynb_checkpoints" in path.parts:
                continue
            cells = json.loads(path.read_text())["cells"]
            code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
            yield path, "\n".join(line for cell in code for line in cell.splitlines()
                                  if not line.lstrip().startswith(("%", "!")))


def _flat_clusters(tree):
    """Line numbers of ``Cluster(...)`` calls with a constant peak (4th positional or ``peak_flops=``) of at
    least GPU_PEAK and no ``device=``."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Cluster"):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        peak = node.args[3] if len(node.args) > 3 else keywords.get("peak_flops")
        if "device" in keywords or len(node.args) > 10:
            continue
        if isinstance(peak, ast.Constant) and isinstance(peak.value, (int, float)) and peak.value >= GPU_PEAK:
            yield node.lineno


def test_no_flat_efficiency_gpu_cluster_anywhere():
    found = []
    for path, text in _sources():
        where = path.relative_to(ROOT)
        if path.name != Path(__file__).name:
            found += [f"{where}: calls {name}" for name in RETIRED if name in text]
        found += [f"{where}:{line}: Cluster(...) with a GPU peak and no device card"
                  for line in _flat_clusters(ast.parse(text))]
    assert not found, "GPU time must come from a device card (gpu_cluster, a100_cluster, ...):\n" + "\n".join(found)


def test_the_retired_clusters_are_gone():
    from minipar.machine import cluster
    assert not {"dgx_a100", "h100_nodes", "pcie_node"} & (set(dir(cluster)) | set(cluster.__all__))
    assert "this_machine" in cluster.__all__        # a CPU measured here: its FLOP/s are what a rank reaches
