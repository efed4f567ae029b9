"""minipar: every way of training one model on many devices, small enough to read, verified against one
device. See the README for the course that runs on it."""
from .invariant_mode import invariant      # minipar.invariant(): the context manager (its module: invariant_mode)
from .launcher import DEFAULT_TIMEOUT, LaunchTimeout, RankError, launch
from .mesh import Mesh, RankMesh

__version__ = "0.1.0"
__all__ = ["invariant", "launch", "RankError", "LaunchTimeout", "DEFAULT_TIMEOUT", "Mesh", "RankMesh"]
