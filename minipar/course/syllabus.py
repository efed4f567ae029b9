"""What each chapter is, in one place: its title, a one-line summary, its route (core or elective), minutes to
read and seconds to run. The README's chapter table and routes, the site's chapter map and each chapter's
**Time.** line are written from this table (``tools/syllabus.py``) or checked against it (``tests/test_course.py``,
``tests/test_site.py``).

Minutes to read are estimates, not measurements: the chapter's markdown words at about 200 words a minute plus
5 minutes for each exercise stub (a ``# YOUR CODE HERE`` cell of ``exercises/NN_topic.ipynb``), rounded to 5
(``python tools/syllabus.py --estimate`` prints both terms). A chapter may be split: its first sections on the
core route, the rest an elective, each half estimated from its own sections' words.

Seconds to run are what the site build measured, one chapter at a time on two cores (``make site`` writes them
to ``build/site/manifest.json``). These are the builds of 2026-11-29 to 2026-12-01 on two cores of CI's kind, rounded
to the second. Machines of that kind differ in speed (a quiet full build took 472 s on one, 268 s on another); a
faster one runs every chapter faster, though not all alike (a paced chapter's slots are sleeps). The site test
divides each chapter's seconds by the build's :func:`machine_speed` (the median over the chapters of built / stated
seconds) before it holds them within ±20 % of the number here, or 2 s: on any machine the numbers are held to each
other. Their scale is the slower machine's, whose make test took as long as CI's last runs.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

__all__ = ["About", "ABOUT", "about", "machine_speed", "SPEED_CHAPTERS", "route_minutes", "hours", "time_sentence", "TIME_SENTENCE",
           "readme_tables", "with_readme_tables", "with_time_sentence", "opening_problems"]


@dataclass(frozen=True)
class About:
    title: str                 # the notebook's heading after "NN · "
    summary: str               # one line: what the chapter does
    core_minutes: int          # minutes on the core route (0: an elective chapter)
    elective_minutes: int      # minutes outside it (0: a core chapter)
    run_seconds: int           # the site build's seconds for Run All, one chapter at a time on two cores
    core_sections: str = ""    # a split chapter: which sections are core ("§1–8"),
    elective_sections: str = ""  # and which are an elective ("§9")

    @property
    def minutes(self) -> int:
        return self.core_minutes + self.elective_minutes

    @property
    def short_title(self) -> str:
        """The title before its colon: 'Long sequences', 'Hybrid parallelism'."""
        return self.title.split(":")[0].strip()

    @property
    def route(self) -> str:
        if self.core_minutes and self.elective_minutes:
            return f"core {self.core_sections}, elective {self.elective_sections}"
        return "core" if self.core_minutes else "elective"


ABOUT = {
    "00": About(  # 2890 words (14 min) + 6 exercise stubs
        title="Setup and collective communication",
        summary="Why one device is not enough; ranks, torchrun; every collective live; ring all-reduce.",
        core_minutes=50, elective_minutes=0, run_seconds=27),
    "01": About(  # 2032 words (10 min) + 5 exercise stubs
        title="Splitting one matmul",
        summary="One matmul split three ways on 2 and 4 ranks; the collective each needs, bytes measured.",
        core_minutes=40, elective_minutes=0, run_seconds=15),
    "02": About(  # 2732 words (14 min) + 5 exercise stubs
        title="Data parallelism: DP → parameter server → DDP",
        summary="DataParallel, a parameter server and DDP from scratch; buckets, no_sync, the sampler.",
        core_minutes=40, elective_minutes=0, run_seconds=26),
    "03": About(  # 2534 words (13 min) + 4 exercise stubs
        title="Sharded data parallelism: ZeRO-1/2/3 → FSDP",
        summary="ZeRO-1/2/3 run live (ZeRO-3 is FSDP); memory and bytes per rank beside the paper's formulas.",
        core_minutes=35, elective_minutes=0, run_seconds=29),
    "03b": About(  # 2195 words (11 min) + 3 exercise stubs
        title="ZeRO and FSDP in depth: FSDP designs and modes, ZeRO in a pipeline, offload, Muon, prefetch modelled",
        summary="FSDP1 vs FSDP2, FSDP's modes as ZeRO variants, ZeRO in a pipeline, offload, Muon, prefetch modelled.",
        core_minutes=0, elective_minutes=25, run_seconds=19),
    "04": About(  # 4098 words (20 min) + 4 exercise stubs
        title="Pipeline parallelism: naive → GPipe → 1F1B → interleaved (+ PipeDream, optional)",
        summary="Schedules as data, run on 4 ranks equal to one device; the bubble simulated and measured.",
        core_minutes=40, elective_minutes=0, run_seconds=27),
    "04b": About(  # 2294 words (11 min) + 4 exercise stubs
        title="Zero bubble and the V: ZB-H1, ZB-V, DualPipeV, and a checker for deadlocks",
        summary="The B/W split, the V schedules (ZB-V, DualPipeV), a checker that proves no deadlock.",
        core_minutes=0, elective_minutes=35, run_seconds=29),
    "05": About(  # 3324 words (17 min) + 4 exercise stubs
        title="Tensor parallelism (1D, Megatron)",
        summary="Column/row-parallel layers, f and g, heads, vocab-parallel loss; a TP GPT equal to one device.",
        core_minutes=35, elective_minutes=0, run_seconds=24),
    "06": About(  # 2019 words (10 min) + 4 exercise stubs
        title="Sequence parallelism (Megatron)",
        summary="LayerNorm and dropout on sequence shards, the same bytes; activation memory measured.",
        core_minutes=35, elective_minutes=0, run_seconds=16),
    "06b": About(  # 3421 words (17 min) + 4 exercise stubs
        title="Long sequences: ring attention, zig-zag, Ulysses, ring self-attention",
        summary="FlashAttention-2 in PyTorch; ring attention, zig-zag, Ulysses, each equal to dense.",
        core_minutes=0, elective_minutes=35, run_seconds=17),
    "07": About(  # 2653 words (13 min) + 3 exercise stubs
        title="Multi-dimensional tensor parallelism: 2D (SUMMA), 2.5D (Tesseract), 3D — measured against 1D",
        summary="Weights and activations split on grids of ranks; memory and bytes per rank against 1D.",
        core_minutes=0, elective_minutes=30, run_seconds=19),
    "08": About(  # 2487 words (12 min) + 4 exercise stubs (3D; the 5D half moved to 09b)
        title="Hybrid parallelism: data × pipeline × tensor (+ ZeRO), on a device mesh",
        summary="DP × PP × TP on 8 ranks equal to one device; ZeRO in a pipeline; a checkpoint that reshards.",
        core_minutes=35, elective_minutes=0, run_seconds=24),
    "09": About(  # 4654 words (23 min) + 4 exercise stubs
        title="Mixture of experts and expert parallelism",
        summary="Routers, capacity, balancing losses; experts over ranks by all-to-all, equal to one device.",
        core_minutes=0, elective_minutes=45, run_seconds=19),
    "09b": About(  # 2887 words (14 min) + 2 exercise stubs (split from 08)
        title="Five dimensions and MoE on one mesh: dp × pp × cp × tp, with ep folded in",
        summary="A layout at scale; dp × pp × cp × tp with experts folded in, on 16 ranks equal to one device.",
        core_minutes=0, elective_minutes=25, run_seconds=14),
    "10": About(  # 2718 words (14 min) + 4 exercise stubs
        title="Mixed precision: FP32 → FP16 → BF16",
        summary="16-bit floats bit by bit, overflow and underflow, loss scaling, FP32 master weights.",
        core_minutes=40, elective_minutes=0, run_seconds=23),
    "10b": About(  # 2173 words (11 min) + 4 exercise stubs
        title="FP8 training: scales, granularity, accumulation",
        summary="FP8 formats and their scales, delayed vs current scaling, accumulation; FP8 vs BF16.",
        core_minutes=0, elective_minutes=30, run_seconds=19),
    "11": About(  # 1741 words (9 min) + 3 exercise stubs
        title="Recomputation and memory",
        summary="Where a step's memory goes; full and selective recomputation, memory and FLOPs measured.",
        core_minutes=30, elective_minutes=0, run_seconds=16),
    "12": About(  # 3601 words (18 min) + 4 exercise stubs (the fidelity study moved to A, the toolbox to 12b)
        title="Choosing a strategy: a cost model, a planner and a published decision guide",
        summary="A cost model and planner checked against papers and published runs; the decision guide as rules.",
        core_minutes=40, elective_minutes=0, run_seconds=23),
    "12b": About(  # 1428 words (7 min) + 2 exercise stubs (split from 12: its Deeper §§6–8, 10)
        title="The planner's toolbox: layouts by hand, a calculator, long sequences, automatic parallelism",
        summary="Layouts by hand and a published one priced; a calculator; memory over s; FlexFlow and Alpa.",
        core_minutes=0, elective_minutes=15, run_seconds=12),
    "13": About(  # 3991 words (20 min) + 6 exercise stubs
        title="When it goes wrong: hangs, desyncs, stragglers, silent wrong gradients, seeds and NaNs",
        summary="Planted hangs, desyncs, stragglers, wrong gradients and NaNs, each found with a tool.",
        core_minutes=50, elective_minutes=0, run_seconds=25),
    "14": About(  # 2304 words (12 min) + 4 exercise stubs
        title="Shrinking communication: bytes against loss",
        summary="PowerSGD, DiLoCo, ZeRO++: bytes sent against held-out loss, each checked on its own rule.",
        core_minutes=0, elective_minutes=35, run_seconds=21),
    "15": About(  # 1834 words (9 min) + 5 exercise stubs
        title="When a device dies: failure rates, asynchronous checkpoints, silent data corruption",
        summary="Save intervals from failure rates; async saves killed mid-write; bit flips; a lost replica healed.",
        core_minutes=0, elective_minutes=35, run_seconds=16),
    "A": About(  # 4433 words (22 min) + 2 exercise stubs: chapter 12's old §8–10 and the instruments
        title="How minipar measures: traces, replays, wire counting, spreads, calibration, recordings",
        summary="Communication log and wire, memory, spreads and ties, traces, replays, calibration, records.",
        core_minutes=0, elective_minutes=35, run_seconds=11),
}


def about(number: str) -> About:
    """The facts of chapter ``number`` ("03", "06b")."""
    if number not in ABOUT:
        raise KeyError(f"chapter {number!r} has no entry in minipar/course/syllabus.py ABOUT (title, summary, "
                       "route, minutes, seconds): add one")
    return ABOUT[number]


def route_minutes(table: dict = ABOUT) -> tuple[int, int]:
    """(minutes on the core route, minutes of all electives) over the chapters."""
    return sum(a.core_minutes for a in table.values()), sum(a.elective_minutes for a in table.values())


def hours(minutes: int) -> str:
    """200 -> '3 h 20 min'."""
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes % 60 else f"{minutes // 60} h"


SPEED_CHAPTERS = 8     # a build of fewer chapters is compared as it is: a median of few moves with one chapter


def machine_speed(took: dict, table: dict = ABOUT) -> float | None:
    """This machine's seconds against the syllabus's: the median over the built chapters of took / stated
    (``took``: {number: seconds}, one chapter at a time). 0.5: it runs the chapters in half the stated time.
    None with fewer than :data:`SPEED_CHAPTERS` chapters: then the stated seconds are compared as they are."""
    ratios = [seconds / table[number].run_seconds for number, seconds in took.items()
              if seconds is not None and number in table]
    return statistics.median(ratios) if len(ratios) >= SPEED_CHAPTERS else None


def time_sentence(a: About) -> str:
    """The chapter's **Time.** sentence, as its opening cell states it."""
    if a.core_minutes and a.elective_minutes:
        route = (f" — {a.core_sections} ({a.core_minutes} minutes) on the core route, {a.elective_sections} "
                 f"({a.elective_minutes} minutes) an elective")
    else:
        route = " (core route)" if a.core_minutes else " (an elective)"
    return (f"**Time.** About {a.minutes} minutes to read and do the exercises{route}; the cells run in about "
            f"{a.run_seconds} s on two cores.")


TIME_SENTENCE = re.compile(r"\*\*Time\.\*\* About \d+ minutes to read and do the exercises[^\n]*? on two cores\.")




def readme_tables(stems: dict, table: dict = ABOUT) -> str:
    """The README's generated block: the routes' hours and the chapter table. ``stems``: {number: NN_topic}."""
    core, elective = route_minutes(table)
    core_list = ", ".join(n + (f" {a.core_sections}" if a.elective_minutes else "")
                          for n, a in table.items() if a.core_minutes)
    elective_list = ", ".join(n + (f" {a.elective_sections}" if a.core_minutes else "")
                              for n, a in table.items() if a.elective_minutes)
    lines = [f"- **Core path**, about {hours(core)}: {core_list}.",
             f"- **Electives**, about {hours(elective)} in all: {elective_list}.",
             "",
             "| # | chapter | what it does | route | minutes | run |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {n} | [{a.short_title}](notebooks/{stems[n]}.ipynb) | {a.summary} | {a.route} | {a.minutes} | "
              f"{a.run_seconds} s |" for n, a in table.items()]
    return "\n".join(lines)


BEGIN = "<!-- chapters: written by `python tools/syllabus.py` from minipar/course/syllabus.py; do not edit -->"
END = "<!-- end of chapters -->"


def with_readme_tables(readme: str, stems: dict, table: dict = ABOUT) -> str:
    """The README with its generated block (between BEGIN and END) written anew."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"the README has no generated block: put {BEGIN!r} and {END!r} where it goes")
    head, rest = readme.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{readme_tables(stems, table)}\n{END}{rest.split(END, 1)[1]}"


def with_time_sentence(opening: str, a: About) -> str:
    """A chapter's opening cell with its **Time.** sentence written from ``a`` (the rest kept as it is)."""
    if not TIME_SENTENCE.search(opening):
        raise ValueError("the opening cell has no '**Time.** About N minutes to read and do the exercises ... "
                         "on two cores.' sentence to rewrite")
    return TIME_SENTENCE.sub(lambda _: time_sentence(a), opening, count=1)


def opening_problems(number: str, opening: str, table: dict = ABOUT) -> list[str]:
    """Where a chapter's opening cell disagrees with its entry: its heading, or its **Time.** sentence."""
    a = table[number]
    found = []
    heading = opening.splitlines()[0] if opening else ""
    if heading != f"# {number} · {a.title}":
        found.append(f"{number}: heading {heading!r}, the syllabus says '# {number} · {a.title}'")
    if time_sentence(a) not in opening:
        stated = TIME_SENTENCE.search(opening)
        found.append(f"{number}: states {stated.group(0) if stated else 'no Time sentence'!r}, the syllabus "
                     f"says {time_sentence(a)!r}")
    return found
