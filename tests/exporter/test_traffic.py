"""Traffic-weighted selection: calls per session, timings, ranking, prediction, profile errors."""
import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from c2w.cli import app
from c2w.exporter.bench.engines import bench_traffic, calibration
from c2w.exporter.flops import unit_flops
from c2w.exporter.plan import make_plan, precision_weights
from c2w.exporter.profile import Traffic, load_profile, parse_profile
from c2w.exporter.traffic import key_timings, session_calls, usage
from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.weights import load_model
from c2w.runtime.units import ShapeKey
from tests.conftest import small_profile

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def _profile(batch_sizes=(1, 2), max_chunks=4, **kw):
    p = small_profile()
    return dataclasses.replace(p, schedule=dataclasses.replace(p.schedule, batch_sizes=batch_sizes,
                                                               max_chunks=max_chunks), **kw)


def _cfm(B, L, T=50):
    return ShapeKey("cfm", (B, T, L), "float32")


def _priority_rate(model, profile, tr, plan) -> float:
    """The hit rate of a plan made without traffic, under traffic `tr` (computed independently)."""
    use = usage(model.cfg, dataclasses.replace(profile, traffic=tr), [e.key for e in plan.entries])
    return use.predict([e.key for e in plan.selected]).hit_rate


def test_calls_per_session_follow_the_stream(tiny):
    # B=1, 28-token chunks (T=50 frames, P=100): half the sessions have 1 chunk, half 3, then a
    # 13-token final chunk; each sets up its prompt once
    tr = Traffic(batch_sizes=((1, 1.0),), chunk_tokens=((28, 1.0),), session_chunks=((1, 0.5), (3, 0.5)),
                 tail_tokens=((13, 1.0),))
    calls, total = session_calls(tiny.cfg, _profile(traffic=tr))
    assert total == pytest.approx(2 + 0.5 * 3 + 0.5 * 9 + 3)
    assert calls[_cfm(1, 0, T=100)] == calls[ShapeKey("flow_encoder", (1, 53, 0, 0), "float32")] == 1.0  # set-up
    assert calls[_cfm(1, 100)] == 1.0                     # first chunk: every session
    assert calls[_cfm(1, 150)] == 0.5                     # second chunk: the 3-chunk sessions, once
    assert calls[_cfm(1, 200)] == 0.5                     # third chunk (cache trimmed to P + 100 after)
    # the final chunk after 1 chunk sees L=150, after 3 chunks the trimmed L=200
    assert calls[_cfm(1, 150, T=26)] == calls[_cfm(1, 200, T=26)] == 0.5
    assert calls[ShapeKey("hift", (1, 34, 3840), "float32")] == 1.0
    # without final-chunk sizes the final chunk still happens: 3 calls no key can serve
    _, total = session_calls(tiny.cfg, _profile(traffic=dataclasses.replace(tr, tail_tokens=())))
    assert total == pytest.approx(2 + 0.5 * 3 + 0.5 * 9 + 3)


def test_the_key_every_steady_chunk_hits_wins_over_the_once_per_stream_key(tiny):
    """The h200 case at the tiny model's P=100: the CFM key at L=150 is hit once per stream (the
    second chunk), the one at L=200 by every later chunk. Room for one of them: the priority
    order (small dims first) takes L=150, the traffic the L=200 key."""
    p = _profile(batch_sizes=(1,))
    w = precision_weights(tiny, p)
    full = make_plan(tiny.cfg, p, w)
    est = {e.key: e.est_bytes for e in full.entries}
    others = sum(b for k, b in est.items() if k.component != "cfm")
    p = dataclasses.replace(p, budget_bytes=sum(w.values()) + others + est[_cfm(1, 200)] + (1 << 20))
    by_priority = make_plan(tiny.cfg, p, w)
    assert [e.key for e in by_priority.selected if e.key.component == "cfm"] == [_cfm(1, 150)]
    tr = Traffic(batch_sizes=((1, 1.0),), chunk_tokens=((28, 1.0),), session_chunks=((10, 1.0),))
    plan = make_plan(tiny.cfg, dataclasses.replace(p, traffic=tr), w)
    assert [e.key for e in plan.selected if e.key.component == "cfm"] == [_cfm(1, 200)]
    calls = {e.key: e.calls_per_session for e in plan.entries}
    assert (calls[_cfm(1, 150)], calls[_cfm(1, 200)]) == (1.0, 8.0)
    assert plan.planned_total() <= p.budget_bytes
    # every non-CFM key is kept either way; the traffic's choice serves 7 more CFM calls per session
    assert plan.prediction.hit_rate - _priority_rate(tiny, p, tr, by_priority) == pytest.approx(7 / 35)


def test_traffic_beats_priority_on_a_tight_budget(tiny):
    """Stated mix: 80 % of sessions at B=2, half of them 2 chunks long, half 12; 300 MiB for a
    sweep whose keys and weights need 737 MiB. The priority order fills B=1 keys first."""
    tr = Traffic(batch_sizes=((1, 0.2), (2, 0.8)), chunk_tokens=((28, 1.0),), session_chunks=((2, 0.5), (12, 0.5)))
    p = _profile(budget_bytes=300 << 20)
    w = precision_weights(tiny, p)
    by_priority = make_plan(tiny.cfg, p, w)
    plan = make_plan(tiny.cfg, dataclasses.replace(p, traffic=tr), w)
    old = _priority_rate(tiny, p, tr, by_priority)
    assert plan.baseline.hit_rate == pytest.approx(old)          # the plan's own comparison agrees
    assert plan.prediction.hit_rate == pytest.approx(0.692, abs=0.005)
    assert old == pytest.approx(0.585, abs=0.005)
    assert plan.prediction.saved_ms_per_session > 5 * plan.baseline.saved_ms_per_session
    assert max(plan.planned_total(), by_priority.planned_total()) <= p.budget_bytes
    # same keys, another order: only the selection differs
    assert sorted(e.key for e in plan.entries) == sorted(e.key for e in by_priority.entries)


def test_without_traffic_the_priority_order_stays(tiny):
    p = _profile(budget_bytes=300 << 20)
    plan = make_plan(tiny.cfg, p, precision_weights(tiny, p))
    assert plan.prediction is None and all(e.calls_per_session is None for e in plan.entries)
    cats = [e.category for e in plan.entries]
    assert cats == sorted(cats, key=["steady", "first"].index)
    assert [e.key.dims[0] for e in plan.entries if e.category == "steady"] == [1] * 5 + [2] * 5


def _bench_result(p, rows):
    return {"device": "cpu", "backend": {"name": p.backend, "version": "x"},
            "model": {"spec": "random:tiny", "digest": "d", "config": "tiny"},
            "precision": dataclasses.asdict(p.precision), "torch": torch.__version__, "commit": "c", "date": "now",
            "keys": [{"id": k.id, "component": k.component, "dims": dict(zip(("B", "T", "L"), k.dims)),
                      "dtype": k.dtype, "eager": {"median_ms": e}, "engine": {"median_ms": g},
                      "served_variant": "engine"} for k, e, g in rows]}


def test_calibration_timings_measured_then_fitted_per_component(tiny, tmp_path):
    p = _profile()
    a, b = _cfm(1, 100), _cfm(2, 200)
    fa, fb = unit_flops(tiny.cfg, a), unit_flops(tiny.cfg, b)
    cal = calibration(_bench_result(p, [(a, 100.0, 10.0), (b, 150.0, 20.0)]))
    cal["keys"].append({"key": {"component": "cfm", "B": 1, "T": 50, "L": 150, "dtype": "float32"}})  # no times
    f = tmp_path / "calibration.json"
    f.write_text(json.dumps(cal))
    tr = Traffic(batch_sizes=((1, 1.0),), chunk_tokens=((28, 1.0),), session_chunks=((4, 1.0),), calibration=str(f))
    with pytest.raises(C2WUserError, match=r"keys\[2\]: received eager_ms None, engine_ms None; expected positive"):
        key_timings(tiny.cfg, [a], dataclasses.replace(p, traffic=tr))
    del cal["keys"][2]
    f.write_text(json.dumps(cal))
    mid, hift = _cfm(1, 150), ShapeKey("hift", (1, 58, 3840), "float32")
    t, source = key_timings(tiny.cfg, [a, b, mid, hift], dataclasses.replace(p, traffic=tr))
    assert (t[a].eager_ms, t[a].engine_ms, t[a].source) == (100.0, 10.0, "measured")
    fm = unit_flops(tiny.cfg, mid)                  # on the line through the two measured keys
    assert t[mid].eager_ms == pytest.approx(100 + 50 * (fm - fa) / (fb - fa))
    assert t[mid].engine_ms == pytest.approx(10 + 10 * (fm - fa) / (fb - fa)) and t[mid].source == "fitted"
    # HiFT was not measured: the timing model, said so in the source line
    assert t[hift].source == "model" and t[hift].saved_ms == pytest.approx(
        unit_flops(tiny.cfg, hift) / 0.02e12 * 1e3 * (1 - 1 / 3))
    assert "2 keys measured" in source and "hift: timing model" in source
    # timings of another set-up are refused
    for field, value, what in (("device", "NVIDIA H200", "device type"), ("precision", {"cfm": "float16"}, "precision"),
                               ("format", "other", "format")):
        f.write_text(json.dumps({**cal, field: value}))
        with pytest.raises(C2WUserError, match=what):
            key_timings(tiny.cfg, [a], dataclasses.replace(p, traffic=tr))


BASE = {"batch_sizes": {1: 0.5, 2: 0.5}, "chunk_tokens": {28: 1.0}, "session_chunks": {4: 0.5, 10: 0.5}}


@pytest.mark.parametrize("traffic, schedule, match", [
    ([1, 2], {}, r"'traffic': received list \[1, 2\]; expected a mapping"),
    ({**BASE, "batch_share": {1: 1.0}}, {}, r"unknown key\(s\) \['batch_share'\]"),
    ({k: v for k, v in BASE.items() if k != "session_chunks"}, {}, r"received no \['session_chunks'\]"),
    ({**BASE, "batch_sizes": {1: 0.5, 2: 0.4}}, {}, r"traffic.batch_sizes': received shares summing to 0.9; "
                                                    r"expected shares summing to 1"),
    ({**BASE, "batch_sizes": {"one": 1.0}}, {}, r"received sizes \['one'\]; expected integers >= 1"),
    ({**BASE, "chunk_tokens": {2: 1.0}}, {}, r"traffic.chunk_tokens': received sizes \[2\]; expected integers >= 4"),
    ({**BASE, "session_chunks": {4: -0.5, 8: 1.5}}, {}, r"received shares \{4: -0.5\}; expected numbers >= 0"),
    ({**BASE, "session_chunks": {}}, {}, r"received \{\}; expected a mapping of sizes to shares"),
    ({**BASE, "session_chunks": {100000: 1.0}}, {}, r"a session of 100000 chunks; expected at most 10000"),
    (BASE, {"tail_tokens": [13]}, r"traffic.tail_tokens': received nothing; expected the shares of final-chunk sizes"),
    ({**BASE, "engine_speedup": 0.5}, {}, r"engine_speedup': received 0.5; expected a number > 1"),
    ({**BASE, "calibration": "nowhere.json"}, {}, r"calibration': received 'nowhere.json' \(no file at"),
])
def test_bad_traffic_sections_are_clear_errors(traffic, schedule, match, tmp_path):
    with pytest.raises(C2WUserError, match=match):
        parse_profile({"traffic": traffic, "schedule": schedule}, str(tmp_path / "p.yaml"))


def test_bundled_gpu_profiles_declare_traffic():
    for name in ("h200", "h100"):
        tr = load_profile(name).traffic
        assert tr is not None and abs(sum(s for _, s in tr.batch_sizes) - 1) < 1e-9
    assert load_profile("h200").traffic.calibration.endswith("profiles/h200.calibration.json")
    assert load_profile("cpu").traffic is None


def test_plan_prints_the_predicted_hit_rate(tmp_path, tiny):
    f = tmp_path / "t.yaml"
    f.write_text("budget_bytes: 300MiB\nschedule: {prompt_frames: 100, batch_sizes: [1, 2], max_chunks: 4, "
                 "setup_keys: false}\ntraffic:\n  batch_sizes: {1: 0.2, 2: 0.8}\n  chunk_tokens: {28: 1.0}\n"
                 "  session_chunks: {2: 0.5, 12: 0.5}\n")
    result = runner.invoke(app, ["plan", "--profile", str(f)])
    assert result.exit_code == 0, result.output
    p = load_profile(f)
    plan = make_plan(tiny.cfg, p, precision_weights(tiny, p))
    line = next(x for x in result.output.splitlines() if x.startswith("traffic:"))
    assert f"hit rate {plan.prediction.hit_rate:.1%} of 26.0 unit calls" in line
    assert f"(priority order: {plan.baseline.hit_rate:.1%}," in line
    assert "timing model: eager at 0.02 TFLOP/s" in result.output
    # ranked first: the B=2 steady CFM key, hit by chunks 3-12 of the 12-chunk sessions: 0.8 x 0.5 x 10
    first = next(x for x in result.output.splitlines() if x.startswith("  cfm"))
    assert "B=2 T=50 L=200" in first and "calls   4.000" in first and first.endswith("build")


@pytest.mark.slow
def test_bench_measures_the_hit_rate_the_planner_predicts(ort_artifacts):
    """A session through the real driver and the directory's engines: its two chunks' keys (first,
    then steady with grown caches) are built, the set-up's and the final chunk's are not. The
    measured share of engine calls is the planner's prediction: 6 of 2 + 2 x 3 + 3. The profile
    gives the mix only: its other prompt length is overridden by the one the artifacts were built for."""
    tr = Traffic(batch_sizes=((1, 1.0),), chunk_tokens=((28, 1.0),), session_chunks=((2, 1.0),),
                 tail_tokens=((13, 1.0),))
    p = small_profile()
    p = dataclasses.replace(p, schedule=dataclasses.replace(p.schedule, prompt_frames=300), traffic=tr)
    res = bench_traffic(ort_artifacts, p)
    assert [(r["chunks"], r["engine_calls"], r["eager_calls"]) for r in res["sessions"]] == [(2, 6, 5)]
    assert res["measured_hit_rate"] == pytest.approx(6 / 11, abs=1e-12)
    assert res["predicted_hit_rate"] == pytest.approx(6 / 11, abs=1e-12)


def test_bench_traffic_needs_a_profile_with_traffic(ort_artifacts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["bench", str(ort_artifacts), "--traffic", "--profile", "cpu"])
    assert result.exit_code == 2
    assert "--traffic: received profile" in result.output and "without a traffic section" in result.output
    assert not (ort_artifacts / "bench.json").exists()


@pytest.mark.slow
def test_traffic_order_beats_priority_order_in_the_measured_hit_rate(tmp_path, tiny, aoti_without_compile,
                                                                     measured_as_estimated):
    """A stated mix (80 % of sessions at B=2; half of them 2 chunks long, half 4) and 250 MiB,
    exported in each order (AOTI packages stood in for by saved programs, memory measured as
    estimated; the traffic directory starts from a copy of the priority one, so the keys both
    keep are built once) and served: one session of each kind through each directory's engines.
    Each directory's measured hit rate is its plan's prediction, and the traffic order's is the
    higher (0.50 against 0.27), as is its saved time, the quantity it ranks by."""
    import shutil

    from c2w.exporter.export import export_profile
    tr = Traffic(batch_sizes=((1, 0.2), (2, 0.8)), chunk_tokens=((28, 1.0),), session_chunks=((2, 0.5), (4, 0.5)))
    p = _profile(budget_bytes=250 << 20, backend="aoti")
    plan = make_plan(tiny.cfg, dataclasses.replace(p, traffic=tr), precision_weights(tiny, p))
    rates = {}
    for name, profile in (("priority", p), ("traffic", dataclasses.replace(p, traffic=tr))):
        if name == "traffic":
            shutil.copytree(tmp_path / "priority", tmp_path / name)
        res = export_profile(profile, tmp_path / name)
        assert res.failed == 0, [e.error for e in res.manifest.entries if e.error]
        got = bench_traffic(tmp_path / name, dataclasses.replace(p, traffic=tr))
        assert got["measured_hit_rate"] == pytest.approx(got["predicted_hit_rate"], abs=1e-9), name
        rates[name] = got["measured_hit_rate"]
    built = {e.id for e in res.manifest.entries if e.status == "built"}
    assert built == {e.key.id for e in plan.selected}                    # the traffic plan's keys, no more
    assert plan.prediction.hit_rate == pytest.approx(rates["traffic"], abs=1e-9)
    assert plan.baseline.hit_rate == pytest.approx(rates["priority"], abs=1e-9)
    assert rates["traffic"] == pytest.approx(0.50, abs=0.005) and rates["priority"] == pytest.approx(0.271, abs=0.005)
    assert plan.prediction.saved_ms_per_session > plan.baseline.saved_ms_per_session
