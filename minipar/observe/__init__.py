"""The measurement wing: how a run is observed, traced and timed — low in the house, importing no strategy,
no planner and no course code.

* :mod:`~minipar.observe.wire` — bytes the process really wrote to its sockets (the kernel's counter);
  :mod:`~minipar.observe.wirecut` — run a program with the wire cut (collectives answered locally).
* :mod:`~minipar.observe.trace` — the trace format (compute segments, calls, waits, marks) and the tracer;
  :mod:`~minipar.observe.launch_trace` — every rank of a launch traced, no strategy changed.
* :mod:`~minipar.observe.cluster` — declared clusters, their links, and the α-β cost of one collective.
* :mod:`~minipar.observe.replay` — a trace played on a declared cluster; :mod:`~minipar.observe.fidelity` —
  links fitted to this machine; :mod:`~minipar.observe.intervals` — the interval algebra of a timeline.
"""
