"""Chapter 03's activation column: ZeRO shards the model states and leaves the activations whole. The bytes
autograd saves for backward, counted inside each stage's training, are the same on every stage and equal to
what one process saves running the same model on the same rank's slice of the batch."""
from minipar import launch
from minipar.course.ch03_zero_and_fsdp import figures as figs
from minipar.loop import shard_batch
from minipar.memory import saved_activation_bytes


def test_activations_are_the_same_on_every_stage_and_equal_one_process():
    recipe = figs.memory_recipe()
    per_rank = launch(figs.measure_stages_with_activations, 2, recipe, stages=(0, 2, 3), quiet=True)
    model = recipe.model()
    x, y = shard_batch(recipe.batches[-1], 0, 2)
    _, alone = saved_activation_bytes(recipe.loss, model, x, y, exclude=list(model.parameters()))
    assert alone > 0
    for runs in per_rank:
        assert {res.memory["activations"] for res in runs.values()} == {alone}
    assert per_rank[0][3].memory["params"] < per_rank[0][0].memory["params"]     # while the model states shrink
