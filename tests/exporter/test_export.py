"""Exporter: manifest contents, budget cut, resume, AOTI keys, verify, CLI exit codes."""
import dataclasses
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from c2w.cli import app
from c2w.exporter.export import export_profile
from c2w.exporter.plan import make_plan, precision_weights
from c2w.exporter.profile import Precision
from c2w.exporter.report import render
from c2w.exporter.verify import verify_directory
from c2w.runtime.manifest import FORMAT_VERSION, read_manifest
from c2w.runtime.model.weights import load_model
from c2w.runtime.units import ShapeKey
from tests.conftest import EXPORTED, checkpoint_dir, fewer_layers, seed_artifacts, small_profile

runner = CliRunner()


def test_manifest_contents(ort_artifacts):
    m = read_manifest(ort_artifacts)
    assert m.format_version == FORMAT_VERSION
    assert m.backend.name == "onnxruntime" and m.device == "cpu" and m.torch_version == torch.__version__
    assert m.model.spec == "random:tiny" and len(m.model.digest) == 16
    assert {e.status for e in m.entries} == {"built"} and len(m.entries) == 8
    for e in m.entries:
        assert e.parity.passed and max(e.parity.rel_l2.values()) <= e.parity.tol
        assert (ort_artifacts / e.artifact).stat().st_size == e.artifact_bytes
        assert e.device_bytes is not None and e.build_seconds > 0 and e.identity
    cfm = [e for e in m.entries if e.component == "cfm"]
    # weights stored once: every CFM graph's initializers equal the CFM's parameter bytes
    assert all(e.extra["unique_initializer_bytes"] == cfm[0].extra["unique_initializer_bytes"] for e in cfm)
    weights_dir = ort_artifacts / "onnxruntime" / "weights"
    on_disk = sum(f.stat().st_size for f in weights_dir.iterdir())
    assert on_disk <= 1.05 * sum(m.weight_bytes.values())


def test_budget_selects_in_priority_order(artifacts_copy):
    p = small_profile()
    model = load_model(p.model)
    weights = precision_weights(model, p)
    full = make_plan(model.cfg, p, weights)
    # room for the encoder's and HiFT's weights and keys plus 96 MiB: the CFM (61 MB of weights + its keys) does not fit
    small = [e for e in full.entries if e.key.component != "cfm"]
    budget = weights["flow_encoder"] + weights["hift"] + sum(e.est_bytes for e in small) + (96 << 20)
    p = dataclasses.replace(p, budget_bytes=budget)
    plan = make_plan(model.cfg, p, weights)
    assert {e.key.component for e in plan.selected} == {"flow_encoder", "hift"}
    assert plan.planned_total() <= budget
    # into a copy of the session's directory (every key built, the CFM's included): the selected
    # keys are reused rather than rebuilt (their identity does not depend on the budget), and the
    # CFM keys, whose measured bytes do not fit, are over budget and their artifacts removed
    res = export_profile(p, artifacts_copy)
    m = read_manifest(artifacts_copy)
    status = {e.id: e.status for e in m.entries}
    assert sorted(k for k, s in status.items() if s == "built") == sorted(e.key.id for e in plan.selected)
    assert all(s == "over_budget" for k, s in status.items() if k.startswith("cfm"))
    assert not list((artifacts_copy / "onnxruntime").glob("cfm*"))
    assert (res.built, res.reused, res.over_budget, res.failed) == (0, 5, 3, 0)
    # what was measured after each build (host RSS growth for ONNX Runtime on CPU) fits too
    measured = sum(e.device_bytes for e in m.entries if e.status == "built")
    assert weights["flow_encoder"] + weights["hift"] + measured <= budget
    # steady keys were chosen before first ones (priority steady > first)
    assert [e.category for e in plan.entries][:2] == ["steady", "steady"]


def test_resume_rebuilds_only_the_deleted_artifact(artifacts_copy, measured_as_estimated):
    """What the engines hold is not measured here (each key measures its estimate); resuming
    with the budget measured is test_budget.py's
    test_a_partial_budget_keeps_what_the_measurement_allows_and_resume_keeps_it."""
    m = read_manifest(artifacts_copy)
    victim = next(e for e in m.entries if e.component == "flow_encoder")
    (artifacts_copy / victim.artifact).unlink()
    res = export_profile(small_profile(), artifacts_copy)
    assert (res.built, res.reused, res.failed) == (1, 7, 0)
    assert (artifacts_copy / victim.artifact).is_file()


def test_verify_passes_and_catches_a_tampered_graph(artifacts_copy, request):
    _, checked = verify_directory(artifacts_copy)
    assert len(checked) == 8 and all(e.status == "built" for e in checked)
    m = read_manifest(artifacts_copy)
    e = next(e for e in m.entries if e.component == "cfm")
    (artifacts_copy / e.artifact).write_bytes(b"not an onnx graph")
    parity_runs = request.getfixturevalue("recorded_parity")
    result = runner.invoke(app, ["verify", str(artifacts_copy)])
    assert result.exit_code == 1 and "FAIL" in result.output
    assert sorted(parity_runs) == sorted(x.id for x in m.entries if x.id != e.id)     # the file check refused it


def fewer_layers_checkpoint(directory) -> str:
    """random:tiny with fewer repeated layers (tests.conftest.fewer_layers) as a checkpoint
    directory (flow.pt, hift.pt, c2w_config.json): a model spec the exporter loads like any."""
    from c2w.runtime.model.config import TINY
    return checkpoint_dir(fewer_layers(TINY), directory)


@pytest.mark.slow
def test_aoti_keys_build_and_pass_parity(tmp_path, measured_as_estimated, monkeypatch):
    """One AOTI key per unit (it compiles C++): the encoder's steady key, a CFM key built as one
    Euler step that the runtime replays 10 times, and a float16 HiFT key (it lifts constant tables);
    chosen by priority + a budget with room for their estimates only (each key measuring its
    estimate here: any room left would build more keys). The model has fewer repeated layers than
    random:tiny: the C++ Inductor generates and compiles grows with the node count, and a repeated
    layer adds nodes, not kinds of nodes."""
    from c2w.exporter.backends.aoti import static_libstdcxx_objects
    p = small_profile()
    # HiFT at its float16 policy: the package carries conv weights stored in the channels-last
    # order (runtime/model/hift.py), which it must read as they are
    p = dataclasses.replace(p, model=fewer_layers_checkpoint(tmp_path / "model"),
                            precision=dataclasses.replace(p.precision, hift="float16"))
    model = load_model(p.model)
    weights = precision_weights(model, p)
    keys = (ShapeKey("flow_encoder", (1, 28, 150, 0), "float32"), ShapeKey("cfm", (1, 50, 150), "float32"),
            ShapeKey("hift", (1, 58, 3840), "float16"))
    p = dataclasses.replace(p, backend="aoti", extra_keys=keys, priority=("extra", "steady", "first", "tail"))
    est = sum(e.est_bytes for e in make_plan(model.cfg, p, weights).entries if e.key in keys)
    p = dataclasses.replace(p, budget_bytes=sum(weights.values()) + est)
    res = export_profile(p, tmp_path / "aoti")
    m = read_manifest(tmp_path / "aoti")
    built = {e.id: e for e in m.entries if e.status == "built"}
    assert sorted(built) == sorted(k.id for k in keys) and res.failed == 0
    for e in built.values():
        assert e.artifact.endswith(".pt2") and e.parity.passed
        # the load-crash signature (a statically linked libstdc++ in the model .so) is refused
        assert static_libstdcxx_objects(tmp_path / "aoti" / e.artifact) == []
    cfm = built["cfm-B1-T50-L150-float32"]
    assert cfm.extra["cfm_step"] is True and cfm.extra["step_att"] == "in_place"   # the att caches written in place
    # the package records the layout of the weights it binds by pointer (the DiT's tap-major conv
    # weights), and refuses the same values in another layout
    from c2w.runtime.engines.aoti import AOTIBackend
    from c2w.runtime.ring import RingCache
    from c2w.runtime.trim import CacheTrim
    from c2w.runtime.units import SPECS
    from c2w.runtime.verify import artifact_info, unit_weights
    strides = cfm.extra["constant_strides"]
    assert strides and all(".conv.block." in fqn for fqn in strides)
    weights = unit_weights(SPECS["cfm"].build(model, keys[1]))
    info = artifact_info(tmp_path / "aoti", cfm, model.cfg)
    engine = AOTIBackend().load(info, weights, torch.device("cpu"))
    # handed a tensor, the in-place replay lays the cache out anew and hands back a tensor, which
    # Engine.run trims (T=50 + L=150 frames: the first 60 and the last 100)
    T, L = 50, 150
    trim, inputs = CacheTrim(60), SPECS["cfm"].example_inputs(model.cfg, keys[1])
    whole, trimmed = engine.run(inputs), engine.run(inputs, trim)
    for a, b in zip(trimmed, whole[:2] + [trim.apply(whole[2])]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # handed a ring with T free slots (NaN here), the package writes the chunk's frames into that
    # very buffer: same values (the same layout as the tensor path's), no new cache
    buffer = torch.cat([torch.full_like(inputs[5][..., :T, :], float("nan")), inputs[5]], dim=-2)
    got = engine.run(inputs[:5] + [RingCache(buffer, range(T, T + L))], trim)
    assert isinstance(got[2], RingCache) and got[2].buffer is buffer and got[2].frames == 160
    for a, b in zip(got[:2] + [got[2].logical()], trimmed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    engine.release()
    contiguous = {fqn: (t.contiguous() if fqn in strides else t) for fqn, t in weights.items()}
    with pytest.raises(RuntimeError, match="laid out differently"):
        AOTIBackend().load(info, contiguous, torch.device("cpu"))
    # a CUDA package's runner is made without torch's probe of the host's vector ISA (~60 s on a
    # fresh machine); the path is exercised here on the CPU HiFT package (its constants are inside)
    import torch._inductor.cpu_vec_isa as cpu_vec_isa
    from c2w.runtime.engines.aoti import load_runner
    hift = tmp_path / "aoti" / built["hift-B1-F58-S3840-float16"].artifact
    hift_inputs = SPECS["hift"].example_inputs(model.cfg, keys[2])
    expected = load_runner(str(hift), torch.device("cpu"), single_threaded=False)(*hift_inputs)

    def probe():
        raise AssertionError("the host's vector ISA was probed")
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", probe)
    with pytest.raises(AssertionError, match="probed"):      # torch's own loading probes it
        torch._inductor.aoti_load_package(str(hift))
    for a, b in zip(load_runner(str(hift), torch.device("cuda"), single_threaded=False)(*hift_inputs), expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_aoti_inductor_overrides_and_identity(monkeypatch):
    """C2W_AOTI_INDUCTOR adds Inductor configs to AOTI builds, and an artifact built with other
    overrides is not reused (its identity differs); junk in the variable is a user error."""
    from c2w.exporter.backends.aoti import inductor_overrides
    from c2w.runtime.errors import C2WUserError
    from c2w.runtime.manifest import entry_identity
    monkeypatch.delenv("C2W_AOTI_INDUCTOR", raising=False)
    assert inductor_overrides() == {}
    monkeypatch.setenv("C2W_AOTI_INDUCTOR", '{"combo_kernels": true}')
    assert inductor_overrides() == {"combo_kernels": True}
    for bad in ("combo_kernels=1", "[1]"):
        monkeypatch.setenv("C2W_AOTI_INDUCTOR", bad)
        with pytest.raises(C2WUserError, match=r"C2W_AOTI_INDUCTOR: received .*expected a JSON object"):
            inductor_overrides()
    monkeypatch.setenv("C2W_AOTI_INDUCTOR", '{"aot_inductor.package_constants_in_so": true}')
    with pytest.raises(C2WUserError, match=r"expected only configs c2w does not set itself"):
        inductor_overrides()                 # c2w decides where constants live (weight sharing)
    common = dict(model_digest="m", key_id="k", backend="aoti", backend_version="v", torch_version="t",
                  device="cuda", precision={"cfm": "float16"})
    assert entry_identity(**common) == entry_identity(**common, build_options={})     # unchanged by default
    assert entry_identity(**common) != entry_identity(**common, build_options={"combo_kernels": True})
    # weights stored in another memory layout make another artifact (AOTI binds them by pointer)
    assert entry_identity(**common) == entry_identity(**common, weights_layout={})
    assert entry_identity(**common) != entry_identity(**common, weights_layout={"w": [24, 1, 8]})
    # a unit's revision for a backend makes another artifact; revision 0 is the identity as before
    assert entry_identity(**common) == entry_identity(**common, revision=0) != entry_identity(**common, revision=1)


def test_a_units_revision_rebuilds_its_keys_of_that_backend_only(tmp_path, monkeypatch):
    """A revision of the CFM's AOTI artifacts (UnitSpec.revisions) changes the identity of the CFM
    keys of AOTI exports and of nothing else, so an export keeps every other artifact."""
    import dataclasses

    import c2w.exporter.export as ex
    from c2w.runtime.units import SPECS
    seen = {}
    real = ex.entry_identity

    def spy(**kw):
        seen[(kw["backend"], kw["key_id"].split("-")[0])] = kw["revision"]
        return real(**kw)
    monkeypatch.setattr(ex, "entry_identity", spy)

    def not_built(builder, job, entries):                # the identities are what this test is about
        for e in entries:
            e.status, e.error = ex.Status.FAILED, "not built in this test"
    monkeypatch.setattr(ex, "_build_group", not_built)
    assert SPECS["cfm"].revisions == {"aoti": 7, "onnxruntime": 1, "tensorrt": 1}
    assert SPECS["hift"].revisions == {"aoti": 6}
    assert SPECS["flow_encoder"].revisions == {"aoti": 5, "onnxruntime": 5, "tensorrt": 5}
    for backend in ("aoti", "onnxruntime"):
        ex.export_profile(dataclasses.replace(small_profile(), backend=backend), tmp_path / backend)
    assert seen == {("aoti", "cfm"): 7, ("aoti", "hift"): 6, ("aoti", "flow_encoder"): 5,
                    ("onnxruntime", "cfm"): 1, ("onnxruntime", "hift"): 0, ("onnxruntime", "flow_encoder"): 5}


BAD_PROFILES = [
    ("colour: red\n", r"unknown key\(s\) \['colour'\]"),
    ("budget_bytes: 0\n", r"'budget_bytes': received 0; expected a positive byte count"),
    ("budget_bytes: -5GiB\n", r"'budget_bytes'"),
    ("backend: tensorflow\n", r"'backend': received 'tensorflow'; expected one of \['onnxruntime', 'aoti', 'tensorrt'\]"),
    ("schedule: {batch_sizes: 4}\n", r"'schedule.batch_sizes': received 4; expected a list of integers"),
    ("schedule: {chunk_tokens: [2]}\n", r"'schedule.chunk_tokens': received \[2\]; expected integers >= 4"),
    ("schedule: {prompt_frames: 301}\n", r"'schedule.prompt_frames': received 301; expected an even number"),
    ("precision: {hift: bfloat16}\n", r"'precision.hift': received 'bfloat16'; expected one of \['float16', "
     r"'float32'\] \(bfloat16 convolutions measured 27.7-29.7 dB SNR against float32"),
    ("precision: {hift: float16, tf32: true}\n", r"'precision.tf32': received true; expected false with hift: float16"),
    ("precision: {cfm: float64}\n", r"'precision.cfm': received 'float64'; expected one of \['bfloat16', 'float16', "
     r"'float32'\]$"),
    ("extra_keys: [{component: cfm, B: 1, T: 50}]\n", r"extra_keys\[0\]': received no \['L'\]"),
]


@pytest.mark.parametrize("text,message", BAD_PROFILES)
def test_bad_profiles_exit_2_with_one_clear_line(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text("name: bad\n" + text)
    result = runner.invoke(app, ["plan", "--profile", str(f)])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert str(f) in out
    import re
    assert re.search(message, out), out


def test_bundled_profile_resolves_by_bare_name_and_tensorrt_fails_fast(tmp_path):
    result = runner.invoke(app, ["plan", "--profile", "h100"])
    assert result.exit_code == 0 and "h100" in result.output
    result = runner.invoke(app, ["export", "--profile", "cpu", "--backend", "tensorrt", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "tensorrt" in result.output and "pip install" in " ".join(result.output.split())
    result = runner.invoke(app, ["plan", "--profile", "nope"])
    assert result.exit_code == 2 and "bundled names" in " ".join(result.output.split())


@pytest.mark.parametrize("data", [b"\xff\xfe not utf-8 \x80", b"[1, 2]", b'{"format_version": 1}'])
def test_unreadable_manifest_is_one_line_and_exit_2_in_every_command(tmp_path, data):
    (tmp_path / "manifest.json").write_bytes(data)
    for args in (["report", str(tmp_path)], ["verify", str(tmp_path)],
                 ["export", "--profile", "cpu", "--out", str(tmp_path)]):
        result = runner.invoke(app, args)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and "manifest.json" in lines[0], (args, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]     # export wrote nothing


def test_plan_dry_run_and_export_pick_the_same_keys_for_fp16(tmp_path):
    """The exporter's model is already cast to fp16 when it counts weight bytes: they must not
    be halved a second time (h100: 59 keys in plan, 53 in the dry run)."""
    from c2w.exporter.plan import weight_bytes
    model = load_model("random:tiny")
    fp16 = dataclasses.replace(small_profile(), precision=Precision(flow_encoder="float16", cfm="float16"))
    w = precision_weights(model, fp16)
    assert w["cfm"] == weight_bytes(model)["cfm"] // 2 and w["hift"] == weight_bytes(model)["hift"]
    assert precision_weights(model.to(torch.device("cpu"), {"flow_encoder": torch.float16, "cfm": torch.float16,
                                                            "hift": torch.float32}), fp16) == w
    full = make_plan(model.cfg, fp16, w)
    budget = sum(w.values()) + sum(e.est_bytes for e in full.entries) - 1      # one byte short of all
    f = tmp_path / "fp16.yaml"
    f.write_text(f"name: fp16\nbudget_bytes: {budget}\nprecision: {{flow_encoder: float16, cfm: float16}}\n"
                 "schedule: {prompt_frames: 100, batch_sizes: [1], max_chunks: 3, setup_keys: false}\n")
    plan = runner.invoke(app, ["plan", "--profile", str(f)])
    dry = runner.invoke(app, ["export", "--profile", str(f), "--out", str(tmp_path / "o"), "--dry-run"])
    n_plan = int(re.search(r"(\d+) keys to build", plan.output).group(1))
    n_dry = int(re.search(r"dry run: (\d+) keys would be built", " ".join(dry.output.split())).group(1))
    assert n_plan == n_dry == len(full.entries) - 1, (plan.output, dry.output)
    res = export_profile(dataclasses.replace(fp16, budget_bytes=budget), tmp_path / "e", dry_run=True)
    assert res.plan.weight_bytes == w and len(res.plan.selected) == n_plan


def test_verify_checks_size_and_sha256_of_every_file_the_manifest_names(artifacts_copy, recorded_parity,
                                                                       recorded_measurement):
    m = read_manifest(artifacts_copy)
    weights = sorted(str(p.relative_to(artifacts_copy)) for p in (artifacts_copy / "onnxruntime" / "weights").iterdir())
    assert sorted(m.shared) == weights                  # every shared file is listed with its hash
    hift = next(e for e in m.entries if e.component == "hift")
    largest = max(weights, key=lambda rel: (artifacts_copy / rel).stat().st_size)
    for rel in (hift.artifact, largest):
        p = artifacts_copy / rel
        good = p.read_bytes()
        i = len(good) // 2
        p.write_bytes(good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1:])      # same size, one byte flipped
        result = runner.invoke(app, ["verify", str(artifacts_copy)])
        assert result.exit_code == 1 and f"{rel}: sha256 differs from the manifest" in result.output, result.output
        p.write_bytes(good)
    recorded_parity.clear()
    assert runner.invoke(app, ["verify", str(artifacts_copy)]).exit_code == 0
    assert sorted(recorded_parity) == sorted(e.id for e in m.entries)


def test_verify_of_a_directory_with_nothing_built_fails(artifacts_copy):
    path = artifacts_copy / "manifest.json"
    d = json.loads(path.read_text())
    for e in d["entries"]:
        e["status"] = "pending"
    path.write_text(json.dumps(d))
    result = runner.invoke(app, ["verify", str(artifacts_copy)])
    assert result.exit_code == 2 and "nothing built ({'pending': 8})" in " ".join(result.output.split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_verify_on_cuda_without_cuda_is_one_line(ort_artifacts):
    for device, message in (("cuda", "'cuda' on a machine without CUDA"), ("gpu", "--device: received 'gpu'")):
        result = runner.invoke(app, ["verify", str(ort_artifacts), "--device", device])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
        assert len(result.output.strip().splitlines()) == 1


def _stop_after(monkeypatch, n_keys: int, stop):
    """Build the first n_keys artifacts for real, then call stop() when the next one starts."""
    import c2w.exporter.export as ex
    real, calls = ex._build_group, []

    def build(*a, **kw):
        calls.append(1)
        if len(calls) > n_keys:
            stop()
        return real(*a, **kw)
    monkeypatch.setattr(ex, "_build_group", build)


def _tmp_files(root):
    return [p for p in root.rglob("*") if ".tmp" in p.name]


# small_profile() as a YAML file, with two encoder keys moved to the front (extra keys of the
# first priority): the key these tests build, and the one whose export they stop, take seconds,
# where a CFM key takes most of a minute on 2 cores. Still the same 8 keys. The first one starts
# as command 1 built it into artifacts/cpu where that directory has it (cheap_first_key_seeded).
CHEAP_FIRST_KEYS_YAML = ("name: p\nschedule: {prompt_frames: 100, batch_sizes: [1], max_chunks: 3, setup_keys: false}\n"
                         "extra_keys: [{component: flow_encoder, B: 1, N: 28, C: 150, last: 0},\n"
                         "             {component: flow_encoder, B: 1, N: 28, C: 200, last: 0}]\n"
                         "priority: [extra, steady, first, tail]\n")


@pytest.fixture
def cheap_first_key_seeded(tmp_path, measured_as_estimated) -> int:
    """For the stopped exports of CHEAP_FIRST_KEYS_YAML into tmp_path/o: its first key starts as
    command 1 built it (tests/conftest.seed_artifacts), so the export keeps it instead of building
    it (an ONNX export of ~15 s); returns 1, or 0 where artifacts/cpu lacks it and the export
    builds it. What the engines hold is not measured (each key measures its estimate): these
    tests are about what a stopped export leaves behind."""
    return seed_artifacts(EXPORTED, tmp_path / "o", {"flow_encoder-B1-N28-C150-last0-float32"})


def test_out_naming_a_file_is_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    result = runner.invoke(app, ["export", "--profile", "cpu", "--out", str(f)])
    assert result.exit_code == 2 and "an existing file" in result.output and len(result.output.strip().splitlines()) == 1


def test_disk_full_mid_export_is_one_line_keeps_what_was_built_and_no_temporaries(tmp_path, monkeypatch,
                                                                                  cheap_first_key_seeded):
    import errno
    import os

    import c2w.runtime.atomic as atomic

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    _stop_after(monkeypatch, 1 - cheap_first_key_seeded, lambda: monkeypatch.setattr(atomic, "_write_all", full))
    f = tmp_path / "p.yaml"
    f.write_text(CHEAP_FIRST_KEYS_YAML)
    result = runner.invoke(app, ["export", "--profile", str(f), "--out", str(tmp_path / "o")])
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "ENOSPC (No space left on device)" in out and "resume" in out, result.output
    assert _tmp_files(tmp_path / "o") == []
    status = [e.status for e in read_manifest(tmp_path / "o").entries]
    assert status.count("built") == 1 and status.count("pending") == 7


def test_read_only_directory_is_one_line(tmp_path, monkeypatch):
    import errno
    import os

    import c2w.runtime.atomic as atomic

    def read_only(path, flags, mode=0o777):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    monkeypatch.setattr(atomic.os, "open", read_only)
    result = runner.invoke(app, ["export", "--profile", "cpu", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "EROFS (Read-only file system)" in " ".join(result.output.split())


def test_interrupt_says_what_is_missing_and_keeps_it_pending(tmp_path, monkeypatch, cheap_first_key_seeded):
    def interrupt():
        raise KeyboardInterrupt
    _stop_after(monkeypatch, 1 - cheap_first_key_seeded, interrupt)
    f = tmp_path / "p.yaml"
    f.write_text(CHEAP_FIRST_KEYS_YAML)
    result = runner.invoke(app, ["export", "--profile", str(f), "--out", str(tmp_path / "o")])
    assert result.exit_code == 130 and "interrupted: 1 of 8 built; re-run to resume" in result.output
    m = read_manifest(tmp_path / "o")
    assert [e.status for e in m.entries].count("pending") == 7 and _tmp_files(tmp_path / "o") == []
    table = render(m)
    assert "1 built, 7 pending" in table and "7 of 8 planned keys are pending" in table


def test_a_budget_that_fits_no_key_fails_the_export_and_says_why(tmp_path):
    f = tmp_path / "tiny_budget.yaml"
    f.write_text("name: t\nbudget_bytes: 1MiB\n")
    plan = runner.invoke(app, ["plan", "--profile", str(f)])
    assert plan.exit_code == 0 and "no key fits the budget of 1.0 MiB; the smallest" in " ".join(plan.output.split())
    result = runner.invoke(app, ["export", "--profile", str(f), "--out", str(tmp_path / "o")])
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and re.search(r"no key fits the budget of 1.0 MiB; the smallest \(\S+\) needs "
                                               r"[0-9.]+ MiB", out), out
    assert not (tmp_path / "o").exists()


def test_dry_run_says_up_front_what_it_will_write(tmp_path, monkeypatch):
    import c2w.exporter.export as ex
    from c2w.runtime.errors import C2WUserError

    def stop(*a, **kw):
        raise C2WUserError("stop", "-", "-")
    monkeypatch.setattr(ex, "export_profile", stop)
    result = runner.invoke(app, ["export", "--profile", "h100", "--out", str(tmp_path), "--dry-run"])
    first = " ".join(result.output.split())
    assert first.startswith(f"dry run: plans the keys of h100, then exports one ONNX graph per graph variant into "
                            f"{tmp_path}/tensorrt/onnx")
    assert "hundreds of MB" in first


@pytest.mark.slow
def test_a_float16_hift_key_exports_to_onnxruntime_verifies_and_serves(tmp_path, measured_as_estimated):
    """One float16 HiFT key through the real exporter (the priority and a budget with room for
    its estimate alone select it): it passes verification at the float16 tolerance, the
    directory's manifest records the policy, and the runtime loads the model at it and hits the
    engine. ONNX Runtime's CPU provider runs the float16 convolutions in float32 on the float16
    weights (no float16 Conv kernel on x86): 2.9-3.0e-3 from eager float16, inside the bound. The
    source stays float32 under the policy: it differs from eager only by float32 summation order,
    which the NSF phase (a running sum over the chunk's samples) carries along: 1.9e-5 on one CI
    machine, below 1e-5 on another; a float16 source would be ~1e-3."""
    from c2w import runtime
    from c2w.runtime.units import SPECS
    key = ShapeKey("hift", (1, 58, 3840), "float16")
    p = dataclasses.replace(small_profile(), precision=Precision(hift="float16"), extra_keys=(key,),
                            priority=("extra", "steady", "first", "tail"))
    model = load_model(p.model)
    weights = precision_weights(model, p)
    est = next(e.est_bytes for e in make_plan(model.cfg, p, weights).entries if e.key == key)
    res = export_profile(dataclasses.replace(p, budget_bytes=weights["hift"] + est), tmp_path)
    m = read_manifest(tmp_path)
    built = [e for e in m.entries if e.status == "built"]
    assert res.failed == 0 and [e.id for e in built] == ["hift-B1-F58-S3840-float16"]
    parity = built[0].parity
    assert parity.passed and parity.tol == SPECS["hift"].tolerance(key)
    assert 1e-3 < parity.rel_l2["speech"] < 5e-3 and parity.rel_l2["source"] < 1e-4, parity
    assert m.precision["hift"] == "float16" and m.precision["tf32"] is False

    rt = runtime.load(tmp_path)
    assert rt.model.component_dtype("hift") == torch.float16
    g = torch.Generator().manual_seed(0)
    P = p.schedule.prompt_frames
    st = rt.setup(torch.randint(0, model.cfg.vocab_size, (1, P // 2), generator=g), torch.randn(1, P, 80, generator=g),
                  torch.randn(1, 192, generator=g))
    for _ in range(2):                  # the second chunk is the steady key: F = 50 + 8 cached frames
        pcm = rt.step(st, torch.randint(0, model.cfg.vocab_size, (1, 28), generator=g))
    assert pcm.dtype == torch.float32 and bool(torch.isfinite(pcm).all())
    assert rt.stats()["hift"]["hift-B1-F58-S3840-float16"] == {"hits": 1, "misses": 0, "failures": 0}
    rt.release()


def test_export_threads_are_one_on_cuda_and_torchs_own_on_the_cpu_unless_asked(monkeypatch, tmp_path):
    """Many shards of a CUDA export on one machine each start a PyTorch thread per core unless
    told otherwise (26 on 16 cores: 155 s to set the model up instead of 18 s): a cuda profile's
    export runs one thread, a cpu profile's keeps torch's default, --threads overrides both."""
    from c2w.exporter import export as ex
    from c2w.exporter.export import export_threads
    from c2w.runtime.errors import C2WUserError
    p = small_profile()
    assert export_threads(p) is None and export_threads(dataclasses.replace(p, device="cuda")) == 1
    assert export_threads(dataclasses.replace(p, device="cuda:1")) == 1 and export_threads(p, 3) == 3
    assert export_threads(dataclasses.replace(p, device="cuda"), dry_run=True) is None      # a dry run plans on the CPU
    with pytest.raises(C2WUserError, match=r"--threads: received 0; expected 1 or more"):
        export_threads(p, 0)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    r = runner.invoke(app, ["export", "--profile", "cpu", "--threads", "0", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--threads: received 0" in r.output and set_to == []
    # the export's threads last as long as it does
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    monkeypatch.setattr(ex, "_export", lambda *a: "done")
    assert export_profile(p, tmp_path / "o", threads=2) == "done" and set_to == [2, 7]


def test_shards_build_each_family_of_keys_together_and_balance_their_weight():
    """A family (keys that differ only in cache lengths: the CFM's L, the encoder's C) goes to one
    shard, whose later keys then find the family's kernels in the compile cache; families go in
    order of first appearance to the least-loaded shard (a CFM family weighs 6, others 1, each
    later key of a family 0.2 of that), ties to the lower shard."""
    from types import SimpleNamespace

    from c2w.exporter.export import build_family, shard_of_groups

    def group(component, **dims):
        key = ShapeKey.named(component, "float16" if component != "hift" else "float32", **dims)
        return key.id, [SimpleNamespace(key=key)]
    groups = [group("cfm", B=1, T=50, L=300), group("cfm", B=1, T=50, L=350), group("cfm", B=2, T=50, L=300),
              group("flow_encoder", B=1, N=28, C=300, last=0), group("flow_encoder", B=1, N=28, C=350, last=0),
              group("hift", B=1, F=58, S=3840), group("cfm", B=1, T=150, L=300), group("hift", B=1, F=50, S=0)]
    assert build_family(groups[0][1][0].key) == build_family(groups[1][1][0].key) == ("cfm", "float16", 1, 50)
    assert build_family(groups[0][1][0].key) != build_family(groups[6][1][0].key)
    # loads after each family: A (7.2, 0), B (7.2, 6), C (7.2, 7.2), D (8.2, 7.2), E (8.2, 13.2), F (9.2, 13.2)
    assert shard_of_groups(groups, 2) == [0, 0, 1, 1, 1, 0, 1, 0]
    assert shard_of_groups(groups, 1) == [0] * 8
    # (7.2, 0, 0), (7.2, 6, 0), (7.2, 6, 1.2), (7.2, 6, 2.2), (7.2, 6, 8.2), (7.2, 7, 8.2)
    assert shard_of_groups(groups, 3) == [0, 0, 1, 2, 2, 2, 2, 1]
    assert set(shard_of_groups(groups, 8)) == set(range(6))       # six families: two shards get none
