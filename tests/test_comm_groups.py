"""Every record of a real 3D step (dp × pp × tp = 2 × 2 × 2 on 8 ranks) names the mesh dims its group spans,
and the bytes per dimension — a group-by over the log — add up to the log's total and to Trainer3D's bytes
per kind."""
import torch

from minipar import comm, launch
from minipar.check import gpt_recipe
from minipar.hybrid.parallel3d import Trainer3D, bytes_formula


def _recipe():
    r = gpt_recipe(steps=1, batch_size=16, seq_len=8, n_layer=4)
    r.dtype = torch.float64
    return r


def _one_step(rank, world_size, recipe):
    t = Trainer3D(rank, world_size, recipe, dp=2, pp=2, tp=2)
    with comm.recording(mesh=t.mesh) as log:
        t.step(*recipe.batches[0])
    steps = comm.CommLog(t.logs["pp+tp"].records + t.logs["dp"].records)    # the trainer's own, tagged logs
    return ([(r.op, r.ranks, r.dims, r.sent_bytes) for r in log.records], log.bytes_by_dims(), log.bytes_sent,
            t.mesh.coords, steps.bytes_by_dims())


def test_every_record_of_a_3d_step_names_the_dims_its_group_spans():
    from minipar import Mesh
    mesh = Mesh(8, dp=2, pp=2, tp=2)
    recipe = _recipe()
    cfg = recipe.model().cfg
    for rank, (records, by_dims, total, coords, trainer_by_dims) in enumerate(launch(_one_step, 8, recipe, quiet=True)):
        assert records and coords == mesh.coords(rank)
        for op, ranks, dims, _ in records:
            assert rank in ranks and dims == mesh.dims_spanned(ranks), (op, ranks, dims)
            if op in ("send", "recv"):              # pipeline messages: a pair of neighbouring stages
                assert dims == ("pp",) and len(ranks) == 2
            else:
                assert dims in (("tp",), ("dp",)) and list(ranks) == mesh.group_ranks(dims, rank), (op, ranks)
        assert sum(by_dims.values()) == total
        want = bytes_formula(cfg, batch=16, seq=8, dp=2, pp=2, tp=2, m=4, pp_rank=coords["pp"])
        assert {d[0]: b for d, b in trainer_by_dims.items()} == want
        loss = 8 if coords["pp"] == 1 else 0       # + the last stage's float64 loss averaged over dp
        assert by_dims == {(k,): b + (loss if k == "dp" else 0) for k, b in want.items()}
