"""Every backend goes through the same export loop (exporter/export.py): one test, three backends.

An export is interrupted when its second artifact starts, after one artifact is built; the
manifest then lists that artifact's keys as `built` and the rest as `pending`. The same command
resumes: it keeps the built artifact (same file, not rebuilt) and calls the backend's builder for
the missing artifacts only; a third run builds nothing. Memory is not measured (each key costs
its estimate: `measured_as_estimated`), and each backend's profile has a budget with room for two
artifacts, the cheapest to build on this machine (the other keys are `skipped_budget`):

- ONNX Runtime: two encoder keys, exported for real. The first one starts as command 1 built
  it into artifacts/cpu (tests/conftest.seed_artifacts; an ONNX export is ~15 s on 2 busy
  cores), so the interrupted export keeps it without building it; where that directory lacks
  it, the interrupted export builds it first.
- AOTInductor: the same two keys. Compiling a package is ~3 minutes of C++ on 2 cores, so the
  compile step is a stand-in (`aoti_without_compile`): the builder's own code runs (export to an
  ExportedProgram, configs, the static-libstdc++ check of the package) and the "package" is that
  ExportedProgram, saved. The runtime's own AOTI loader loads it, through a stand-in of
  `torch._inductor.aoti_load_package` that runs the program with the constants the loader binds
  (the eager model's shared weights, by FQN, after its layout check), so parity is a real
  comparison of what was saved against eager; it says nothing about Inductor's kernels.
- TensorRT: the two HiFT keys, one plan per graph variant each (the encoder's three keys share
  one plan). The SDK, the plan build and the plan's engine are the stand-ins of
  backends/test_tensorrt.py (the engine runs the plan's ONNX graph in ONNX Runtime at the key's
  profile). The graph export is a stand-in too (`tensorrt_graphs_from_command1`): instead of the
  dynamic-dim export (~30 s a graph here), the builder gets the static B=1 graph ONNX Runtime's
  builder made of the same unit (artifacts/cpu, from the README's command 1; exported here when
  that directory lacks it). The compatibility check and everything else of the builder run.
"""
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

import c2w.exporter.backends.aoti as aoti
import c2w.exporter.backends.tensorrt as tensorrt_builder
import c2w.exporter.export as ex
from c2w.exporter.backends import get_builder
from c2w.exporter.export import ExportInterrupted, artifact_groups, export_profile
from c2w.exporter.plan import make_plan, precision_weights
from c2w.runtime.manifest import file_problem, read_manifest
from c2w.runtime.model.weights import load_model
from tests.conftest import EXPORTED, seed_artifacts, small_profile
from tests.exporter.test_export import _stop_after
from tests.exporter.backends.test_tensorrt import install_fake_tensorrt

ENC150, ENC200 = "flow_encoder-B1-N28-C150-last0-float32", "flow_encoder-B1-N28-C200-last0-float32"
HIFT58, HIFT50 = "hift-B1-F58-S3840-float32", "hift-B1-F50-S0-float32"
# per backend: the keys its profile has room for, in plan order (one artifact each)
KEYS = {"onnxruntime": [ENC150, ENC200], "aoti": [ENC150, ENC200], "tensorrt": [HIFT58, HIFT50]}


@pytest.fixture(scope="module")
def command1_graphs(tmp_path_factory) -> tuple[Path, dict]:
    """Intact copies of the B=1 HiFT graphs and weights files command 1 exported into
    artifacts/cpu (tests/conftest.seed_artifacts), and their manifest entries by id; no entries
    where that directory lacks them."""
    store = tmp_path_factory.mktemp("command1")
    if not seed_artifacts(EXPORTED, store, {HIFT58, HIFT50}):
        return store, {}
    return store, read_manifest(store).by_id()


@pytest.fixture
def tensorrt_graphs_from_command1(monkeypatch, command1_graphs):
    """The TensorRT stand-ins, and a graph export that hands the builder the static B=1 ONNX graph
    of the group's key (see the module docstring)."""
    install_fake_tensorrt(monkeypatch)
    store, entries = command1_graphs
    key_of = {"hift-F58-cached-float32": HIFT58, "hift-F50-float32": HIFT50}
    real_export = tensorrt_builder.export_onnx

    def export(unit, inputs, input_names, output_names, path, **dynamic):
        e = entries.get(key_of[path.stem])
        if e is None:
            return real_export(unit, [t[:1] for t in inputs], input_names, output_names, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(store / e.artifact, path)
        for rel in e.extra["weights_files"]:
            dst = path.parent / Path(rel).relative_to(Path(e.artifact).parent)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(store / rel, dst)
    monkeypatch.setattr(tensorrt_builder, "export_onnx", export)


@pytest.fixture
def onnxruntime_first_key_from_command1(tmp_path) -> int:
    """Seeds the ONNX Runtime export's directory with the first key command 1 built; returns how
    many keys that put there (0 without artifacts/cpu)."""
    return seed_artifacts(EXPORTED, tmp_path / "onnxruntime", {KEYS["onnxruntime"][0]})


# per backend: the fixture installing its stand-ins, or seeding its directory (returns the count)
STAND_INS = {"onnxruntime": "onnxruntime_first_key_from_command1", "aoti": "aoti_without_compile",
             "tensorrt": "tensorrt_graphs_from_command1"}


def _profile(backend: str):
    """small_profile() on `backend` with room for the estimates of KEYS[backend] only."""
    p = dataclasses.replace(small_profile(), backend=backend, name=f"loop-{backend}")
    model = load_model(p.model)
    weights = precision_weights(model, p)
    plan = make_plan(model.cfg, p, weights, shares_weights=True)
    room = [e for e in plan.entries if e.key.id in KEYS[backend]]
    budget = sum(weights[c] for c in {e.key.component for e in room}) + sum(e.est_bytes for e in room)
    p = dataclasses.replace(p, budget_bytes=budget)
    groups = artifact_groups(get_builder(backend), make_plan(model.cfg, p, weights, shares_weights=True))
    assert [pk.key.id for _, pks in groups for pk in pks] == KEYS[backend]
    return p, [name for name, _ in groups]


def _count_builds(monkeypatch, backend: str) -> list[str]:
    """The groups the backend's builder is asked to build, in order."""
    cls = type(get_builder(backend))
    real = cls.build

    def build(self, job):
        calls.append(job.group)
        return real(self, job)
    calls = []
    monkeypatch.setattr(cls, "build", build)
    return calls


@pytest.mark.parametrize("backend", list(STAND_INS))
def test_interrupted_export_keeps_what_it_built_and_resume_builds_only_the_rest(
        backend, tmp_path, monkeypatch, request, measured_as_estimated):
    seeded = request.getfixturevalue(STAND_INS[backend]) or 0
    profile, (first, second) = _profile(backend)
    first_key, second_key = KEYS[backend]
    out = tmp_path / backend
    calls = _count_builds(monkeypatch, backend)
    loop_build_group = ex._build_group

    # interrupted when the second artifact starts: the first is built (or was) and kept, the rest pending
    def interrupt():
        raise KeyboardInterrupt
    _stop_after(monkeypatch, 1 - seeded, interrupt)
    with pytest.raises(ExportInterrupted, match="interrupted: 1 of 2 built; re-run to resume"):
        export_profile(profile, out)
    assert calls == [first][seeded:]
    m = read_manifest(out)
    entries = m.by_id()
    assert entries[first_key].status == "built" and entries[first_key].parity.passed
    assert file_problem(out, entries[first_key].artifact, entries[first_key].artifact_bytes,
                        entries[first_key].artifact_sha256) is None
    pending = sorted(e.id for e in m.entries if e.status == "pending")
    assert second_key in pending and not entries[second_key].artifact
    assert {e.status for e in m.entries} == {"built", "pending", "skipped_budget"}
    kept = out / entries[first_key].artifact
    kept_stat = kept.stat()

    # resumed: only the missing artifact is built; the kept one is neither rebuilt nor rewritten
    monkeypatch.setattr(ex, "_build_group", loop_build_group)
    calls.clear()
    res = export_profile(profile, out)
    assert calls == [second]
    assert (res.built, res.reused, res.failed, res.over_budget) == (1, 1, 0, 0)
    m = read_manifest(out)
    entries = m.by_id()
    assert [e.id for e in m.entries if e.status == "built"] == KEYS[backend]
    assert "pending" not in {e.status for e in m.entries}
    assert {e.id for e in m.entries if e.status == "skipped_budget"} == set(entries) - set(KEYS[backend])
    for key in KEYS[backend]:
        e = entries[key]
        assert e.parity.passed and file_problem(out, e.artifact, e.artifact_bytes, e.artifact_sha256) is None
    # where the second key's build time went: the builder's phases (AOTI times its own) and verification,
    # which the key's build_seconds include
    phases = entries[second_key].extra["build_phases"]
    assert set(phases) == ({"export", "compile", "verify"} if backend == "aoti" else {"verify"})
    assert all(v >= 0 for v in phases.values()) and phases["verify"] > 0
    assert entries[second_key].build_seconds >= sum(phases.values()) - 0.05
    if backend == "aoti":       # Inductor's own timers, each inside the compile (none on a cache hit)
        timers = entries[second_key].extra["inductor_seconds"]
        assert set(timers) <= set(aoti.INDUCTOR_TIMERS), timers
        assert all(0 < v <= phases["compile"] + 0.05 for v in timers.values()), (timers, phases)
    assert kept.stat().st_mtime_ns == kept_stat.st_mtime_ns and kept.stat().st_ino == kept_stat.st_ino

    # complete: another run builds nothing
    calls.clear()
    res = export_profile(profile, out)
    assert calls == [] and (res.built, res.reused, res.failed) == (0, 2, 0)
