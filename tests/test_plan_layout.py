"""minipar.layout.Layout: the one object that names a run's dimensions — its sizes and world size, its own
checks, the keyword form the trainer keeps, and the round trip through a checkpoint's manifest."""
import json

import pytest

from minipar.hybrid.parallel3d import DEFAULTS
from minipar.layout import MESH_DIMS, Layout
from minipar.mesh import DEFAULT_ORDER
from minipar.plan import Layout as PlanLayout


def test_one_layout_everywhere():
    assert PlanLayout is Layout and MESH_DIMS == DEFAULT_ORDER          # the planner's and the mesh's
    x = Layout(dp=2, pp=3, tp=4, cp=5, ep=1, micro_batch=2, micro_batches=6)
    assert x.sizes == {"dp": 2, "pp": 3, "cp": 5, "ep": 1, "tp": 4}
    assert x.world_size == x.devices == 120 and x.global_batch == 2 * 2 * 6


@pytest.mark.parametrize("fields, words", [
    (dict(tp=0), "Layout.tp must be a positive integer, got 0"),
    (dict(cp=-1), "Layout.cp must be a positive integer, got -1"),
    (dict(dp=True), "Layout.dp must be a positive integer, got True"),
    (dict(micro_batches=2.0), "Layout.micro_batches must be a positive integer"),
    (dict(zero=4), "zero must be 0, 1, 2 or 3, got 4"),
    (dict(zero=True), "zero must be 0, 1, 2 or 3"),
    (dict(sp=1), "sp must be True or False"),
    (dict(schedule=None), "schedule must be a name"),
])
def test_check_names_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        Layout(**fields).check()


def test_refuse_names_the_dimensions_in_use():
    Layout(dp=4).refuse("cp", "ep", why="not yet")
    with pytest.raises(ValueError, match="cp=2, ep=4: not yet"):
        Layout(cp=2, ep=4).refuse("cp", "ep", why="not yet")


def test_keyword_form_and_manifest_round_trip():
    x = Layout.of(None, DEFAULTS, dp=2, pp=2, tp=2)
    assert x == Layout(dp=2, pp=2, tp=2, micro_batches=4)                 # the 3D trainer's m = 4 default
    assert Layout.of(x) is x
    assert Layout.from_dict(json.loads(json.dumps(x.as_dict()))) == x
    with pytest.raises(ValueError, match="not both"):
        Layout.of(x, tp=4)
    with pytest.raises(ValueError, match="must be a minipar.layout.Layout, got dict"):
        Layout.of({"dp": 2})
    with pytest.raises(ValueError, match=r"unknown layout field\(s\) \['dq'\]"):
        Layout.of(None, dq=2)


def test_expert_parallelism_is_folded_into_dp_times_cp_times_tp():
    """ep borrows ranks from a stage's dp × cp × tp (Megatron-Core's MoE parallel folding): it adds none."""
    x = Layout(dp=2, cp=2, tp=2, ep=4).check()
    assert x.world_size == 8 and x.sizes["ep"] == 1 and x.expert_data_parallel == 2
    assert Layout(dp=4, ep=2).check().expert_data_parallel == 2
    assert Layout(dp=1, tp=4, ep=4).check().expert_data_parallel == 1           # ep entirely over tp
    with pytest.raises(ValueError, match="ep=3 must divide dp·cp·tp = 4"):
        Layout(dp=2, cp=2, ep=3).check()
