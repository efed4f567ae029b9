"""Chapter 15 in the tour: fault-tolerant replica groups (:mod:`minipar.fault`) — a run that loses a replica
mid-training and goes on, and the restarted replica's healing from a live peer.

The rows, their run and their byte columns are the library's (:func:`minipar.fault.tour_rows.fault_tour_rows`:
4 replicas of 1 rank, float64, replica 1 SIGKILLed inside step 1, compared with one device over the committed
rows); the library never imports the course, so this file only wraps each row's fields in a :class:`TourRow`.
"""
from __future__ import annotations

from minipar.course.tour import TourRow
from minipar.fault.tour_rows import fault_tour_rows


def _row(run) -> TourRow:
    return TourRow(**run())


STRATEGIES = [(name, lambda run=run: _row(run)) for name, run in fault_tour_rows()]
