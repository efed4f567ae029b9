"""Chapter 03's composition of per-parameter FSDP with replication: it equals one device and its check passes;
the check fails when a norm's gradient differs between ranks."""
import pytest

from minipar.course.checks import ExerciseError
from minipar.course.ch03_zero_and_fsdp import composition


def test_the_composition_equals_one_device_and_its_check_catches_a_desync():
    run = composition.run(4)
    run.check()
    assert "replicated" in str(run) and "all_reduce" in str(run)
    run.per_rank[1][1][0] = run.per_rank[1][1][0] + 1e-9          # rank 1's norm gradient off by a hair
    with pytest.raises(ExerciseError, match="rank 1"):
        run.check()
