"""Chapter 03b, ZeRO and FSDP in depth (an elective): its notebook runs chapter 03's code
(:mod:`minipar.course.ch03_zero_and_fsdp`), so this package holds nothing of its own."""
