"""The simulator reproduces the zero-bubble README's table and the DualPipe README's table (printed beside).

Tolerances: zero-bubble bubbles within 0.25·B of the published multiple of B (the published ones are leading
terms; the start-up idle remains), p2p volume exactly, memory exactly (V-Min, V-Half: within 3 chunk
activations of ⅓×, ½×: their O(1)); DualPipe's idle per device, parameters,
activations and devices exactly."""
import pytest

from minipar.pipeline.published import dualpipe_table, format_table, zero_bubble_table


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zero_bubble_readme_table(p):
    rows = zero_bubble_table(p, 4 * p)
    print(format_table(rows, ["bubble/B", "memory", "volume"]))
    built = [(n, pub, sim) for n, pub, sim in rows if sim is not None]
    assert [n for n, _, _ in built] == ["1F1B", "ZB1P", "ZB-V", "V-Half", "V-Min"]   # every row simulated
    for name, (bubble, memory, volume), (s_bubble, s_memory, s_volume) in built:
        assert abs(s_bubble - bubble) <= 0.25, (name, s_bubble, bubble)
        assert s_volume == volume, name
        slack = 3 / (2 * p) if name in ("V-Min", "V-Half") else 0       # chunk activations over 1F1B's p stages = 2p chunks
        assert memory <= s_memory <= memory + slack + 1e-12, (name, s_memory, memory)
    # the orderings the table teaches: bubble ZB-V < ZB1P < V-Half < V-Min < 1F1B, memory V-Min < V-Half < the
    # others (p = 2: V-Half and V-Min both at 0.53·B and 1×: a V on 2 ranks has no room to trade)
    bubble = {n: sim[0] for n, _, sim in built}
    memory = {n: sim[1] for n, _, sim in built}
    assert bubble["ZB-V"] < bubble["ZB1P"] < bubble["V-Half"] <= bubble["V-Min"] < bubble["1F1B"]
    assert p == 2 or bubble["V-Half"] < bubble["V-Min"] and memory["V-Min"] < memory["V-Half"] < memory["ZB-V"]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipe_readme_table(p):
    rows = dualpipe_table(p, 4 * p)
    print(format_table(rows, ["idle", "params", "activations", "devices"]))
    for name, published, simulated in rows:
        assert simulated == pytest.approx(published), name


def test_dualpipe_pairs_played_apart_idle_less():
    """Two free actions instead of one F&B block: the idle per rank drops to (p-1)·F (the block's price)."""
    from minipar.pipeline import Costs, make_schedule, simulate
    s = make_schedule("dualpipev", 4, 16, 2)
    apart, block = (simulate(s, Costs(2, 2, 2), overlap=o) for o in (False, True))
    assert [apart.idle(r) for r in range(4)] == [3.0] * 4 and [block.idle(r) for r in range(4)] == [6.0] * 4
