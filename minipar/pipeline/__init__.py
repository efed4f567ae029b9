"""Pipeline parallelism: schedules as data (:mod:`.actions`, :mod:`.schedules`), their one lowering into
messages (:mod:`.lowering`), a simulator (the replay engine fed a schedule-made trace), stages of the
reference models, the runtime that trains with a schedule over point-to-point messages, and PipeDream's
asynchronous variants."""
from .schedules import (SCHEDULES, Action, Schedule, bubble_formula, gpipe, interleaved, make_schedule, naive,
                        one_f_one_b, validate, zb_h1, zb_v, dualpipe_v)
from .simulate import Costs, ScheduleDeadlock, SimResult, simulate

__all__ = ["SCHEDULES", "Action", "Schedule", "bubble_formula", "gpipe", "interleaved", "make_schedule", "naive",
           "one_f_one_b", "validate", "zb_h1", "zb_v", "dualpipe_v", "Costs", "ScheduleDeadlock", "SimResult",
           "simulate"]
