"""runtime/manifest.py: the typed manifest against the JSON it reads and writes (no model, no
backend: every manifest here is written by hand)."""
import dataclasses
import json

import pytest

from c2w.runtime.errors import C2WUserError
from c2w.runtime.manifest import (FORMAT_VERSION, BackendRef, Entry, FailedMeasurement, Manifest, Measurement,
                                  ModelRef, Parity, ProfileRef, Status, read_manifest, write_manifest)


def _entry(key_id: str, parity: Parity | None, status: Status = Status.BUILT) -> Entry:
    return Entry(id=key_id, component="hift", dims={"B": 1, "F": 50, "S": 0}, dtype="float32", category="first",
                 status=status, identity="0123456789abcdef", artifact=f"onnxruntime/{key_id}.onnx",
                 artifact_bytes=10, artifact_sha256="ab" * 32, est_bytes=5, device_bytes=7, memory_kind="host_anon",
                 build_seconds=1.5, parity=parity, input_names=["mel"], output_names=["pcm"],
                 extra={"weights_files": []})


def _manifest(measured) -> Manifest:
    return Manifest(profile=ProfileRef(name="cpu", digest="557923c8fad20a0e", source="profiles/cpu.yaml"),
                    model=ModelRef(spec="random:tiny", digest="d186997f64b2a439", config="tiny"),
                    backend=BackendRef(name="onnxruntime", version="1.32.0"), torch_version="2.13.0+cpu",
                    device="cpu", precision={"flow_encoder": "float32", "cfm": "float32", "hift": "float32",
                                             "tf32": False},
                    budget_bytes=1 << 30, weight_bytes={"hift": 100}, schedule={"prompt_frames": 100},
                    entries=[_entry("a", Parity(rel_l2={"pcm": 1e-7}, tol=1e-4, passed=True)),
                             _entry("b", None, Status.PENDING)],
                    engine_shared_bytes={"hift": 3}, measured=measured)


MEASURED = Measurement(kind="host_anon", keys=1, weight_bytes=100, engine_shared_bytes={"hift": 3}, key_bytes=7,
                       total_bytes=110)
MEASUREMENTS = [MEASURED, dataclasses.replace(MEASURED, kind="cuda_device", split={"allocated": 5, "pool": 2}),
                FailedMeasurement("the measurement process stopped"), None]


@pytest.mark.parametrize("measured", MEASUREMENTS)
def test_records_are_written_as_the_objects_of_format_version_2_and_read_back_equal(tmp_path, measured):
    m = _manifest(measured)
    write_manifest(tmp_path, m)
    d = json.loads((tmp_path / "manifest.json").read_text())
    assert list(d) == ["profile", "model", "backend", "torch_version", "device", "precision", "budget_bytes",
                       "weight_bytes", "schedule", "shared", "entries", "engine_shared_bytes", "measured",
                       "format_version"]
    assert d["profile"] == {"name": "cpu", "digest": "557923c8fad20a0e", "source": "profiles/cpu.yaml"}
    assert d["model"] == {"spec": "random:tiny", "digest": "d186997f64b2a439", "config": "tiny"}
    assert d["backend"] == {"name": "onnxruntime", "version": "1.32.0"}
    assert d["entries"][0]["parity"] == {"rel_l2": {"pcm": 1e-7}, "tol": 1e-4, "passed": True}
    assert d["entries"][1]["parity"] == {} and d["entries"][0]["status"] == "built"
    if measured is None:
        want = {}
    elif isinstance(measured, FailedMeasurement):
        want = {"error": "the measurement process stopped"}
    else:                   # the split only when there is one (CUDA)
        want = {"kind": measured.kind, "keys": 1, "weight_bytes": 100, "engine_shared_bytes": {"hift": 3},
                "key_bytes": 7, "total_bytes": 110, **({"split": measured.split} if measured.split else {})}
    assert d["measured"] == want and list(d["measured"]) == list(want)
    again = read_manifest(tmp_path)
    assert again == m and again.to_json() == (tmp_path / "manifest.json").read_text()


def test_a_version_1_manifest_reads_as_unmeasured_and_is_rewritten_as_version_2(tmp_path):
    d = json.loads(_manifest(None).to_json())
    d["format_version"] = 1
    del d["engine_shared_bytes"], d["measured"]
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    m = read_manifest(tmp_path)
    assert m.format_version == FORMAT_VERSION and m.measured is None and m.engine_shared_bytes == {}
    assert [(e.device_bytes, e.memory_kind) for e in m.entries] == [(None, ""), (None, "")]
    assert m.entries[0].parity == Parity(rel_l2={"pcm": 1e-7}, tol=1e-4, passed=True) and m.model.config == "tiny"
    out = json.loads(m.to_json())
    assert out["measured"] == {} and out["engine_shared_bytes"] == {} and out["format_version"] == FORMAT_VERSION


def _set(path: str, value):
    """An edit of the manifest's JSON: `value` at the dotted `path` (an int part indexes a list)."""
    def edit(d):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parents:
            d = d[p]
        d[last] = value
    return edit


MALFORMED = [
    (_set("model", "random:tiny"), r"model: a JSON string, expected an object \(spec, digest, config\)"),
    (_set("profile", {"name": "cpu"}), r"profile: fields \(name\), expected \(name, digest, source\)"),
    (_set("backend.build", 3), r"backend: fields \(name, version, build\), expected \(name, version\)"),
    (_set("backend.version", 132), r"backend.version: a JSON number \(132\), expected str"),
    (_set("entries.0.parity.passed", "yes"), r"entry 'a' parity.passed: a JSON string \('yes'\), expected bool"),
    (_set("entries.0.parity.rel_l2", {"pcm": "small"}), r"entry 'a' parity.rel_l2: .*expected dict\[str, float\]"),
    (_set("entries.1.parity", []), r"entry 'b' parity: a JSON list, expected an object \(rel_l2, tol, passed\)"),
    (_set("entries.0", "a"), r"an entry that is a JSON string, expected an object"),
    (_set("entries", {}), r"entries: a JSON object, expected a list"),
    (_set("measured", {"kind": "host_anon", "keys": 1}),
     r"measured: fields \(kind, keys\), expected \(kind, keys, .*, total_bytes; optional: split, load_seconds\)"),
    (_set("measured.split", {"pool": 1.5}), r"measured.split: .*expected dict\[str, int\] \| None"),
    (_set("measured", {"error": 3}), r"measured.error: a JSON number \(3\), expected str"),
    (_set("entries.0.status", "done"), r"'done' is not a valid Status"),
]


@pytest.mark.parametrize("edit,why", MALFORMED)
def test_a_malformed_field_is_a_user_error_naming_the_file_and_the_field(tmp_path, edit, why):
    d = json.loads(_manifest(MEASURED).to_json())
    edit(d)
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(C2WUserError, match=r"manifest '.*manifest.json': received fields that do not match \("
                                           + why + r".*; expected the fields of format_version 2\. Re-export"):
        read_manifest(tmp_path)


def test_records_are_required_where_the_manifest_holds_them():
    m = _manifest(None)
    with pytest.raises(TypeError, match=r"Manifest.model: \{'spec': 'random:tiny'\} is not a ModelRef"):
        dataclasses.replace(m, model={"spec": "random:tiny"})
    with pytest.raises(TypeError, match=r"Manifest.measured: \{\} is not a Measurement or FailedMeasurement or None"):
        dataclasses.replace(m, measured={})
    with pytest.raises(TypeError, match=r"Entry.parity: \{'passed': True\} is not a Parity or None"):
        dataclasses.replace(m.entries[0], parity={"passed": True})


def test_an_entry_travels_as_json_and_back_unchanged():
    """runtime.memory sends entries to its measurement process this way."""
    for e in _manifest(None).entries:
        assert Entry.from_dict(json.loads(json.dumps(e.to_dict()))) == e
