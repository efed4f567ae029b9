"""The machine model: a declared machine, and a program played on it -- what the planner, the pipeline
simulator and the measurement wing's fits all price with. It observes nothing (it imports neither
:mod:`minipar.comm`'s hooks nor :mod:`minipar.observe`).

* :mod:`~minipar.machine.device` — declared GPUs (device cards), what one operator costs on them (roofline +
  launch floor), and operator rows as :class:`~minipar.machine.device.Op`; :mod:`~minipar.machine.gpu_measured`
  — the device model against one H100's measured runs (package data, ``data/gpu/``).
* :mod:`~minipar.machine.cluster` — the one table of links: declared clusters (from link cards), which link a
  group of ranks runs over (the mesh's node rule), and the α-β cost of one call (the traffic model
  :func:`minipar.comm.predicted_bytes_sent`).
* :mod:`~minipar.machine.trace` — the program a machine plays (compute segments, calls, waits, marks; pure
  data): recorded by :mod:`minipar.observe.tracer`, or built from a schedule (:mod:`minipar.pipeline.schedule_trace`).
* :mod:`~minipar.machine.replay` — a trace played on a declared cluster (:mod:`~minipar.machine.replay_result`:
  what it returns, :mod:`~minipar.machine.intervals`: the interval algebra of its timeline);
  :mod:`~minipar.machine.fidelity` — links fitted to calls a trace recorded.
"""
