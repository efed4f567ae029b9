"""Chapter 03's timing helper: refuses bad input before launch; a short run gives both traces, replayable,
and a memory timeline that lands inside the watched step on the replay's time axis."""
import pytest

from minipar.check import gpt_recipe
from minipar.course.ch03_zero_and_fsdp import timing


def test_measure_refuses_too_few_steps_before_launch():
    with pytest.raises(ValueError, match="at least 3"):
        timing.measure(2, steps=2)


def test_prefetch_traces_and_the_memory_of_step_two():
    from minipar.machine.cluster import this_machine
    from minipar.machine.replay import replay
    m = timing.measure(2, steps=3)
    asyncs = {name: sum(c.async_ for c in t.ranks[0].comms() if c.op == "all_gather")
              for name, t in m["traces"].items()}
    assert asyncs["prefetch"] > 0 and asyncs["no prefetch"] == 0     # prefetch issues gathers before they are needed
    model = gpt_recipe(steps=1, **timing.STEP_RECIPE).model()
    assert m["param_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())   # not the gathers
    for name, t in m["traces"].items():
        res = replay(t, this_machine(m["alpha"], m["beta"], m["flops_here"], devices=2), compute_scale=1.0)   # here
        assert res.step_between("step") > 0
        marks = [when for label, when in res.marks[0] if label == "step"]
        points = timing.memory_on_replay(m["memory"][name], t.ranks[0], res)
        # step 2 (from the mark after step 1; ZeRO's step goes on a little after its optimizer's mark), and only it
        assert len(points) > 100 and all(marks[0] <= when < marks[2] for when, _ in points)
        assert sum(when <= marks[1] for when, _ in points) > 0.9 * len(points)
        assert max(b for _, b in points) > min(b for _, b in points) > 0


def test_stamped_optimizer_stamps_and_marks_every_step():
    import torch
    from minipar.machine import trace
    from minipar.observe import tracer
    from minipar.observe.launch_trace import stamped_optimizer
    stamps, w = [], torch.nn.Parameter(torch.ones(2))
    opt = stamped_optimizer(lambda params: torch.optim.SGD(params, lr=0.5), stamps)([w])
    with tracer.tracing(0) as rank_trace:
        for _ in range(3):
            w.grad = torch.ones(2)
            opt.step()
    assert len(stamps) == 3 and stamps == sorted(stamps) and w.tolist() == [-0.5, -0.5]
    assert [e.label for e in rank_trace.events if isinstance(e, trace.Mark)] == ["step"] * 3


def test_trace_position_names_the_open_compute_segment():
    import time
    from minipar.machine import trace
    from minipar.observe import tracer
    assert tracer.position() is None                                # no trace recording
    with tracer.tracing(0) as rank_trace:
        tracer.mark("a")                                            # events 0 (compute), 1 (mark)
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.01:
            pass
        index, cpu = tracer.position()
    assert index == 2 and isinstance(rank_trace.events[2], trace.Compute)
    assert 0.01 <= cpu <= rank_trace.events[2].seconds_cpu


def test_calculator_text_is_the_formula_once():
    from minipar.course.ch03_zero_and_fsdp.report import calculator_text
    text = calculator_text(9.0, 8, 3, "GB")
    assert text.count("Ψ = 1e+09") == 1 and "total           2.00 GB" in text       # 16 B × 1e9 / 8
    assert "total          16.00 GB" in calculator_text(9.0, 1, 0, "GB")           # DDP on one device: 16Ψ


def test_paced_prefetch_claim_needs_the_spread_unless_the_slots_ran_long():
    from types import SimpleNamespace
    from minipar.course.ch03_zero_and_fsdp import claims, paced
    ok = SimpleNamespace(matches=True, max_abs_diff=0.0)
    m = {"seconds": {"prefetch": [0.20, 0.21, 0.30], "no prefetch": [0.24, 0.25, 0.26]},
         "matches": {"prefetch": ok, "no prefetch": ok}, "overruns": 0, "slots": 100, "load": 1.0, "slot_s": (0.008, 0.016),
         "blocks": 4, "block_bytes": 4.9e6}
    claims.check_prefetch_saves_time_paced(m)                            # one slow step: the median is outside
    assert "the ranges overlap, a median lies outside" in paced.table(m)   # not "outside the spread"
    assert "96 ms of the 250 ms step is compute slots and 62% is gloo's collectives" in paced.table(m)
    assert "paced: a GPT of 4 blocks, h = 320, 4 heads" in paced.table(m)   # the timed model's shape (§5)
    assert "(communication-bound)" in paced.table(m)        # the regime the notebook's text explains the saving by
    assert paced.table(m).startswith("prefetch saves 40.0 ms a step (16%)")   # the result first (chapter 03 §5)
    tie = dict(m, seconds={"prefetch": [0.20, 0.25, 0.30], "no prefetch": [0.22, 0.24, 0.26]})
    claims.check_prefetch_saves_time_paced(tie)                         # a quiet tie: allowed, and stated as one
    assert paced.verdict_line(tie).startswith("timed on a quiet machine: a tie this time (the median step 10.0 ms "
                                              "longer with prefetch, of 240 ms, inside the steps' spread)")
    slower = dict(m, seconds={"prefetch": [0.24, 0.25, 0.26], "no prefetch": [0.20, 0.21, 0.30]})
    with pytest.raises(AssertionError):                                 # prefetch slower beyond the spread: fails
        claims.check_prefetch_saves_time_paced(slower)
    claims.check_prefetch_saves_time_paced(dict(tie, overruns=11))
    busy = paced.table(dict(tie, overruns=11))                      # a disturbed run: no saving stated as measured
    assert "not compared" in busy and "saves" not in busy and "a tie" not in busy
    assert "step not timed" in busy and "[" not in busy                 # no step times to compare


def test_paced_runs_build_zero3_as_the_traced_runs_do(monkeypatch):
    """Chapter 03's paced and traced prefetch runs are one program: ZeRO-3 with blocking reduce-scatters
    (``parallel_train``'s default), only ``prefetch`` varying."""
    from types import SimpleNamespace
    from minipar.course.ch03_zero_and_fsdp import paced
    calls = []
    monkeypatch.setattr(paced.zero, "ZeRO", lambda *args, **kwargs: calls.append((args, kwargs)))
    for prefetch in (True, False):
        paced.zero3("model", SimpleNamespace(optimizer="sgd"), prefetch)
    assert [(args[2:], kwargs) for args, kwargs in calls] == [((3,), {"prefetch": True}), ((3,), {"prefetch": False})]


def test_break_even_tokens_is_the_formula_and_the_claim_refuses_a_model_below_it():
    from minipar.course.ch03_zero_and_fsdp import claims
    from minipar.course.ch03_zero_and_fsdp.report import break_even_tokens
    from minipar.machine.cluster import a100_cluster
    assert round(break_even_tokens(a100_cluster(1), 8)) == round(7 / 8 * 312e12 * 0.83 / 231e9) == 981
    claims.check_break_even_below_the_models_tokens(841, 4096)
    from minipar.course.ch03_zero_and_fsdp.report import break_even
    from minipar.machine.cluster import h100_cluster
    text = break_even(4).text                            # §5 also gives the bound on chapter 00's DGX H100 links
    assert "NVLink 4" in text and f"T ≥ {break_even_tokens(h100_cluster(1), 4):,.0f}" in text
    for even, tokens in ((841, 512), (280, 4096)):        # a model below it; a bound a third too small (F/3β)
        with pytest.raises(AssertionError):
            claims.check_break_even_below_the_models_tokens(even, tokens)


def test_tiling_checks_the_gradients_through_the_refetch():
    """Memory-centric tiling prints and holds the gradients (input, weight, bias) against the untiled layer,
    not only the forward output; a gradient gap fails the claim."""
    from minipar.course.ch03_zero_and_fsdp import claims, offload_and_tiling
    r = offload_and_tiling.tiling((1, 4, 16))
    r.check()
    assert "gradients (input, weight, bias) max |Δ|" in r.text and max(r.grad_gaps.values()) <= 1e-6
    with pytest.raises(AssertionError):
        claims.check_memory_centric_tiling_one_layer(r.outputs, r.peaks, {**r.grad_gaps, 16: 1e-3})


def test_paced_regime_is_named_by_the_collectives_share():
    from minipar.course.ch03_zero_and_fsdp import paced
    assert [paced.regime(x) for x in (0.62, 0.56, 0.55, 0.49, 0.45, 0.44)] == [
        "communication-bound", "communication-bound"] + ["compute and collectives about even"] * 3 + ["compute-bound"]


def test_paced_line_prints_the_measured_compute():
    """§5's paced line: the slots the run held and a block's measured compute they were sized from
    (sized by the library's ``size_slots``, tested with chapter 02)."""
    from minipar.course.ch03_zero_and_fsdp import paced
    m = {"seconds": {"prefetch": [0.2], "no prefetch": [0.3]}, "matches": {}, "overruns": 50, "slots": 100,
         "load": 1.0, "slot_s": (0.012, 0.020), "compute_s": (0.006, 0.010), "blocks": 4, "block_bytes": 4.9e6}
    m["matches"] = {n: type("C", (), {"matches": True, "max_abs_diff": 0.0})() for n in m["seconds"]}
    assert "forward takes 6.0 ms, its backward 10.0 ms" in paced.table(m)


def test_paced_run_fails_its_one_device_check_when_another_rank_differs_from_rank_0():
    """The paced run sends back rank 0's gathered parameters only: every other rank's must hash to the same
    bytes, or the configuration does not match one device, naming the rank."""
    import torch
    from minipar.check import compare
    from minipar.course.ch03_zero_and_fsdp import paced
    from minipar.recipe import RunResult
    params = {"w": torch.arange(4.0), "b": torch.ones(2)}
    reference = RunResult([1.0], {k: v.clone() for k, v in params.items()})
    tweaked = dict(params, b=torch.tensor([1.0, 1.0 + 2**-20]))        # one bit off: still inside the tolerance
    ranks = [{"digests": {"prefetch": paced._digest(p)}} for p in (params, params, tweaked, params)]
    match = compare(reference, [RunResult([1.0], params)], atol=1e-5, rtol=1e-4)
    assert match.matches and compare(reference, [RunResult([1.0], tweaked)], atol=1e-5, rtol=1e-4).matches
    assert paced._on_every_rank(match, ranks[:2] + ranks[3:], "prefetch") is match
    failed = paced._on_every_rank(match, ranks, "prefetch")
    assert not failed.matches and failed.problems == ["rank(s) [2]: parameters differ from rank 0's"]


def test_paced_verdict_states_the_saving_or_that_nothing_was_timed():
    """§5's paced cell ends with a verdict built from the run (the Summary and §5's prose rely on it, not on a
    quiet machine): a timed run states its saving; a disturbed one says plainly it timed nothing, states no
    saving, says what a quiet run shows, and its check still passes (the build does not fail on a busy machine).
    A verdict that contradicts its run fails the claim."""
    from types import SimpleNamespace
    from minipar.course.ch03_zero_and_fsdp import claims, report
    ok = SimpleNamespace(matches=True, max_abs_diff=0.0)
    quiet = {"seconds": {"prefetch": [0.20, 0.21, 0.22], "no prefetch": [0.24, 0.25, 0.26]},
             "matches": {"prefetch": ok, "no prefetch": ok}, "overruns": 0, "slots": 100, "load": 0.5,
             "slot_s": (0.036, 0.036), "compute_s": (0.0165, 0.0162), "blocks": 4, "block_bytes": 4.9e6}
    r = report.paced_table(quiet)
    r.check()
    assert r.text.splitlines()[-1] == "timed on a quiet machine: prefetch saved 40.0 ms of a 250 ms step (16%)"
    tied = report.paced_table(dict(quiet, seconds={"prefetch": [0.332, 0.320, 0.345], "no prefetch": [0.334, 0.331, 0.385]}))
    tied.check()                                        # a quiet run that tied (seen once in about fifteen): no failure
    assert tied.text.splitlines()[-1].startswith("timed on a quiet machine: a tie this time (the median step 2.0 ms "
                                                 "shorter with prefetch, of 334 ms") and "saved" not in tied.text
    assert "evidence" not in r.text and "quarter" not in r.text and "0.25" not in r.text   # the rules: the fold's
    # both slots at the 36 ms ceiling: the line says so (why a forward's slot is no longer than a backward's)
    assert "its backward 16.2 ms; both slots are the longest allowed, 36 ms: twice each one's slow end was more)" in r.text
    one = report.paced_table(dict(quiet, slot_s=(0.036, 0.033))).text    # review 6: why a backward's slot was shorter
    assert "each forward held to 36 ms and backward to 33 ms (276 ms of slots a step; measured here, a block's forward " \
           "takes 16.5 ms, its backward 16.2 ms; the forward's slot is the longest allowed, 36 ms: twice its slow end " \
           "was more)" in one
    assert "longest" not in report.paced_table(dict(quiet, slot_s=(0.030, 0.033))).text
    assert "waiting for a core" in r.text          # backward ≈ forward here: the line says why (review 03 #6)
    busy = dict(quiet, load=1e3)                                      # the load guard fired
    b = report.paced_table(busy)
    b.check()                                                         # silent: the build goes on
    last = b.text.splitlines()[-1]
    assert last.startswith("not timed: the machine was too busy") and "by less than the 288 ms of slots a step" in last
    assert "saved" not in b.text and "saves" not in b.text.rsplit("\n", 1)[0]
    assert "waiting for a core" not in report.paced_table(dict(quiet, compute_s=(0.01, 0.02))).text
    with pytest.raises(AssertionError):                               # a saving stated for a busy run
        claims.check_paced_verdict_follows_the_run(busy, r.text)
    with pytest.raises(AssertionError):                               # "not timed" for a timed run
        claims.check_paced_verdict_follows_the_run(quiet, b.text)
    # a run that measured its wake-ups is judged by them: the load average of earlier runs does not void it,
    # ranks woken late do
    assert report.paced_table(dict(quiet, load=1e3, late_s=0.0002, other_cores=0.01)).text.splitlines()[-1].startswith(
        "timed on a quiet machine")
    among_others = report.paced_table(dict(quiet, late_s=0.0002, other_cores=1.5))      # make test's streams beside it
    among_others.check()
    assert among_others.text.splitlines()[-1].startswith("not timed")
    assert "other processes used 1.5 of the" in among_others.text
    late = report.paced_table(dict(quiet, late_s=0.004))
    late.check()
    assert "woke a median 4.0 ms after their slots' ends, over 1 ms" in late.text   # the first line says why


def test_the_folds_quiet_machine_rules_are_the_codes():
    """§5's printed lines say only whether the machine was quiet; the rules live in its fold ("How it was
    measured"), in words: they must be the thresholds the code applies."""
    import json
    from minipar.course import ROOT
    from minipar.observe.busy import DISTURBED_SHARE, LATE_WAKE_S, OTHER_CORES
    nb = json.loads((ROOT / "notebooks" / "03_zero_and_fsdp.ipynb").read_text())
    text = " ".join(" ".join("".join(c["source"]).split()) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert (OTHER_CORES, DISTURBED_SHARE, LATE_WAKE_S) == (0.25, 0.05, 0.001)
    for words in ("at most 5 % of the slots ran long", "over a quarter of a core", "a median under 1 ms late"):
        assert words in text, words
