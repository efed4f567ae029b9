"""Chapter 11's time comparison (Deeper B): the per-round ratio's median; a tie is called only when the
paired per-round ratios straddle 1, never because two [min – max] ranges overlap; a loaded machine compares
nothing (its one time column says so). The round-5 review's case: selective's fastest 11.2 ms against none's 8.1,
ranges overlapping, every round about 1.38× slower."""
from minipar.course.ch11_recomputation_and_memory import report
from minipar.observe.paced_compute import paired_ratios, unsteady

NONE = [0.0081, 0.0090, 0.0300, 0.0100, 0.0085, 0.0095]
SELECTIVE = [0.0112, 0.0124, 0.0414, 0.0138, 0.0117, 0.0131]      # each round 1.38× none's; ranges overlap
FLOPS = {"none": 100, "selective": 102, "full": 130}


def test_a_paired_slowdown_with_overlapping_ranges_is_slower_not_a_tie(capsys):
    fastest, median, (q1, q3), verdict = paired_ratios(SELECTIVE, NONE, loaded=False)
    assert round(fastest, 2) == 1.38 and round(median, 2) == 1.38 and q1 > 1 and verdict == "slower"
    report.show_times({"none": NONE, "selective": SELECTIVE, "full": NONE[::-1]}, FLOPS, loaded=False)
    out = capsys.readouterr().out.splitlines()
    assert "time ÷ none's (median of paired rounds)" in out[1] and "fastest ÷ fastest" not in out[1], out
    assert out[3].endswith("  ≈1.38, slower") and "tie" not in out[3], out
    assert "a tie" in out[4], out                                        # per-round ratios straddle 1


def test_a_tie_only_from_paired_ratios_and_nothing_compared_under_load(capsys):
    faster = [t * 0.9 for t in NONE]
    assert paired_ratios(faster, NONE, loaded=False)[3] == "faster"
    straddling = [t * r for t, r in zip(NONE, (0.8, 1.2, 0.9, 1.1, 0.85, 1.15))]
    assert paired_ratios(straddling, NONE, loaded=False)[3] == "a tie"
    assert paired_ratios(SELECTIVE, NONE, loaded=True)[3] == "not compared (load)"
    assert not unsteady({"none": [0.0081, 0.0085, 0.0090, 0.0091]})          # a steady run is compared
    assert unsteady({"none": [0.0081, 0.0085, 0.0130, 0.0400]})              # a quarter of it 1.5x its fastest
    report.show_times({"none": NONE, "selective": SELECTIVE, "full": SELECTIVE}, FLOPS, loaded=True)
    out = capsys.readouterr().out.splitlines()
    assert all(line.endswith("  not compared (load)") for line in out[3:]), out
