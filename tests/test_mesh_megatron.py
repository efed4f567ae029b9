"""minipar's Mesh lays ranks out as Megatron-Core's rank generator does (pure Python, no processes).

Read: NVIDIA/Megatron-LM ``megatron/core/parallel_state.py`` at commit 00caa53a (``RankGenerator``,
``generate_masked_orthogonal_rank_groups``, ``initialize_model_parallel``; read, not copied). Its documented
semantics, re-derived here rather than copied: the order string names the dims innermost first
(default ``"tp-cp-ep-dp-pp"``), so ``global_rank = Σ_i idx_i · Π_{j<i} size_j`` (its equation (1)); the
group for a token such as ``"dp-cp"`` holds the ranks that differ only in those dims, listed with the
innermost of them fastest, and the groups are listed with the innermost of the other dims fastest.
The dense generator has ep = 1; the expert generator uses the same order with cp = 1, tp = expert-TP, ep, and
dp = expert-DP = world / (expert-TP · ep · pp), so ep and expert-DP re-cut the ranks of dense dp × cp.
"""
import itertools
import math

import pytest

from minipar.mesh import Mesh, megatron_order

ORDER = "tp-cp-ep-dp-pp"


def megatron_groups(order: str, sizes: dict, token: str) -> list:
    """The rank groups of ``token`` by equation (1): an independent enumeration, innermost dim fastest."""
    names = order.split("-")
    stride = {n: math.prod(sizes[m] for m in names[:names.index(n)]) for n in names}
    inside = [n for n in names if n in token.split("-")]
    outside = [n for n in names if n not in inside]

    def indices(dims):       # every coordinate of ``dims``, the first of them varying fastest
        for combo in itertools.product(*(range(sizes[d]) for d in reversed(dims))):
            yield dict(zip(reversed(dims), combo))

    return [[sum(i[n] * stride[n] for n in inside) + sum(o[n] * stride[n] for n in outside)
             for i in indices(inside)] for o in indices(outside)]


def minipar_mesh(world, **sizes):
    return Mesh(world, megatron_order(ORDER), **sizes)


DENSE = {   # world: (tp, cp, dp, pp)
    8: [(2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2), (2, 2, 1, 2), (8, 1, 1, 1)],
    16: [(2, 2, 2, 2), (4, 2, 2, 1), (2, 4, 1, 2), (1, 2, 4, 2), (2, 1, 8, 1)],
    32: [(2, 2, 4, 2), (4, 2, 2, 2), (2, 4, 2, 2), (8, 1, 2, 2), (1, 4, 4, 2)],
}
DENSE_TOKENS = ["tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-dp", "tp-pp"]
CASES = [(w, s) for w, sizes in DENSE.items() for s in sizes]


def test_megatron_order_reverses_the_string():
    assert megatron_order() == ("pp", "dp", "ep", "cp", "tp")
    assert megatron_order("tp-dp-pp") == ("pp", "dp", "tp")
    with pytest.raises(ValueError, match="appear once"):
        megatron_order("tp-tp-pp")


def test_the_reference_enumeration_reproduces_megatrons_documented_examples():
    """Anchors copied as data from Megatron's docstrings, so the re-derivation is itself checked."""
    sizes = dict(tp=2, cp=1, ep=1, dp=2, pp=4)              # initialize_model_parallel: 16 GPUs, tp 2, pp 4
    assert megatron_groups(ORDER, sizes, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                                                   [12, 14], [13, 15]]
    assert megatron_groups(ORDER, sizes, "tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert megatron_groups(ORDER, sizes, "pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    small = megatron_groups("tp-dp-pp", dict(tp=2, dp=3, pp=4), "dp")   # generate_masked_..._groups
    assert small[0] == [0, 2, 4] and small[1] == [1, 3, 5] and small[7] == [19, 21, 23] and len(small) == 8
    assert megatron_groups("tp-pp-dp", dict(tp=2, pp=2, dp=2), "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("world, sizes", CASES)
def test_dense_groups_equal_megatrons(world, sizes):
    tp, cp, dp, pp = sizes
    mesh = minipar_mesh(world, tp=tp, cp=cp, dp=dp, pp=pp)
    megatron = dict(tp=tp, cp=cp, ep=1, dp=dp, pp=pp)
    for token in DENSE_TOKENS:
        assert mesh.groups(*token.split("-")) == megatron_groups(ORDER, megatron, token), token


def expert_cases():
    for world, sizes in CASES:
        tp, cp, dp, pp = sizes
        for ep in (e for e in (1, 2, 4, 8) if (dp * cp) % e == 0):
            for etp in sorted({tp, 1}):
                yield world, sizes, ep, etp


@pytest.mark.parametrize("world, sizes, ep, etp", list(expert_cases()))
def test_expert_groups_equal_megatrons(world, sizes, ep, etp):
    """The expert generator on the same order: ep and expert-dp borrow the ranks of dense dp × cp."""
    tp, cp, dp, pp = sizes
    edp = world // (etp * ep * pp)
    experts = minipar_mesh(world, tp=etp, ep=ep, dp=edp, pp=pp)
    megatron = dict(tp=etp, cp=1, ep=ep, dp=edp, pp=pp)
    for token in ["ep", "tp", "dp", "tp-ep", "tp-ep-pp", "pp", "ep-dp"]:
        assert experts.groups(*token.split("-")) == megatron_groups(ORDER, megatron, token), token
    dense = minipar_mesh(world, tp=tp, cp=cp, dp=dp, pp=pp)
    assert experts.groups("pp") == dense.groups("pp")        # Megatron asserts this too
    if etp == tp:                                           # ep × expert-dp is exactly dense dp × cp
        assert experts.groups("ep", "dp") == dense.groups("dp", "cp")
        for group in experts.groups("ep"):
            assert any(set(group) <= set(g) for g in dense.groups("dp", "cp"))


def test_the_check_can_fail():
    """minipar's default order (dp outermost, tp innermost, cp outside ep) differs from Megatron's for
    dp × pp meshes: the comparison notices."""
    sizes = dict(tp=2, cp=2, ep=1, dp=2, pp=2)
    mesh = Mesh(16, tp=2, cp=2, dp=2, pp=2)               # DEFAULT_ORDER = (dp, pp, cp, ep, tp)
    assert mesh.groups("dp") != megatron_groups(ORDER, sizes, "dp")
    assert mesh.groups("tp") == megatron_groups(ORDER, sizes, "tp")
