"""The build side's defaults (exporter/backends/base.py): one artifact per key named after it,
no build options, and example inputs that are the same for every build of a key."""
import types

import torch

from c2w.exporter.backends.base import Builder, BuildJob
from c2w.runtime.engines import get_backend
from c2w.runtime.model.config import TINY
from c2w.runtime.units import SPECS, ShapeKey

KEY = ShapeKey("cfm", (1, 50, 150), "float32")


class Minimal(Builder):
    def build(self, job):
        return [{}]


def test_a_builder_defaults_to_one_artifact_per_key_named_with_its_backends_suffix():
    b = Minimal(get_backend("onnxruntime"))
    assert b.name == "onnxruntime" and b.artifact_group(KEY) == KEY.id
    assert b.artifact_name(KEY.id, "1.20", "cpu") == f"{KEY.id}.onnx"
    assert b.build_options(None) == {}
    profile = types.SimpleNamespace(name="cpu", backend="onnxruntime")
    assert b.dry_run_summary(profile, None) == "dry run: plans the keys of cpu (onnxruntime); writes nothing"


def test_example_inputs_are_seeded_and_shaped_by_the_key(tmp_path):
    job = BuildJob(types.SimpleNamespace(cfg=TINY), torch.device("cpu"), None, KEY.id, [KEY], [], tmp_path / "a",
                   tmp_path, {})
    a, b = job.example_inputs(KEY), job.example_inputs(KEY)
    assert [tuple(t.shape) for t in a] == [tuple(s) for s in SPECS["cfm"].input_shapes(TINY, KEY)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert job.findings == []
