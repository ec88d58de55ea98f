"""The budget holds by measurement: export keeps what the measured bytes allow, resume keeps it,
merge and verify enforce the whole, report shows where it goes (docs/budget.md).

Cheap on 2 cores: the directories start from the encoder and HiFT keys of small_profile() that
command 1 built (tests/conftest.py seed_artifacts); the CFM keys never fit these budgets and are
never built. Memory is host RSS measured in fresh processes; budgets are chosen from a first
measurement with several MiB between what fits and what does not, against the 0.1-0.3 % the
measurement varies by (docs/budget.md).
"""
import dataclasses
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

import c2w.exporter.export as ex
from c2w.cli import app
from c2w.exporter.budget import Ledger, measurement_slack, record_load, recorded_ledger
from c2w.exporter.export import export_profile
from c2w.exporter.plan import make_plan, precision_weights
from c2w.exporter.report import render, summary
from c2w.runtime.manifest import Entry, Manifest, read_manifest
from c2w.runtime.memory import MeasureError, MeasureProcess, measure_directory
from c2w.runtime.model.weights import load_model
from tests.conftest import EXPORTED, EstimatedMemory, seed_artifacts, small_profile

runner = CliRunner()
MiB = 2**20
# small_profile()'s keys without the CFM, in plan order (priority steady > first)
ENC150, ENC200, HIFT58 = ("flow_encoder-B1-N28-C150-last0-float32", "flow_encoder-B1-N28-C200-last0-float32",
                          "hift-B1-F58-S3840-float32")
ENC100, HIFT50 = "flow_encoder-B1-N28-C100-last0-float32", "hift-B1-F50-S0-float32"
SMALL = [ENC150, ENC200, HIFT58, ENC100, HIFT50]


def _profile(budget: int):
    return dataclasses.replace(small_profile(), budget_bytes=int(budget))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The five encoder and HiFT keys exported with room for all of them (90 MiB; the CFM's 58 MiB
    of weights and 48-95 MiB estimates never fit): their measured bytes."""
    out = tmp_path_factory.mktemp("budget") / "all"
    model = load_model("random:tiny")
    planned = {e.key.id for e in make_plan(model.cfg, small_profile(), precision_weights(model, small_profile())).entries}
    seed_artifacts(EXPORTED, out, planned & set(SMALL))
    res = export_profile(_profile(90 * MiB), out)
    m = read_manifest(out)
    status = {e.id: e.status for e in m.entries}
    assert [k for k in status if status[k] == "built"] == SMALL, status
    assert {status[k] for k in status if k.startswith("cfm")} == {"skipped_budget"}
    assert res.failed == 0 and res.over_budget == 0
    return out, m


def _copy(measured, tmp_path):
    shutil.copytree(measured[0], tmp_path / "d")
    return tmp_path / "d"


def _fixed(m: Manifest, comp: str) -> int:
    return m.weight_bytes[comp] + m.engine_shared_bytes[comp]


def _partial_budget(m: Manifest) -> int:
    """Room for both steady encoder keys, then a gap that the first-chunk encoder key fits with
    half the gap to spare, and that neither HiFT key (with HiFT's weights and engine state) fits."""
    own = {e.id: e.device_bytes for e in m.entries}
    gap = (own[ENC100] + _fixed(m, "hift") + min(own[HIFT58], own[HIFT50])) // 2
    assert gap - own[ENC100] > 3 * MiB and _fixed(m, "hift") + min(own[HIFT58], own[HIFT50]) - gap > 3 * MiB
    return _fixed(m, "flow_encoder") + own[ENC150] + own[ENC200] + gap


def _greedy(m: Manifest) -> dict[str, str]:
    """What the recorded bytes allow, walking the plan order: kept while the running total fits."""
    total, in_use, out = 0, set(), {}
    for e in m.entries:
        if e.device_bytes is None:
            continue
        cost = e.device_bytes + (0 if e.component in in_use else _fixed(m, e.component))
        if total + cost <= m.budget_bytes:
            total, out[e.id] = total + cost, "built"
            in_use.add(e.component)
        else:
            out[e.id] = "over_budget"
    return out


def test_a_partial_budget_keeps_what_the_measurement_allows_and_resume_keeps_it(measured, tmp_path, monkeypatch):
    d, budget = _copy(measured, tmp_path), _partial_budget(measured[1])
    res = export_profile(_profile(budget), d)
    m = read_manifest(d)
    status = {e.id: e.status for e in m.entries}
    assert [k for k in SMALL if status[k] == "built"] == [ENC150, ENC200, ENC100]
    assert [k for k in SMALL if status[k] == "over_budget"] == [HIFT58, HIFT50]      # tried after the gap too
    assert (res.built, res.reused, res.over_budget, res.failed) == (0, 3, 2, 0)
    assert _greedy(m) == {k: status[k] for k in SMALL}
    for e in m.entries:
        if e.status == "over_budget":       # its artifact removed, its measurement and the reason kept
            assert e.artifact is None and e.device_bytes > 0 and "over budget" in e.error
    assert not (d / "onnxruntime" / f"{HIFT58}.onnx").exists() and (d / "onnxruntime" / f"{ENC100}.onnx").exists()
    # the directory measured together in a fresh process, and its parts adding up to it exactly
    total = m.measured.total_bytes
    assert total <= budget and m.measured.keys == 3
    ledger, unmeasured = recorded_ledger(m)
    assert ledger.total() == total and not unmeasured
    # measured again: within the stated tolerance of the record, under the budget by it
    again = measure_directory(d, m, "cpu")["total_bytes"]
    assert abs(again - total) <= measurement_slack(total) and again <= budget + measurement_slack(budget)

    # resume: the same keys, nothing built (the HiFT keys' recorded bytes still do not fit)
    monkeypatch.setattr(ex, "_build_group", lambda *a: pytest.fail("a resumed export rebuilt a key"))
    res = export_profile(_profile(budget), d)
    assert (res.built, res.reused, res.over_budget, res.failed) == (0, 3, 2, 0)
    assert {e.id: e.status for e in read_manifest(d).entries} == status


def test_a_built_key_that_does_not_fit_is_not_kept(measured, tmp_path):
    """The first-chunk encoder key is built afresh: its estimate fits the room left, its
    measurement does not; it is over budget and its artifact is gone."""
    d, m0 = _copy(measured, tmp_path), measured[1]
    own = {e.id: e.device_bytes for e in m0.entries}
    est = {e.id: e.est_bytes for e in m0.entries}
    room = (est[ENC100] + own[ENC100]) // 2
    assert room - est[ENC100] > 2 * MiB and own[ENC100] - room > 2 * MiB
    (d / "onnxruntime" / f"{ENC100}.onnx").unlink()
    res = export_profile(_profile(_fixed(m0, "flow_encoder") + own[ENC150] + own[ENC200] + room), d)
    m = read_manifest(d)
    e = m.by_id()[ENC100]
    assert e.status == "over_budget" and e.parity.passed and e.device_bytes > room, (e.status, e.error)
    assert e.artifact is None and not (d / "onnxruntime" / f"{ENC100}.onnx").exists()
    assert (res.built, res.reused, res.over_budget) == (0, 2, 3)
    assert m.measured.total_bytes <= m.budget_bytes


def test_the_fresh_measurement_cuts_only_the_key_that_takes_it_over(measured, tmp_path, monkeypatch):
    """As on the H200 (run 13a): a key that read small next to memory a released key left behind
    measures large in a fresh process. Only that key is cut; the keys after it are measured again
    without it and kept if they fit, and a key that no longer fits without the first (it now brings
    the graph pool itself) is cut in the next round. The sizes are faked, the cut logic is real."""
    import c2w.runtime.memory as memory
    from c2w.exporter.budget import fit_by_measurement
    d = _copy(measured, tmp_path)
    m = read_manifest(d)
    fixed = {c: 4 * MiB for c in m.weight_bytes}
    m.weight_bytes = dict(fixed)
    m.budget_bytes = 2 * 4 * MiB + 100 * MiB
    calls = []

    def fake_measure(out_dir, manifest, device):
        loaded = [e for e in manifest.entries if e.status == "built"]
        calls.append([e.id for e in loaded])
        ids = {e.id for e in loaded}
        size = {ENC150: 10, ENC200: 10, HIFT58: 90, ENC100: 10, HIFT50: 5 if HIFT58 in ids else 75}
        got = [(e, {"bytes": size[e.id] * MiB, "seconds": 0.1, "shared": {e.component: 0}}) for e in loaded]
        return {"kind": "host_anon", **memory.summarize(manifest.weight_bytes, got)}
    monkeypatch.setattr(memory, "measure_directory", fake_measure)
    cut = []
    dropped, error = fit_by_measurement(d, m, torch.device("cpu"), on_cut=lambda e: cut.append((e.id, len(calls))))
    assert error is None and [e.id for e in dropped] == [HIFT58, HIFT50]
    assert cut == [(HIFT58, 1), (HIFT50, 2)]                  # each cut reported before the next measurement
    assert calls == [SMALL, [ENC150, ENC200, ENC100, HIFT50], [ENC150, ENC200, ENC100]]
    status = {e.id: e.status for e in m.entries}
    assert [k for k in SMALL if status[k] == "built"] == [ENC150, ENC200, ENC100]
    assert "keys up to hift-B1-F58" in m.by_id()[HIFT58].error and "keys up to hift-B1-F50" in m.by_id()[HIFT50].error
    assert m.measured.total_bytes == 4 * MiB + 30 * MiB and m.measured.keys == 3
    assert [m.by_id()[k].device_bytes for k in (ENC150, ENC200, ENC100)] == [10 * MiB] * 3
    assert not list((d / "onnxruntime").glob("hift*")) and (d / "onnxruntime" / f"{ENC100}.onnx").exists()
    assert read_manifest(d).by_id()[HIFT50].status == "over_budget"      # written after each cut


def test_a_measurement_that_fails_after_a_cut_returns_the_cut_and_the_error(measured, tmp_path, monkeypatch):
    import c2w.runtime.memory as memory
    from c2w.exporter.budget import fit_by_measurement
    d = _copy(measured, tmp_path)
    m = read_manifest(d)
    m.weight_bytes, m.budget_bytes = {c: 0 for c in m.weight_bytes}, 50 * MiB
    rounds = []

    def fake_measure(out_dir, manifest, device):
        rounds.append(1)
        if len(rounds) > 1:
            raise MeasureError("the measurement process stopped (exit code -9)")
        got = [(e, {"bytes": 20 * MiB, "seconds": 0.1, "shared": {e.component: 0}})
               for e in manifest.entries if e.status == "built"]
        return {"kind": "host_anon", **memory.summarize(manifest.weight_bytes, got)}
    monkeypatch.setattr(memory, "measure_directory", fake_measure)
    dropped, error = fit_by_measurement(d, m, torch.device("cpu"))
    assert [e.id for e in dropped] == [HIFT58] and "exit code -9" in error       # 20 + 20 + 20 > 50
    assert m.measured.error == error and read_manifest(d).by_id()[HIFT58].status == "over_budget"


def test_verify_and_report_flag_a_manifest_edited_over_its_budget(measured, tmp_path):
    d = _copy(measured, tmp_path)
    path = d / "manifest.json"
    good = json.loads(path.read_text())
    total = good["measured"]["total_bytes"]
    assert "OVER BUDGET" not in render(read_manifest(d))

    # 8 MiB under: a fresh process measures the same directory within a few MiB of the recorded
    # total (once more than 2 MiB lower, on 2 busy cores), and verify allows max(2 %, 2 MiB) of that
    path.write_text(json.dumps({**good, "budget_bytes": total - 8 * MiB}))
    result = runner.invoke(app, ["verify", str(d)])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "FAIL over budget: the keys as the manifest records them add up to" in out
    assert "FAIL over budget: the directory measured in a fresh process" in out
    assert "8.0 MiB over" in out and "Re-run c2w export into this directory" in out
    assert "OVER BUDGET" in render(read_manifest(d)) and "**OVER BUDGET" in render(read_manifest(d), "markdown")

    # one key's recorded bytes edited up: the recorded check catches it (report, no measuring needed)
    edited = json.loads(json.dumps(good))
    next(e for e in edited["entries"] if e["id"] == HIFT50)["device_bytes"] += 20 * MiB
    path.write_text(json.dumps(edited))
    s = summary(read_manifest(d))
    assert s["over_budget"] and s["total_bytes"] == total + 20 * MiB > s["budget_bytes"]


def test_merge_holds_the_budget_of_the_whole_and_verify_measures_it(measured, tmp_path):
    """Two shards, each within the budget alone (encoder keys / HiFT keys); merged, the plan order
    keeps what fits the whole and leaves the rest uncopied; verify measures it in a fresh process."""
    src, m0 = measured
    budget = _partial_budget(m0)

    def shard(name, comp):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        d = json.loads((dst / "manifest.json").read_text())
        d["budget_bytes"] = budget
        for e in d["entries"]:
            if e["status"] == "built" and e["component"] != comp:
                (dst / e["artifact"]).unlink()
                e.update(status="pending", artifact=None, artifact_bytes=0, artifact_sha256="", parity={})
        (dst / "manifest.json").write_text(json.dumps(d))
        assert recorded_ledger(read_manifest(dst))[0].total() <= budget          # this shard alone fits
        return dst
    result = runner.invoke(app, ["merge", str(tmp_path / "all"), str(shard("s1", "flow_encoder")),
                                 str(shard("s2", "hift"))])
    assert result.exit_code == 0 and "2 keys over the budget of the whole" in result.output, result.output
    m = read_manifest(tmp_path / "all")
    status = {e.id: e.status for e in m.entries}
    assert [k for k in SMALL if status[k] == "built"] == [ENC150, ENC200, ENC100]
    assert [k for k in SMALL if status[k] == "over_budget"] == [HIFT58, HIFT50]
    assert not list((tmp_path / "all" / "onnxruntime").glob("hift*")) and m.measured is None
    assert "has not been measured together" in render(m)
    result = runner.invoke(app, ["verify", str(tmp_path / "all")])
    assert result.exit_code == 0 and "budget: measured together in a fresh process" in result.output, result.output


def _unmeasured_shard(src, dst, comp, budget):
    """A copy of `src` as a `--measure-at-merge` shard that built the `comp` keys (None: all)
    writes it: built keys without device bytes, no engine state, not measured."""
    shutil.copytree(src, dst)
    d = json.loads((dst / "manifest.json").read_text())
    d.update(budget_bytes=budget, engine_shared_bytes={}, measured={})
    for e in d["entries"]:
        if e["status"] == "built" and comp not in (None, e["component"]):
            (dst / e["artifact"]).unlink()
            e.update(status="pending", artifact=None, artifact_bytes=0, artifact_sha256="", parity={})
        e.update(device_bytes=None, memory_kind="")
    (dst / "manifest.json").write_text(json.dumps(d))
    return dst


def test_merge_measures_what_shards_left_unmeasured_and_keeps_what_fits(measured, tmp_path):
    """Shards exported with --measure-at-merge (parallel on one GPU) measured nothing; the merge
    loads each built key in plan order next to the kept ones, keeps what fits (the next key is
    tried after one that does not), drops the rest with its files, and records the directory
    measured together: the same keys as a budget-holding export of the whole keeps."""
    src, m0 = measured
    budget = _partial_budget(m0)
    shards = [_unmeasured_shard(src, tmp_path / "s1", "flow_encoder", budget),
              _unmeasured_shard(src, tmp_path / "s2", "hift", budget)]
    result = runner.invoke(app, ["merge", str(tmp_path / "all"), *map(str, shards)])
    assert result.exit_code == 0 and "0 keys over the budget of the whole by the shards' measurements" in result.output
    assert "measured together in a fresh process (host_anon)" in result.output, result.output
    assert "2 more keys over the budget by the merge's measurement (0 of them cut by a fresh process)" in \
        " ".join(result.output.split()), result.output
    # a line per key as it is measured, in plan order, with its load time (recorded on the entry)
    lines = [ln for ln in result.output.splitlines() if ln.startswith("measured ") and "/5 " in ln]
    assert [ln.split()[2].rstrip(":") for ln in lines] == SMALL, result.output
    assert [", over budget;" in ln for ln in lines] == [k in (HIFT58, HIFT50) for k in SMALL], result.output
    m = read_manifest(tmp_path / "all")
    status = {e.id: e.status for e in m.entries}
    assert [k for k in SMALL if status[k] == "built"] == [ENC150, ENC200, ENC100]
    assert [k for k in SMALL if status[k] == "over_budget"] == [HIFT58, HIFT50]
    assert not list((tmp_path / "all" / "onnxruntime").glob("hift*"))
    assert m.measured.keys == 3 and m.measured.total_bytes <= budget
    assert all(e.device_bytes is not None and e.memory_kind == "host_anon" for e in m.entries if e.status == "built")
    assert all(e.extra["load_seconds"] > 0 for e in m.entries if e.status == "built")
    assert m.measured.load_seconds > 0      # of the second process, which held only the kept keys
    assert recorded_ledger(m)[0].total() <= budget
    result = runner.invoke(app, ["verify", str(tmp_path / "all")])
    assert result.exit_code == 0 and "budget: measured together in a fresh process" in result.output, result.output


def test_merge_names_each_key_the_fresh_measurement_cuts(measured, tmp_path, monkeypatch):
    """The merge's running total keeps the first-chunk encoder key; the fresh process (faked here to
    read it 40 MiB larger; on the H200 a B=32 HiFT key read ~960 MiB more there than next to the
    released keys, run 13a) takes the total over, so it is cut, and the merge says which key and why."""
    import c2w.runtime.memory as memory
    src, m0 = measured
    budget = _partial_budget(m0)
    real = memory.measure_directory

    def fresh(out_dir, manifest, device):
        got = real(out_dir, manifest, device)
        extra, rows = 0, []
        for key_id, own, total in got["per_key"]:
            extra += 40 * MiB if key_id == ENC100 else 0
            rows.append([key_id, own + (40 * MiB if key_id == ENC100 else 0), total + extra])
        return {**got, "per_key": rows, "key_bytes": got["key_bytes"] + extra, "total_bytes": got["total_bytes"] + extra}
    monkeypatch.setattr(memory, "measure_directory", fresh)
    shards = [_unmeasured_shard(src, tmp_path / "s1", "flow_encoder", budget),
              _unmeasured_shard(src, tmp_path / "s2", "hift", budget)]
    result = runner.invoke(app, ["merge", str(tmp_path / "all"), *map(str, shards)])
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "3 more keys over the budget by the merge's measurement (1 of them cut by a fresh process)" in out
    assert (f"cut by the fresh-process measurement: {ENC100} (over budget: the directory measured" in out
            and f"in a fresh process with the keys up to {ENC100}" in out and "measuring the rest again" in out)
    m = read_manifest(tmp_path / "all")
    assert [e.id for e in m.entries if e.status == "built"] == [ENC150, ENC200]
    assert m.measured.keys == 2 and m.measured.total_bytes <= budget


def test_a_shard_that_measures_at_merge_starts_no_measurement_and_keeps_by_estimate(measured, tmp_path, monkeypatch):
    import c2w.runtime.memory

    class NoMeasuring:
        def __init__(self, *a, **kw):
            raise AssertionError("a --measure-at-merge shard started a measurement process")
    monkeypatch.setattr(c2w.runtime.memory, "MeasureProcess", NoMeasuring)
    d = _unmeasured_shard(measured[0], tmp_path / "s1", None, 90 * MiB)
    res = export_profile(_profile(90 * MiB), d, shard=(2, 2), measure=False)
    m = read_manifest(d)
    built = [e for e in m.entries if e.status == "built"]
    assert [e.id for e in built] == SMALL and res.reused == 5 and res.exit_code == 0
    assert all(e.device_bytes is None for e in built) and m.measured is None and m.engine_shared_bytes == {}


def test_measure_at_merge_needs_a_sharded_export():
    result = runner.invoke(app, ["export", "--profile", "cpu", "--measure-at-merge"])
    assert result.exit_code == 2 and "--measure-at-merge" in result.output and "--shard K/N" in result.output


def test_a_key_whose_measurement_fails_is_failed_and_the_export_exits_1(measured, tmp_path, monkeypatch):
    import c2w.runtime.memory

    class FailsOnHift(EstimatedMemory):
        def add(self, entry):
            if entry.id == HIFT58:
                raise c2w.runtime.memory.MeasureError("the engine's load crashed (stand-in)")
            return {"bytes": entry.device_bytes or 0, "shared": {}, "seconds": 0.0}
    monkeypatch.setattr(c2w.runtime.memory, "MeasureProcess", FailsOnHift)
    d = _copy(measured, tmp_path)
    res = export_profile(_profile(90 * MiB), d)
    e = read_manifest(d).by_id()[HIFT58]
    assert e.status == "failed" and "measuring its memory failed: the engine's load crashed" in e.error
    assert (res.reused, res.failed, res.exit_code) == (4, 1, 1)


def test_the_measurement_process_reports_its_own_failure(measured):
    bad = dataclasses.replace(measured[1], model=dataclasses.replace(measured[1].model, spec="random:nope"))
    with pytest.raises(MeasureError, match="model preset: received .nope."):
        MeasureProcess(measured[0], bad, "cpu")


# ---------------------------------------------------------------------------------- arithmetic

def _entry(key_id, comp, nbytes, status="built"):
    return Entry(id=key_id, component=comp, dims={"B": 1}, dtype="float32", category="steady", status=status,
                 device_bytes=nbytes)


def test_ledger_counts_weights_and_engine_state_once_per_component():
    led = Ledger(budget=100, weight_bytes={"a": 30, "b": 5}, shared={"a": 10})
    assert led.cost("a", 20) == 60 and led.fits("a", 60) and not led.fits("a", 61)    # equal to the budget fits
    led.keep(_entry("a1", "a", 20))
    assert led.total() == 60 and led.cost("a", 20) == 20 and led.cost("b", 1) == 6
    led.keep(_entry("a2", "a", 20))
    assert led.total() == 80 and not led.fits("b", 16) and led.fits("b", 15)
    assert "its 0.0 MiB + 0.0 MiB of b weights and engine state" in led.over_budget_reason(_entry("b1", "b", 16))


def test_a_version_1_manifest_is_read_with_its_peak_numbers_dropped(measured, tmp_path):
    d = _copy(measured, tmp_path)
    v1 = json.loads((d / "manifest.json").read_text())
    v1["format_version"] = 1
    for k in ("engine_shared_bytes", "measured"):
        del v1[k]
    (d / "manifest.json").write_text(json.dumps(v1))
    m = read_manifest(d)
    assert m.format_version == 2 and all(e.device_bytes is None for e in m.entries)
    assert recorded_ledger(m)[1] == SMALL and "5 built keys have no measurement" in render(m)


def test_measurement_slack_is_two_percent_with_a_floor_of_two_mib():
    """Part of the measurement noise is absolute (~1 MiB on the CPU beside other processes), so a
    small directory gets 2 MiB of slack and a large one 2 % of its size."""
    from c2w.exporter.budget import MEASURE_FLOOR_BYTES
    assert measurement_slack(47 * MiB) == MEASURE_FLOOR_BYTES == 2 * MiB
    assert measurement_slack(10 * 2**30) == pytest.approx(0.02 * 10 * 2**30)


def test_a_load_records_its_time_and_on_cuda_its_memory_split():
    """What the estimate is fitted to: each measured key's bytes split as the device reading split
    them (CUDA replies carry the split; host ones do not, and record none)."""
    cuda, host = _entry("a", "cfm", None), _entry("b", "hift", None)
    cuda.extra = {"cfm_step": True}
    record_load(cuda, {"bytes": 6 << 20, "allocated": 4 << 20, "pool": 2 << 20, "outside": 0, "shared": {},
                       "seconds": 0.5})
    record_load(host, {"bytes": 3 << 20, "shared": {}, "seconds": 0.25})
    assert cuda.extra == {"cfm_step": True, "load_seconds": 0.5,
                          "memory_split": {"allocated": 4 << 20, "pool": 2 << 20, "outside": 0}}
    assert host.extra == {"load_seconds": 0.25}
