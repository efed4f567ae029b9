"""Tools for when a distributed run goes wrong (chapter 13): a desync check before the hang
(:mod:`.desync`), stragglers from a trace (:mod:`.stragglers`), the first departure from one device
(:mod:`.first_departure`), the first tensor where two layouts part in any bit and the reduction whose order
made it (:mod:`.first_diff`), random streams across ranks (:mod:`.seeds`) and the first non-finite value
(:mod:`.nonfinite`); chapter 15's silent data corruption check (:mod:`.sdc`) and the checkpoint interval from
failure rates (:mod:`.checkpoint_interval`).
The flight recorder that names, after a hang, the first call the ranks' records disagree on is :mod:`minipar.flight`."""
