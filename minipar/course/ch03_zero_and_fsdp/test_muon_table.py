"""Chapter 03 §10's Muon table: the right methods equal one device, per-shard does not, the bytes and the state
equal the formulas; and its check fails when any of that is not so."""
import pytest

from minipar.course.ch03_zero_and_fsdp import muon_table


def test_muon_table_and_its_check_can_fail():
    table = muon_table.run()
    muon_table.check(table)
    assert set(table) == set(muon_table.METHODS)
    assert table["per_shard"]["diff"] > 1e-3 and all(table[m]["diff"] < 1e-12 for m in ("gather", "owner", "whole"))
    extra = {m: table[m]["sent"] - table["per_shard"]["sent"] for m in ("gather", "owner", "whole")}
    assert extra["owner"] == pytest.approx(extra["gather"] / 2)           # 2/N at N = 4
    assert extra["whole"] == pytest.approx(0, abs=1e-6)
    assert table["whole"]["state"] > table["owner"]["state"]
    for method, key, value in (("per_shard", "matches", True), ("owner", "matches", False),
                               ("gather", "sent", 0.0), ("whole", "state", 0)):
        bad = {m: dict(row) for m, row in table.items()}
        bad[method][key] = value
        with pytest.raises(AssertionError):
            muon_table.check(bad)
