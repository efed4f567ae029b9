"""Fault-tolerant data parallelism over replica groups: a run that survives a dead device without a restart.

R replica groups, each any layout the hybrid trainer trains (:class:`minipar.hybrid.parallel3d.Trainer3D`), are
data-parallel with each other. Every step a **quorum** is decided by a lighthouse that lives in the supervising
process, not in any replica (so any one replica may die): the live replicas register, those present within a
timeout form the quorum, and the cross-replica gradient average runs over a process group built for that quorum
only (``ProcessGroupGloo(PrefixStore(f"q{id}/l{local rank}", store), index, size)``, no ``new_group``: how
torchft reconfigures). A step is **committed** only when every member voted that it finished it; an abort
applies nothing and the step is retried with the next quorum. A replica that (re)joins **heals** from a live
peer: parameters and optimizer state streamed over the quorum's group, never read from disk.

* :mod:`.lighthouse` — the quorum and commit decisions, and the run's event log (supervisor side);
* :mod:`.quorum` — a rank's side of it: registering, the quorum's group, the vote, the commit gate;
* :mod:`.heal` — a replica's state over the wire;
* :mod:`.replica` — what each rank of a replica runs;
* :mod:`.supervisor` — starting, watching, killing and restarting replicas;
* :mod:`.replicas` — ``validate`` / ``run``, the one-device reference over the committed batches, the events;
* :mod:`.flags`, :mod:`.command` — ``python -m minipar train --replicas R``;
* :mod:`.tour_rows` — the tour's rows for chapter 15.
"""
