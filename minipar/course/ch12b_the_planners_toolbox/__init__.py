"""Chapter 12b · The planner's toolbox: layouts by hand, a calculator, long sequences, automatic parallelism.

The notebook's code is chapter 12's (``minipar.course.ch12_choosing_a_strategy``: its report, figures and claims);
this folder names the elective so that the runners and the tests find it."""
