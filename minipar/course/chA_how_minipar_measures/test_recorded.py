"""Appendix A's recorded runs and the helpers its cells call.

The record (:data:`recorded.RECORD`, written by ``python -m minipar bench steps``) must hold what the appendix's
sentences say of it: the helpers of :mod:`.show` raise when a sentence no longer holds, so they are run on it
here as the chapter runs them.
"""
import json
import re

import pytest

from minipar.course.chA_how_minipar_measures import calibration, recorded, show


@pytest.fixture(scope="module")
def record():
    return recorded.load()


def test_the_record_says_when_where_and_how(record):
    meta = record["recorded"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", meta["started"]) and meta["cores"] >= 1
    assert meta["command"].startswith("python -m minipar bench steps")
    text = recorded.provenance_text(record)
    assert meta["started"] in text and "load average" in text


def test_the_chapter_s_checks_hold_on_the_record(record):
    cal, fid, rows = record["calibration"], record["fidelity"], record["step_rows"]
    assert fid["ranks"] == cal["ranks"] and {r["name"] for r in rows} == {r["name"] for r in fid["rows"]}
    show.tour_rows(record["tour"])
    show.step_time_table(cal, fid, rows)
    show.links_table(cal, calibration.op_links(cal, cal["ranks"]))
    show.replay_table(fid)
    show.rankings_table(fid)
    show.a100_ddp(record["a100_ddp"], cal["ranks"])


def test_a_record_round_trips(record, tmp_path):
    again = recorded.as_record(record["tour"], record["calibration"], record["fidelity"], record["step_rows"],
                               record["a100_ddp"], record["recorded"])
    back = recorded.load(recorded.write(again, tmp_path / "r.json"))
    assert back["calibration"]["samples"] == record["calibration"]["samples"]
    assert back["a100_ddp"]["card"] is record["a100_ddp"]["card"]
    assert json.loads((tmp_path / "r.json").read_text())["a100_ddp"]["card"] == record["a100_ddp"]["card"].name


def test_a_check_fails_when_its_sentence_does_not_hold(record):
    wrong = [dict(r, bytes_measured=r["bytes_measured"] + 1) for r in record["tour"]]
    with pytest.raises(AssertionError):
        show.tour_rows(wrong)
