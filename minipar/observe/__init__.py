"""The measurement wing: how a run is observed, traced and timed — above the ground floor and the machine
model, importing no strategy, no planner and no course code. Its instruments register through
:mod:`minipar.hooks` (the ground floor's one hook interface); nothing below imports this package.

* :mod:`~minipar.observe.tracer` — records a :mod:`minipar.machine.trace` on a rank (a hook on
  :mod:`minipar.comm`'s calls); :mod:`~minipar.observe.launch_trace` — every rank of a launch traced
  (``traced_launch``, ``recording_launches``: a launch hook), no strategy changed.
* :mod:`~minipar.observe.opcount` — the operators a program runs, counted at the dispatcher (priced by
  :mod:`minipar.machine.device`).
* :mod:`~minipar.observe.measure` — a strategy's steps traced and timed, this machine's links calibrated
  (fitted with :mod:`minipar.machine.fidelity`).
* :mod:`~minipar.observe.wirecut` — run a program with the wire cut (collectives answered locally).
* :mod:`~minipar.observe.paced_compute` — blocks held to fixed wall-clock slots (compute, then sleep), so a
  step shows what its communication overlaps, not CPU contention; configurations timed side by side.

The comm log (:mod:`minipar.comm_log`, ``comm.recording()``) and the wire counter (:mod:`minipar.wire`) are
instruments on the ground floor, beside the calls they count.
"""
