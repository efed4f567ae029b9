"""Where chapter 09b's recorded 16-rank launches live, and what a record says about how it was made."""
from __future__ import annotations

import datetime
import os
import platform
import time

import torch

from minipar.course import ROOT

__all__ = ["FIVE_D_RECORD", "provenance"]

FIVE_D_RECORD = ROOT / "figures" / "data" / "09b_five_d.json"      # :func:`.five_d.record_chapter`


def provenance(started: float, load_before: float) -> dict:
    """UTC start and end, cores, Python and torch versions, the 1-minute load before and after."""
    stamp = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")  # noqa: E731
    return {"started": stamp(started), "finished": stamp(time.time()), "cores": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
            "load_before": round(load_before, 1), "load_after": round(os.getloadavg()[0], 1)}
