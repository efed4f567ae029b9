"""The pipeline timeline is recorded beside the runtime, from its seams (minipar/pipeline/timeline.py)."""
import inspect
from types import SimpleNamespace

from minipar.pipeline import paced, runtime
from minipar.pipeline.timeline import TimedRank, measured_idle_fraction, step_rows, timed


class ScriptedRank:
    """A rank that plays one action through the runtime's seams on a clock it sets itself (no processes):
    the F of stage 1, micro-batch 0, begins at t = 1, waits for its input until 2, computes, sends at 3
    (the post takes 0.5 s) and is done at 4."""

    def __init__(self):
        self.now, self.step_index = 0.0, 0

    def clock(self):
        return self.now

    def begin_action(self, action):
        self.action, self.input_arrived = action, 0.0

    def wait_for(self, buf, src, tag, stage, microbatch):
        self.now = self.input_arrived = 2.0

    def post(self, t, dst, tag, to_stage, microbatch):
        self.now += 0.5

    def action_done(self, kind):
        pass

    def run(self, inputs, targets, step_index=0):
        self.step_index = step_index
        self.now = 1.0
        self.begin_action(SimpleNamespace(kind="F", stage=1, microbatch=0))
        self.wait_for(None, 0, 0, 1, 0)
        self.now = 3.0
        self.post(None, 2, 0, 2, 0)
        self.now = 4.0
        self.action_done("F")


def test_the_timeline_is_fed_by_the_seams_only():
    rank = timed(ScriptedRank)()
    rank.run([], [], 5, tracker=SimpleNamespace(current=123))
    assert rank.timeline == [(5, "wait", 1, 0, 1.0, 2.0),      # blocked in the receive
                             (5, "send", 2, 0, 3.0, 3.5),      # posting the activation
                             (5, "F", 1, 0, 2.0, 4.0)]         # the span starts when the input arrived
    assert rank.memory == [(5, 4.0, 123)]
    untracked = timed(ScriptedRank)()
    untracked.run([], [], 0)
    assert untracked.memory == [] and len(untracked.timeline) == 3


def test_readers_take_the_rows():
    ranks = [timed(ScriptedRank)() for _ in range(2)]
    for r in ranks:
        r.run([], [], 0)
    assert step_rows(ranks) == [(0, "F", 1, 0, 0.0, 2.0), (1, "F", 1, 0, 0.0, 2.0)]
    assert measured_idle_fraction(ranks) == 0.0


def test_timed_is_one_class_per_rank_class_and_paced_goes_on_top():
    assert timed(ScriptedRank) is timed(ScriptedRank) is timed(timed(ScriptedRank))
    both = paced.paced(timed(runtime.PipelineRank))
    assert both.__mro__[1:5] == (paced.PacedRank, timed(runtime.PipelineRank), TimedRank, runtime.PipelineRank)


def test_the_runtime_records_nothing():
    """runtime.py is the schedule's executor: no timeline, memory rows or tracker in PipelineRank."""
    source = inspect.getsource(runtime.PipelineRank)
    assert not any(word in source for word in ("timeline", "memory", "tracker"))
    assert not hasattr(runtime.PipelineRank, "timeline")
