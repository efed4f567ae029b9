"""The measurement wing: how a run is observed, traced and timed — low in the house, importing no strategy,
no planner and no course code.

* :mod:`~minipar.comm_log` — the communication log (one record per :mod:`minipar.comm` call, ``recording()``,
  bytes per mesh dimension, messages); :mod:`~minipar.wire` — bytes the process really wrote to its
  sockets (the kernel's counter, one kept-open reader); :mod:`~minipar.observe.wirecut` — run a program with
  the wire cut (collectives answered locally).
* :mod:`~minipar.observe.trace` — the trace format (compute segments, calls, waits, marks; pure data);
  :mod:`~minipar.observe.tracer` — records one on a rank (a hook on :mod:`minipar.comm`'s calls);
  :mod:`~minipar.observe.launch_trace` — every rank of a launch traced (``traced_launch``,
  ``recording_launches``: a hook of the launcher), no strategy changed.
* :mod:`~minipar.observe.cluster` — the one table of links: declared clusters (from link cards), which link a
  group of ranks runs over (the mesh's node rule), and the α-β cost of one call — for the planner, the replay
  and the fits; :mod:`~minipar.observe.device` — declared GPUs (device cards) and what one operator costs on
  them (roofline + launch floor); :mod:`~minipar.observe.opcount` — the operators a program runs, counted.
* :mod:`~minipar.observe.replay` — a trace played on a declared cluster (:mod:`~minipar.observe.replay_result`:
  what it returns); :mod:`~minipar.observe.fidelity` —
  links fitted to this machine; :mod:`~minipar.observe.intervals` — the interval algebra of a timeline;
  :mod:`~minipar.observe.measure` — a strategy's steps traced and timed, this machine's links calibrated.
"""
