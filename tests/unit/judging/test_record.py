"""The typed per-test record: one (de)serializer, versioned, that names every bad field; only
today's schema is read (none before it was released)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pytest_gpumem.config.spec import Defaults, Ratio, parse_marker
from pytest_gpumem.judging.record import (
    SCHEMA,
    BaselineChange,
    ReportError,
    SiteChange,
    SizeRecord,
    TestRecord,
    report_document,
)
from pytest_gpumem.judging.record_reader import load_report, parse_report
from pytest_gpumem.judging.verdict import Check
from pytest_gpumem.results.predict import FLAT, LINEAR, Candidate, Fit, Prediction
from pytest_gpumem.results.size import PER_RANK, FloorResult, SizeResult
from pytest_gpumem.sampling import AllocatedPeak, DeviceEstimate, Peak
from pytest_gpumem.sampling.sites import Site

DATA = Path(__file__).resolve().parents[2] / "data"


def full_record() -> TestRecord:
    """A record with every field set, at the precision its JSON keeps (so a round trip is exact)."""
    measured = SizeResult(
        world_size=2, device="gpu", platform="gpu:NVIDIA H200",
        peaks={0: Peak(800.0, "per-pid sampled"), 1: Peak(812.5, "per-pid sampled"), 2: Peak(None, "")},
        host_peaks={0: Peak(120.5, "live allocations (memray)"), 1: Peak(121.0, "live allocations (memray)")},
        rss_peaks={0: 300.0}, floor=FloorResult("torch", {0: 612.0, 1: 612.0}, "2026-12-01"),
        timeline=((0.0, {0: 1.0, 1: 2.0}), (0.5, {0: 800.0, 1: 812.5})), duration_s=3.5, nodes={0: "n1", 1: "n2"},
        allocated={0: AllocatedPeak(400.0, 512.0, "torch", DeviceEstimate(
            (("reserved", 512.0), ("context", 530.5), ("nccl", 300.25)), "NVIDIA H100 80GB HBM3", 81079.0)),
                   1: AllocatedPeak(420.0, None, "torch")},
        sites={1: (Site("t.py:7", "f", "all_gather", 256.0, 2, False, ("t.py:25 train",), 1),)},
        sites_notes=("sites of rank 1 only",), live_timeline=((0.1, {1: 100.0}), (0.4, {1: 420.0})),
        start="exec", simulated=(0, 1), uncounted=("DDP comm hook 'keep_buckets'",))
    size = SizeRecord(
        measured=measured, gated_rank=1, gated_label="rank 1 (largest)", gated_mib=812.5,
        checks=(Check("max_mib", 2, "rank 1 (largest)", "gpu", 812.5, 900.0, True, "max_mib {limit} MiB",
                      "simulated world", "device"),
                Check("baseline", 2, "rank 1 (largest)", "gpu", 812.5, 700.0, False,
                      "baseline {reference} MiB + 50 MiB = {limit} MiB", "simulated world", "device", False, 650.0),
                Check("baseline", 2, "rank 1 (largest)", "gpu", 420.0, 400.0, False,
                      "baseline {reference} MiB + 20 MiB = {limit} MiB", "simulated world", "allocated", False, 380.0)),
        ratio=1.5, baseline_mib=650.0, others_max_mib=800.0, peak_at_s={0: 1.25, 1: 1.5}, imbalance=0.015,
        allocated_mib=420.0, allocated_baseline_mib=380.0)
    fit = Fit(LINEAR, (400.0, 100.0), ((1, 500.0), (2, 600.0)), None, (Candidate(FLAT, None), Candidate(LINEAR, None)))
    predicted = SizeRecord(
        measured=SizeResult(8, "gpu", {}, prediction=Prediction(8, 1200.0, fit, "rank 0"),
                            allocated_prediction=Prediction(8, 900.0, fit, "rank 0", 100.0, 2)),
        gated_rank=None, gated_label="rank 0", gated_mib=1200.0)
    spec = parse_marker((), {"nproc": [2, 8], "launcher": "torchrun", "max_mib": 900.0, "rank": "all",
                             "tolerance": "max(5%, 32MiB)"}, Defaults())
    return TestRecord(test="t.py::test_x[a|b]", status="failed", cause="limit", spec=spec,
                      sizes=(size, predicted), provenance={"torch": "2.13.0"}, messages=("over",), notes=("n",),
                      baseline_changes=(BaselineChange(2, None, 812.5), BaselineChange(8, 800.0, 812.5)),
                      changed_since_baseline=("torch 2.12 -> 2.13",),
                      grown_sites=(SiteChange("t.py:7 f (all_gather)", 0.0, 256.0),
                                   SiteChange("m.py:18 forward", 16.0, 48.0, ("t.py:25 train", "t.py:40 main"), 2)),
                      grown_against="nproc=1",
                      sites_summary="1 site shrank by 2.0 MiB",
                      conversions=("S(0)->B at m.py:25 forward: +64.0 MiB at nproc=2 (none at nproc=1); "
                                   "to_global of (2048, 16384) float32, x3",))


def test_a_record_survives_json_unchanged():
    record = full_record()
    doc = json.loads(json.dumps(report_document([record])))
    assert doc["schema"] == SCHEMA == 4
    assert doc["tests"][0]["status"] == "failed" and doc["tests"][0]["cause"] == "limit"
    assert parse_report(doc) == [record]
    rank0 = doc["tests"][0]["sizes"][0]["allocated_ranks"]["0"]  # a fake GPU's prediction, keys that say what
    assert (rank0["predicted_device_mib"], rank0["margin_mib"], rank0["fits"]) == (1342.75, 79736.25, True)
    assert rank0["predicted_device_parts_mib"] == {"reserved": 512.0, "context": 530.5, "nccl": 300.25}


@pytest.mark.parametrize("ratio", [Ratio(flat=1.2), Ratio(sizes=((2, 0.6), (8, 0.3)))])
def test_a_ratio_flat_or_per_size_survives_json(ratio):
    spec = parse_marker((), {"nproc": [2, 8], "max_ratio": ratio.to_json() if ratio.flat else dict(ratio.sizes)},
                        Defaults())
    record = dataclasses.replace(full_record(), spec=spec)
    doc = json.loads(json.dumps(report_document([record])))
    assert doc["tests"][0]["limits"]["max_ratio"] == ratio.to_json()
    assert parse_report(doc) == [record]


def test_a_check_is_written_as_its_sentence_at_the_tests_digits_and_read_back_whole():
    record = full_record()
    check = json.loads(json.dumps(report_document([record])))["tests"][0]["sizes"][0]["checks"][1]
    assert list(check) == ["kind", "ok", "measured_mib", "limit_mib", "text", "figure", "advisory", "own", "making",
                           "reference_mib", "rank_label"]
    assert check["text"] == ("rank 1 (largest) at nproc=2 (gpu, simulated world): peak 812.5 MiB > baseline "
                             "650.0 MiB + 50 MiB = 700.0 MiB") == record.sizes[0].checks[1].text(record.digits)


def test_a_check_of_an_older_report_reads_as_the_sentence_it_stored():
    """A report written before a check carried its making: the sentence's parts make the check again."""
    doc = json.loads(json.dumps(report_document([full_record()])))
    for size in doc["tests"][0]["sizes"]:
        for check in size["checks"]:
            del check["making"], check["reference_mib"], check["rank_label"]
    sentences = [c["text"] for c in doc["tests"][0]["sizes"][0]["checks"]]
    record = parse_report(doc)[0]
    assert [c.text(record.digits) for c in record.sizes[0].checks] == sentences
    assert {c.rank_label for c in record.sizes[0].checks} == {"rank 1 (largest)"}


def test_what_a_record_derives_it_derives_from_its_checks_and_ranks():
    record = full_record()
    size = record.sizes[0]
    assert size.failed and not record.sizes[1].failed
    assert size.gated_method == "per-pid sampled"  # of rank 1, the gated one: an int, no label parsed
    assert [c.limit_mib for c in size.limits()] == [900.0, 700.0, 400.0]
    assert record.size_verdict(size) == "failed (limit)" and record.size_verdict(record.sizes[1]) == "ok"
    assert record.sizes[1].predicted and record.sizes[1].basis.startswith("predicted by a + b*N")
    xfailed = record.with_status("xfailed")
    assert xfailed.cause == "limit" and xfailed.size_verdict(record.sizes[1]) == "ok"
    assert record.with_status("xpassed").cause is None
    crashed = dataclasses.replace(record, cause="crash")  # nothing to say "ok" about: every size failed with it
    assert {crashed.size_verdict(s) for s in crashed.sizes} == {"failed (crash)"}


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.update(status="great"), "tests[0].status: expected one of passed, failed, skipped, xfailed, "
                                         "xpassed, measured, got 'great'"),
    (lambda t: t.update(cause="vibes"), "tests[0].cause: expected one of limit, crash, baseline-missing, "
                                        "baseline-error, xpass-strict (the status is failed), got 'vibes'"),
    (lambda t: t.update(status="passed"), "tests[0].cause: expected null (the status is passed), got 'limit'"),
    (lambda t: t["limits"].update(rank=-1), "tests[0].limits.rank: expected an integer >= 0 or 'all', got -1"),
    (lambda t: t["limits"].update(reference=0), "tests[0].limits.reference: expected an integer >= 1, got 0"),
    (lambda t: t["limits"].update(tolerance="lots"), "tests[0].limits.tolerance: "),
    (lambda t: t["sizes"][0].update(nproc=0), "tests[0].sizes[0].nproc: expected an integer >= 1, got 0"),
    (lambda t: t["sizes"][0].update(gated_rank="rank 1"), "tests[0].sizes[0].gated_rank: expected a rank number"),
    (lambda t: t["sizes"][0]["ranks"].update({"x": 1.0}), "tests[0].sizes[0].ranks: expected rank keys"),
    (lambda t: t["sizes"][0]["checks"][0].update(kind="vibes"), "tests[0].sizes[0].checks[0].kind: expected one of"),
    (lambda t: t["sizes"][0]["checks"][0].update(ok="yes"), "tests[0].sizes[0].checks[0].ok: expected true or false"),
    (lambda t: t["sizes"][0].update(timeline=[[0.0]]),
     "tests[0].sizes[0].timeline[0]: expected [seconds, {rank: MiB}]"),
    (lambda t: t.update(baseline_changes=[[2, "a", 1.0]]), "tests[0].baseline_changes[0]: expected [nproc, old MiB"),
    (lambda t: t["sizes"][0]["allocated_ranks"]["0"].update(predicted_device_parts_mib={"context": "big"}),
     "tests[0].sizes[0].allocated_ranks.0.predicted_device_parts_mib: expected an object from part to MiB"),
    (lambda t: t["sizes"][0]["allocated_ranks"]["0"].update(gpu_capacity_mib="80G"),
     "tests[0].sizes[0].allocated_ranks.0.gpu_capacity_mib: expected a finite number of MiB"),
    (lambda t: t["sizes"][0]["floor"].update(cached=20261201),
     "tests[0].sizes[0].floor.cached: expected a string or null, got 20261201"),
])
def test_every_bad_field_is_named_with_what_is_accepted(mutate, message):
    doc = json.loads(json.dumps(report_document([full_record()])))
    mutate(doc["tests"][0])
    with pytest.raises(ReportError) as caught:
        parse_report(doc)
    assert message in str(caught.value)


def test_a_record_sent_by_a_newer_plugin_is_refused_saying_which_schemas_are_read():
    for schema in (5, 3):  # a newer plugin's, or one never released
        with pytest.raises(ReportError, match=rf"schema: expected 4 \(a pytest --gpumem-report file of this "
                                              rf"pytest-gpumem\), got {schema}"):
            parse_report({"schema": schema, "tests": []})


def test_gpumem_diff_of_a_recorded_report_against_one_written_now(tmp_path, capsys):
    """The examples' recorded report against the same records written again by today's code."""
    from pytest_gpumem import cli

    old = load_report(DATA / "record_torch_ddp.json")
    new = tmp_path / "new.json"
    new.write_text(json.dumps(report_document(old)))
    assert json.loads(new.read_text())["schema"] == SCHEMA
    assert cli.main(["diff", str(DATA / "record_torch_ddp.json"), str(new)]) == 0
    assert "gpumem diff: " in capsys.readouterr().out


def test_every_per_rank_field_is_written_where_its_declaration_places_it():
    size = json.loads(json.dumps(report_document([full_record()])))["tests"][0]["sizes"][0]
    assert {key for f in PER_RANK for key in (f.json, f.methods) if key} <= set(size)
    assert {f.name for f in PER_RANK} <= {f.name for f in dataclasses.fields(SizeResult)}
