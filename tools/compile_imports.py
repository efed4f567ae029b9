"""Write the bytecode of what the course imports, once, when the virtual environment is made (the Makefile).

    .venv/bin/python tools/compile_imports.py

The Makefile installs with ``pip install --no-compile``: by default pip byte-compiles every file of every package
it installs, and most of torch's and JupyterLab's files are never imported here. Measured on a 2-core machine:
torch's install took 44.9 CPU-s with compiling and 13.6 without, the course's and tests' packages 70.0 and
44.3. What is imported still needs its bytecode, or every process that imports it compiles it again where
PYTHONDONTWRITEBYTECODE is set (this project's sandboxes set it; then no process writes any): so this script
imports every minipar module and the tools the course runs on (each process writes the bytecode of what it
imports, here forced on), about 15 CPU-s. A module imported later for the first time is compiled then, once.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

sys.dont_write_bytecode = False         # PYTHONDONTWRITEBYTECODE=1 sets it; this run exists to write bytecode

TOOLS = ["matplotlib.pyplot", "nbformat", "nbclient", "jupyter_client", "ipykernel.kernelapp", "ipywidgets",
         "jupyter_server.serverapp", "jupyterlab.labapp", "pytest", "xdist", "cloudpickle", "torch.distributed.run"]


def main() -> int:
    import minipar
    modules = [m.name for m in pkgutil.walk_packages(minipar.__path__, "minipar.")
               if not m.name.rsplit(".", 1)[-1].startswith(("test_", "__main__"))]
    for name in TOOLS + modules:
        try:
            importlib.import_module(name)
        except Exception as error:      # an optional tool missing: nothing to compile, nothing broken here
            print(f"compile_imports: {name} not imported ({type(error).__name__}: {error})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
