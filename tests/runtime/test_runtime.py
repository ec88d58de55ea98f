"""Runtime on tiny ONNX Runtime artifacts: engine hits equal eager, misses fall back, broken
artifacts never crash serving, threads get their own correct outputs."""
import json
import logging
import threading

import pytest
import torch

from c2w import runtime
from c2w.runtime.manifest import read_manifest
from c2w.runtime.model.weights import load_model
from c2w.runtime.stream import StreamDriver
from c2w.runtime.units import EagerRunner, rel_l2

TOL = 5e-3     # engine vs eager on the PCM: the HiFT bound (see runtime/units.py), fp32


def inputs(cfg, B=1, seed=0, chunks=(28, 28, 28), last=13):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (B, 50), generator=g)
    pmel = torch.randn(B, 100, 80, generator=g)
    spk = torch.randn(B, 192, generator=g)
    toks = [(torch.randint(0, cfg.vocab_size, (B, n), generator=g), False) for n in chunks]
    return prompt, pmel, spk, toks + [(torch.randint(0, cfg.vocab_size, (B, last), generator=g), True)]


def session(rt_or_model, runner, ins, seed=0):
    drv = StreamDriver(rt_or_model, runner, trim_conformer=True, seed=seed)
    prompt, pmel, spk, toks = ins
    st = drv.setup(prompt, pmel, spk)
    return torch.cat([drv.step(st, t, last=last) for t, last in toks], 1)


@pytest.fixture(scope="module")
def eager_model():
    return load_model("random:tiny")


def test_engine_session_equals_eager_and_counts(ort_artifacts, eager_model):
    rt = runtime.load(ort_artifacts)
    ins = inputs(rt.model.cfg)
    got = session(rt.model, rt.cache, ins)
    want = session(eager_model, EagerRunner(eager_model), ins)
    assert got.shape == want.shape
    assert rel_l2(got, want) <= TOL
    st = rt.stats()
    hits = {k: v["hits"] for c in st.values() for k, v in c.items() if v["hits"]}
    assert hits == {
        "flow_encoder-B1-N28-C100-last0-float32": 1, "flow_encoder-B1-N28-C150-last0-float32": 1,
        "flow_encoder-B1-N28-C200-last0-float32": 1, "cfm-B1-T50-L100-float32": 1, "cfm-B1-T50-L150-float32": 1,
        "cfm-B1-T50-L200-float32": 1, "hift-B1-F50-S0-float32": 1, "hift-B1-F58-S3840-float32": 2}
    misses = {k for c in st.values() for k, v in c.items() if v["misses"]}
    assert misses == {"flow_encoder-B1-N13-C200-last1-float32", "cfm-B1-T26-L200-float32",
                      "hift-B1-F34-S3840-float32",                 # the final chunk: no tail keys built
                      "flow_encoder-B1-N53-C0-last0-float32", "cfm-B1-T100-L0-float32"}   # nor set-up keys
    rt.release()


def test_unseen_batch_size_runs_eagerly(ort_artifacts, eager_model):
    rt = runtime.load(ort_artifacts)
    ins = inputs(rt.model.cfg, B=2, seed=1, chunks=(28,), last=5)         # the directory has B=1 only
    got = session(rt.model, rt.cache, ins)
    want = session(eager_model, EagerRunner(eager_model), ins)
    assert rel_l2(got, want) <= 1e-6                                  # eager on both sides
    st = rt.stats()
    assert all(v["hits"] == 0 for c in st.values() for v in c.values())
    assert st["cfm"]["cfm-B2-T50-L100-float32"]["misses"] == 1


@pytest.fixture(scope="module")
def damaged_case(eager_model):
    """The session the damaged-directory tests serve, and its PCM from the eager model."""
    ins = inputs(eager_model.cfg, seed=2, chunks=(28,), last=5)
    return ins, session(eager_model, EagerRunner(eager_model), ins)


def _damage_and_check(path, eager_model, damaged_case, caplog, expect_in_log):
    caplog.set_level(logging.WARNING, logger="c2w.runtime")
    rt = runtime.load(path, model=eager_model)
    ins, want = damaged_case
    got = session(rt.model, rt.cache, ins)
    assert rel_l2(got, want) <= TOL
    assert expect_in_log in caplog.text
    return rt


def test_truncated_artifact_is_skipped_with_a_warning(artifacts_copy, eager_model, damaged_case, caplog):
    e = next(e for e in read_manifest(artifacts_copy).entries if e.id == "cfm-B1-T50-L100-float32")
    p = artifacts_copy / e.artifact
    p.write_bytes(p.read_bytes()[: e.artifact_bytes // 2])
    rt = _damage_and_check(artifacts_copy, eager_model, damaged_case, caplog, "truncated or modified")
    assert str(p) in caplog.text
    assert rt.stats()["cfm"]["cfm-B1-T50-L100-float32"]["misses"] == 1
    assert rt.stats()["flow_encoder"]["flow_encoder-B1-N28-C100-last0-float32"]["hits"] == 1
    assert "cfm-B1-T50-L100-float32" in rt.cache.unusable()


def test_deleted_artifact_is_skipped_with_a_warning(artifacts_copy, eager_model, damaged_case, caplog):
    e = next(e for e in read_manifest(artifacts_copy).entries if e.id == "hift-B1-F50-S0-float32")
    (artifacts_copy / e.artifact).unlink()
    _damage_and_check(artifacts_copy, eager_model, damaged_case, caplog, "file is missing")


def test_manifest_of_another_model_is_refused(artifacts_copy, eager_model, damaged_case, caplog):
    path = artifacts_copy / "manifest.json"
    d = json.loads(path.read_text())
    d["model"]["digest"] = "0123456789abcdef"
    path.write_text(json.dumps(d))
    rt = _damage_and_check(artifacts_copy, eager_model, damaged_case, caplog, "model digest 0123456789abcdef")
    assert rt.cache.reason_disabled and rt.cache.keys == []


def test_threads_get_their_own_streams(ort_artifacts):
    rt = runtime.load(ort_artifacts, lazy=False)
    n = 3                 # more threads than cores: the sessions interleave on the engines they share
    cases = [inputs(rt.model.cfg, seed=10 + i, chunks=(28, 28), last=7) for i in range(n)]
    want = [session(rt.model, rt.cache, c, seed=i) for i, c in enumerate(cases)]
    got = [None] * n
    errors = []

    def work(i):
        try:
            got[i] = session(rt.model, rt.cache, cases[i], seed=i)
        except Exception as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(n):
        assert torch.equal(got[i], want[i]), i


def test_runtime_imports_without_exporter_or_backends():
    import subprocess
    import sys
    code = ("import sys; sys.modules['onnxruntime'] = None; sys.modules['tensorrt'] = None; from c2w import runtime; "
            "from c2w.runtime.engines import get_backend; get_backend('tensorrt'); "
            "assert not any(m.startswith('c2w.exporter') for m in sys.modules), 'runtime imported exporter'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_rel_l2_in_slices_equals_the_whole(monkeypatch):
    """rel_l2 accumulates float64 sums over slices (no float64 copy of a multi-GB cache); the
    result does not depend on the slice size."""
    import c2w.runtime.units as units
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 1001, generator=g), torch.randn(3, 1001, generator=g)
    want = ((a.double() - b.double()).norm() / b.double().norm()).item()
    assert abs(units.rel_l2(a, b) - want) < 1e-12
    monkeypatch.setattr(units, "REL_L2_CHUNK", 7)                      # 3003 elements in 429 slices
    assert abs(units.rel_l2(a, b) - want) < 1e-12
    assert units.rel_l2(b.half(), b.half()) == 0.0 and units.rel_l2(a, torch.zeros_like(a)) > 0
    with pytest.raises(ValueError, match=r"shapes \(3, 1001\) and \(3003,\): expected equal"):
        units.rel_l2(a, b.reshape(-1))


BAD_MANIFESTS = [b"\xff\xfe not utf-8 \x80", b'{"format_version": 1, "entries": [', b"[1, 2]",
                 b'{"format_version": 1, "colour": "red"}']


@pytest.mark.parametrize("data", BAD_MANIFESTS)
def test_unreadable_manifest_serves_eagerly_with_a_model_and_is_a_clear_error_without(
        artifacts_copy, eager_model, caplog, data):
    (artifacts_copy / "manifest.json").write_bytes(data)
    caplog.set_level(logging.WARNING, logger="c2w.runtime")
    rt = runtime.load(artifacts_copy, model=eager_model)          # no engine: every unit runs eagerly
    assert "manifest.json'" in caplog.text and "serving everything eagerly" in caplog.text
    assert "; expected " in rt.cache.reason_disabled and rt.cache.keys == []
    with pytest.raises(runtime.C2WUserError, match=r"runtime.load: received no model and no readable manifest"):
        runtime.load(artifacts_copy)


def test_load_applies_the_manifests_tf32_and_says_so(artifacts_copy, caplog):
    path = artifacts_copy / "manifest.json"
    d = json.loads(path.read_text())
    d["precision"]["tf32"] = True
    path.write_text(json.dumps(d))
    caplog.set_level(logging.INFO, logger="c2w.precision")
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        runtime.load(artifacts_copy).release()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert "TF32 on for CUDA matmuls and cuDNN convolutions in this process (the manifest's precision.tf32)" \
            in caplog.text
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
