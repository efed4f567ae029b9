"""Checkpoints of a 3D run: saved at 2×2×2, loaded losslessly at 1×2×4, 4×2×1 and on one process; resumed
training equals training that never stopped; a crash mid-save leaves the previous checkpoint loadable; a
corrupt or mismatched checkpoint gets an error naming the file. Context-parallel layouts: one writer per stage
file (coordinate 0 along dp, cp and tp), saved at cp 2 and resumed at another cp and tp. MoE layouts: the experts
in a file per (stage, ep rank), written by the rank at expert-DP 0 and tp 0, their Adam state with them (ZeRO-1:
the experts' own optimizer); saved at dp2 pp2 tp2 ep2 + ZeRO-1, resumed at cp2 ep4 tp1, at pp1 ep1 tp2 and on one
process (the one-device model and Adam) to the uninterrupted step 3; a rule where only ep-rank 0 writes fails."""
import os
import shutil

import pytest
import torch

from minipar import launch
from minipar.check import RunResult, compare, gpt_recipe, train_reference, train_steps
from minipar.hybrid import checkpoint, guard
from minipar.hybrid.checkpoint import CheckpointError
from minipar.hybrid.parallel3d import Trainer3D
from minipar.launcher import RankError
from minipar.layout import Layout


def recipe(steps=3, **cfg):
    cfg.setdefault("n_layer", 4)
    r = gpt_recipe(steps=steps, batch_size=16, seq_len=8, **cfg)
    r.dtype = torch.float64
    return r


def save_rank(rank, world_size, recipe, layout, directory, steps, crash_rank=None):
    t = Trainer3D(rank, world_size, recipe, **layout)
    for i in range(steps):
        t.step(*recipe.batches[i], i)
    checkpoint.save(t, directory, steps, crash_rank=crash_rank)
    return t.full_params()


def resume_rank(rank, world_size, recipe, layout, directory):
    t = Trainer3D(rank, world_size, recipe, **layout)
    start = checkpoint.load(t, directory)
    loaded = t.full_params()
    losses = [t.step(*recipe.batches[i], i) for i in range(start, recipe.steps)]
    return start, loaded, RunResult(losses if losses[0] is not None else None, t.full_params())


L222 = dict(dp=2, pp=2, tp=2, micro_batches=4)


def save_on_8(tmp_path_factory, name: str, rec, layout) -> tuple:
    """(directory, full parameters the ranks had when saving) of a checkpoint after 2 steps on 8 ranks."""
    directory = str(tmp_path_factory.mktemp(name))
    params = {}
    for p in launch(save_rank, 8, rec, layout, directory, 2, quiet=True):
        params.update(p)
    return directory, params


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint after 2 steps at 2×2×2 and the full parameters the ranks had when saving."""
    return save_on_8(tmp_path_factory, "ckpt", recipe(), L222)


def assert_lossless(results, at_save) -> None:
    """Every resumed rank starts at step 2 and holds every element as it was saved; together they hold all."""
    seen = set()
    for start, loaded, _ in results:
        assert start == 2
        for name, t in loaded.items():
            assert torch.equal(t, at_save[name]), name
            seen.add(name)
    assert seen == set(at_save)


@pytest.fixture(scope="module")
def reference():
    """One device's uninterrupted 3 steps of recipe(), made once for every resume test of the module."""
    return train_reference(recipe())


@pytest.mark.parametrize("world_size, layout", [
    (8, dict(dp=1, pp=2, tp=4, micro_batches=4)),
    (8, dict(dp=4, pp=2, tp=1, micro_batches=4, zero=1)),
    (1, dict(dp=1, pp=1, tp=1, micro_batches=1)),
], ids=["1x2x4", "4x2x1+zero1", "one process"])
def test_load_in_another_layout(saved, reference, world_size, layout):
    assert_resumes_losslessly_to_step_3(saved, reference, world_size, layout)


def assert_resumes_losslessly_to_step_3(saved, ref, world_size, layout) -> None:
    """Resumed at ``layout`` from ``saved`` (directory, parameters at save): lossless, and the resumed step is
    one process's uninterrupted step 3 (``ref``: train_reference(recipe()))."""
    directory, at_save = saved
    results = launch(resume_rank, world_size, recipe(), layout, directory, quiet=True)
    assert_lossless(results, at_save)
    compare(RunResult(ref.losses[2:], ref.params), [r for _, _, r in results], dtype=torch.float64).assert_ok()


def test_resume_is_bit_exact_in_the_same_layout(tmp_path):
    layout = dict(dp=2, pp=1, tp=2, micro_batches=2, zero=1, schedule="gpipe")
    launch(save_rank, 4, recipe(), layout, str(tmp_path), 2, quiet=True)
    resumed = [r for _, _, r in launch(resume_rank, 4, recipe(), layout, str(tmp_path), quiet=True)]
    straight = launch(save_rank, 4, recipe(), layout, str(tmp_path / "straight"), 3, quiet=True)
    for res, full in zip(resumed, straight):
        for name, t in res.params.items():
            assert torch.equal(t, full[name]), name


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path):
    layout = dict(dp=1, pp=2, tp=2, micro_batches=2)
    d = str(tmp_path)
    launch(save_rank, 4, recipe(), layout, d, 1, quiet=True)
    with pytest.raises(RankError, match="rank 0"):
        launch(save_rank, 4, recipe(), layout, d, 2, crash_rank=0, quiet=True)
    assert os.path.isdir(os.path.join(d, "step-00000002.partial"))      # the half-written one
    folder = checkpoint.latest(d)
    assert folder.endswith("step-00000001")
    checkpoint.verify(folder, checkpoint.read_manifest(folder), recipe_shapes())


def recipe_shapes(**cfg):
    return {n: tuple(p.shape) for n, p in recipe(**cfg).model().named_parameters()}


@pytest.fixture
def copy(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "c")
    folder = checkpoint.latest(str(tmp_path / "c"))
    return folder


def check(folder, shapes=None):
    checkpoint.verify(folder, checkpoint.read_manifest(folder), shapes or recipe_shapes())


def test_intact_copy_verifies(copy):
    check(copy)


def test_missing_shard(copy):
    os.remove(os.path.join(copy, "stage-1.pt"))
    with pytest.raises(CheckpointError, match=r"stage-1\.pt is missing"):
        check(copy)


def test_truncated_shard(copy):
    path = os.path.join(copy, "stage-0.pt")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=r"stage-0\.pt has \d+ bytes.*truncated"):
        check(copy)


def test_corrupt_shard(copy):
    path = os.path.join(copy, "stage-0.pt")
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"stage-0\.pt: SHA-256.*corrupt"):
        check(copy)


def test_wrong_model_shape(copy):
    with pytest.raises(CheckpointError, match=r"stage-0\.pt holds tok_emb\.weight of shape \(64, 32\).*\(64, 48\)"):
        check(copy, recipe_shapes(n_embd=48))


def test_more_layers_than_saved(copy):
    with pytest.raises(CheckpointError, match="holds blocks.4"):
        check(copy, recipe_shapes(n_layer=6))


def test_fewer_layers_than_saved(copy):
    with pytest.raises(CheckpointError, match=r"holds blocks\.2\..*which the model does not have"):
        check(copy, recipe_shapes(n_layer=2))


def test_manifest_missing_or_garbage(copy):
    path = os.path.join(copy, "manifest.json")
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is not valid JSON"):
        check(copy)
    os.remove(path)
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        check(copy)


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="latest is missing"):
        checkpoint.latest(str(tmp_path))


def test_the_manifest_records_the_run(saved):
    manifest = checkpoint.read_manifest(checkpoint.latest(saved[0]))
    assert manifest["format"] == "minipar-3d-checkpoint/2" and manifest["dtype"] == "float64"
    assert manifest["config"]["n_layer"] == 4 and manifest["data"]["position"] == 2 == manifest["step"]
    assert manifest["layout"] == {**Layout().as_dict(), **L222}
    assert "seed" in manifest                              # None here: save() was not told the run's seed


def test_differences_name_every_field_that_changed():
    cfg = recipe().model().cfg
    run = guard.run_identity(cfg, seed=0, dtype=torch.float64, data={"source": "markov", "batch_size": 16})
    manifest = {**run, "data": {**run["data"], "position": 7}}        # the position may differ
    assert guard.differences(manifest, run) == []
    other = guard.run_identity(cfg.with_(n_layer=2, n_head=2), seed=1, dtype=torch.float32,
                               data={"source": "text", "batch_size": 16})
    assert guard.differences(manifest, other) == [
        "config.n_head: checkpoint 4, this run 2", "config.n_layer: checkpoint 4, this run 2",
        "seed: checkpoint 0, this run 1", "dtype: checkpoint 'float64', this run 'float32'",
        "data.source: checkpoint 'markov', this run 'text'"]
    assert guard.differences({}, run)[0] == "config.bias: checkpoint '(not recorded)', this run True"


def test_saving_a_step_again_moves_latest_without_a_window(tmp_path):
    layout = dict(dp=1, pp=2, tp=1, micro_batches=2)
    d = str(tmp_path)
    launch(save_rank, 2, recipe(), layout, d, 1, quiet=True)
    launch(save_rank, 2, recipe(), layout, d, 1, quiet=True)          # the same step, written again
    assert checkpoint.latest(d).endswith("step-00000001.1")           # a new folder, then latest moved to it
    assert sorted(os.listdir(d)) == ["latest", "step-00000001.1"]     # and only then the old copy removed
    check(checkpoint.latest(d), recipe_shapes())


def _blind_rank(rank, world_size, base):
    """Each rank saves into its own folder: as two nodes without a shared filesystem would."""
    folder = os.path.join(base, f"node-{rank}")
    os.makedirs(folder, exist_ok=True)
    try:
        guard.check_shared(folder)
    except CheckpointError as exc:
        return str(exc)
    return "shared"


def test_a_save_folder_that_is_not_shared_is_refused_on_every_rank(tmp_path):
    said = launch(_blind_rank, 2, str(tmp_path), quiet=True)
    assert len(said) == 2 and all("ranks [1] do not see rank 0's file" in s and "shared filesystem" in s for s in said)
    assert launch(_shared_rank, 2, str(tmp_path / "one"), quiet=True) == ["shared", "shared"]


def _shared_rank(rank, world_size, folder):
    guard.check_shared(folder)
    return "shared"


def test_check_folder_says_why_it_cannot_write(tmp_path):
    (tmp_path / "file").write_text("x")
    for where, words in ((tmp_path / "file", "File exists"), (tmp_path / "file" / "sub", "Not a directory"),
                         ("/proc/minipar", "No such file")):
        with pytest.raises(CheckpointError, match=f"cannot save into {where}: {words}"):
            guard.check_folder(str(where))


# ------------------------------------------------------------------------------------------------------
# Context-parallel layouts: cp shards no parameter, so one rank per stage (coordinate 0 along dp, cp, tp)
# writes; the checkpoint resumes at another cp and tp to the uninterrupted step (float64, compare's atol
# 1e-10, rtol 1e-9)
# ------------------------------------------------------------------------------------------------------

CP_SAVE = dict(dp=1, cp=2, pp=2, tp=2, micro_batches=4, cp_method="ring-zigzag")


@pytest.fixture(scope="module")
def saved_cp(tmp_path_factory):
    return save_on_8(tmp_path_factory, "ckpt-cp", recipe(), CP_SAVE)


def test_one_writer_per_stage_file_whatever_the_mesh():
    from minipar.mesh import Mesh
    mesh = Mesh(16, dp=2, pp=2, cp=2, tp=2)
    writers = [r for r in range(16) if checkpoint.writes(mesh.coords(r), checkpoint.STAGE_REPLICATED)]
    assert [mesh.coords(r)["pp"] for r in writers] == [0, 1] and writers[0] == 0
    old_rule = [r for r in range(16) if checkpoint.writes(mesh.coords(r), ("dp", "tp"))]    # cp forgotten
    assert len(old_rule) == 4


def _count_writes(rank, world_size, recipe, layout, directory):
    written, real_save = [], torch.save

    def counting(obj, path, *args, **kwargs):
        written.append(os.path.basename(str(path)))
        return real_save(obj, path, *args, **kwargs)
    torch.save = counting                      # this forked rank's torch only
    t = Trainer3D(rank, world_size, recipe, **layout)
    t.step(*recipe.batches[0], 0)
    checkpoint.save(t, directory, 1)
    return [w for w in written if w.startswith("stage-")]


def test_each_stage_file_is_written_by_one_rank_at_cp_2(tmp_path):
    layout = dict(dp=2, cp=2, pp=1, tp=2, micro_batches=2, schedule="gpipe", zero=1)    # ZeRO-1 over dp × cp
    written = [w for ws in launch(_count_writes, 8, recipe(1), layout, str(tmp_path), quiet=True) for w in ws]
    assert written == ["stage-0.pt"]
    check(checkpoint.latest(str(tmp_path)))


def test_the_manifest_records_the_cp_layout(saved_cp):
    manifest = checkpoint.read_manifest(checkpoint.latest(saved_cp[0]))
    assert manifest["layout"] == {**Layout().as_dict(), **CP_SAVE}
    assert sorted(manifest["files"]) == ["rng.pt", "stage-0.pt", "stage-1.pt"]


@pytest.mark.parametrize("world_size, layout", [
    (8, dict(dp=2, cp=1, pp=2, tp=2, micro_batches=4, zero=1)),
    (8, dict(dp=2, cp=2, pp=2, tp=1, micro_batches=4, cp_method="ulysses")),
    (1, dict(dp=1, pp=1, tp=1, micro_batches=1)),
], ids=["cp1 tp2 zero1", "cp2 tp1 ulysses", "one process"])
def test_a_cp_checkpoint_resumes_at_another_cp_and_tp(saved_cp, reference, world_size, layout):
    assert_resumes_losslessly_to_step_3(saved_cp, reference, world_size, layout)


def test_a_cp_run_resumed_at_its_own_layout_equals_the_uninterrupted_run(saved_cp):
    resumed = [r for _, _, r in launch(resume_rank, 8, recipe(), CP_SAVE, saved_cp[0], quiet=True)]
    straight = launch(_train_rank, 8, recipe(), CP_SAVE, quiet=True)
    for res, full in zip(resumed, straight):
        assert (res.losses is None) == (full.losses is None)
        if res.losses is not None:
            assert res.losses == full.losses[2:]        # bit for bit: same layout, same arithmetic
        for name, t in res.params.items():
            assert torch.equal(t, full.params[name]), name


def _train_rank(rank, world_size, recipe, layout):
    t = Trainer3D(rank, world_size, recipe, **layout)
    losses = [t.step(*recipe.batches[i], i) for i in range(recipe.steps)]
    return RunResult(losses if losses[0] is not None else None, t.full_params())


# ------------------------------------------------------------------------------------------------------
# MoE (expert-parallel) layouts: experts written once per ep rank, resumed at another cp, ep and tp
# ------------------------------------------------------------------------------------------------------

def moe_recipe(steps=3):
    """The MoE GPT of a dp = 2, m = 2 run (its one-device loss), no-drop capacity (cf = E/k): every layout with
    dp = 2 and m = 2 has the same loss whatever its cp, ep, tp and pp."""
    from minipar.hybrid.experts import hybrid_moe_recipe
    return hybrid_moe_recipe(Layout(dp=2, micro_batches=2), steps=steps, batch_size=8, seq_len=8, experts=4, k=1,
                             capacity_factor=4.0, n_layer=2, n_head=4, n_embd=16)


MOE_SAVE = dict(dp=2, pp=2, tp=2, ep=2, zero=1, micro_batches=2)            # experts in their own optimizer


def _wrong_writer_save(rank, world_size, recipe, layout, directory, steps):
    checkpoint.EXPERT_REPLICATED = ("ep", "edp", "tp")          # the bug: only ep-rank 0 writes its experts
    return save_rank(rank, world_size, recipe, layout, directory, steps)


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
    return save_on_8(tmp_path_factory, "ckpt-moe", moe_recipe(), MOE_SAVE)


@pytest.fixture(scope="module")
def moe_reference():
    """One device's uninterrupted 3 steps of moe_recipe(), made once for the MoE resume tests."""
    return train_reference(moe_recipe())


def test_moe_experts_are_written_once_per_ep_rank(saved_moe):
    manifest = checkpoint.read_manifest(checkpoint.latest(saved_moe[0]))
    assert sorted(manifest["files"]) == ["experts-0-ep0.pt", "experts-0-ep1.pt", "experts-1-ep0.pt",
                                         "experts-1-ep1.pt", "rng.pt", "stage-0.pt", "stage-1.pt"]
    held = {f: set(e["tensors"]) for f, e in manifest["files"].items() if "tensors" in e}
    assert {n.split(".experts.")[1].split(".")[0] for n in held["experts-0-ep1.pt"]} == {"2", "3"}
    assert not any(".experts." in n for n in held["stage-0.pt"] | held["stage-1.pt"])
    shard = torch.load(os.path.join(checkpoint.latest(saved_moe[0]), "experts-1-ep0.pt"), weights_only=True)
    assert set(shard["optimizer"]) == {"exp_avg", "exp_avg_sq"} and manifest["optimizer_scalars"] == {"step": 2.0}


@pytest.mark.parametrize("world_size, layout", [
    (8, dict(dp=2, cp=2, pp=2, tp=1, ep=4, micro_batches=2, cp_method="ring-zigzag")),
    (4, dict(dp=2, pp=1, tp=2, ep=1, micro_batches=2, schedule="gpipe", zero=1)),
], ids=["cp2 ep4 tp1", "pp1 ep1 tp2 zero1"])
def test_a_moe_checkpoint_resumes_at_another_cp_ep_and_tp(saved_moe, moe_reference, world_size, layout):
    directory, at_save = saved_moe
    results = launch(resume_rank, world_size, moe_recipe(), layout, directory, quiet=True)
    seen = set()
    for start, loaded, _ in results:
        assert start == 2
        for name, t in loaded.items():              # lossless: every element as it was saved, experts included
            assert torch.equal(t, at_save[name]), name
            seen.add(name)
    assert seen == set(at_save)
    ref = moe_reference                             # the resumed step 3 is one device's uninterrupted step 3
    compare(RunResult(ref.losses[2:], ref.params), [r for _, _, r in results], dtype=torch.float64).assert_ok()


def one_process_resume(recipe, directory) -> RunResult:
    """The checkpoint's full tensors into the one-device model and its Adam (moments and step), then the
    remaining steps as :func:`minipar.check.train_reference` takes them."""
    folder = checkpoint.latest(directory)
    manifest = checkpoint.read_manifest(folder)
    params, states = {}, {}
    for file in (f for f, e in manifest["files"].items() if "tensors" in e):
        shard = torch.load(os.path.join(folder, file), weights_only=True)
        params.update(shard["params"])
        for key, tensors in shard["optimizer"].items():
            states.setdefault(key, {}).update(tensors)
    model = recipe.model().to(recipe.dtype)
    model.load_state_dict(params)
    opt = recipe.optimizer(model.parameters())
    for name, p in model.named_parameters():
        opt.state[p] = {"step": torch.tensor(manifest["optimizer_scalars"]["step"]),
                        **{k: states[k][name].clone() for k in states}}
    return train_steps(recipe, model, opt, recipe.batches[manifest["step"]:])


def test_a_moe_checkpoint_resumes_on_one_process(saved_moe, moe_reference):
    ref = moe_reference
    compare(RunResult(ref.losses[2:], ref.params), [one_process_resume(moe_recipe(), saved_moe[0])],
            dtype=torch.float64).assert_ok()


def test_a_writer_rule_that_forgets_the_ep_ranks_fails(tmp_path):
    """Only ep-rank 0 writing its experts (the dense rule applied to experts): the experts of ep-rank 1 are in no
    file, and loading anywhere names the missing tensor. Saved before any step: which rank writes a file does not
    depend on training (a step here cost ~2.5 s of CPU and no check)."""
    launch(_wrong_writer_save, 8, moe_recipe(), MOE_SAVE, str(tmp_path), 0, quiet=True)
    shapes = {n: tuple(p.shape) for n, p in moe_recipe().model().named_parameters()}
    with pytest.raises(CheckpointError, match=r"holds blocks\.\d\.mlp\.experts\.[23]\."):
        checkpoint.verify(checkpoint.latest(str(tmp_path)), checkpoint.read_manifest(checkpoint.latest(str(tmp_path))),
                          shapes)
