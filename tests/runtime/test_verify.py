"""Parity of one artifact against its eager unit (runtime/verify.py), and the helpers loading needs."""
import torch

from c2w.runtime.model.weights import load_model
from c2w.runtime.units import ShapeKey


def test_verification_fails_an_engine_whose_outputs_have_another_dtype(tmp_path):
    """The unit spec's output dtypes are part of parity: a HiFT engine returning float16 speech
    fails closed even though its values are close."""
    from c2w.runtime.manifest import Entry, Status
    from c2w.runtime.units import SPECS, EagerRunner
    from c2w.runtime.verify import check_entry
    model = load_model("random:tiny")
    key = ShapeKey("hift", (1, 50, 0), "float32")
    eager = EagerRunner(model)

    class HalfSpeech:
        def run(self, inputs):
            speech, source = eager.run(key, inputs)
            return [speech.half(), source]

        def release(self):
            pass

    backend = type("B", (), {"load": lambda self, info, weights, device: HalfSpeech()})()
    entry = Entry(key.id, "hift", dict(zip(SPECS["hift"].dim_names, key.dims)), "float32", "extra", Status.PENDING,
                  artifact="x", input_names=["mel", "noise"], output_names=["speech", "source"])
    check_entry(model, backend, tmp_path, entry, torch.device("cpu"))
    assert entry.status == Status.FAILED and entry.parity.rel_l2["speech"] == float("inf")
    assert "speech torch.float16 (1, 24000), expected torch.float32 (1, 24000)" in entry.error
    assert entry.parity.rel_l2["source"] == 0.0


class Exact:
    """An engine that runs the eager unit itself: parity is exact."""

    def __init__(self, unit):
        self.unit = unit

    def run(self, inputs):
        with torch.inference_mode():
            return list(self.unit(*inputs))

    def release(self):
        pass


def test_an_engine_equal_to_eager_passes_and_the_artifact_info_names_the_keys_inputs(tmp_path):
    """The entry's dims name the key; the engine gets the artifact's path under the directory,
    the names and the exact input shapes and dtypes of the key; equal outputs pass at rel-L2 0."""
    from c2w.runtime.manifest import Entry, Status
    from c2w.runtime.units import SPECS
    from c2w.runtime.verify import artifact_info, check_entry, entry_key
    model = load_model("random:tiny")
    key = ShapeKey("hift", (1, 50, 0), "float32")
    entry = Entry(key.id, "hift", {"B": 1, "F": 50, "S": 0}, "float32", "first", Status.PENDING,
                  artifact="onnxruntime/h.onnx", input_names=["mel", "noise"], output_names=["speech", "source"],
                  extra={"nodes": 3})
    assert entry_key(entry) == key
    info = artifact_info(tmp_path, entry, model.cfg)
    assert info.path == tmp_path / "onnxruntime" / "h.onnx" and info.input_names == ("mel", "noise")
    assert info.input_shapes == tuple(tuple(s) for s in SPECS["hift"].input_shapes(model.cfg, key))
    assert info.input_dtypes == ("float32", "float32") and info.extra == {"nodes": 3}
    loaded = []
    backend = type("B", (), {"load": lambda self, info, weights, device: loaded.append(weights) or Exact(unit)})()
    unit = SPECS["hift"].build(model, key)
    check_entry(model, backend, tmp_path, entry, torch.device("cpu"), unit=unit)
    assert entry.status == Status.BUILT and entry.error is None
    assert entry.parity.rel_l2 == {"speech": 0.0, "source": 0.0} and entry.parity.tol == SPECS["hift"].tolerance(key)
    assert all(loaded[0][n] is t for n, t in unit.named_parameters())          # the unit's own weights, shared


def test_weights_layout_lists_only_weights_not_stored_contiguously():
    from c2w.runtime.verify import unit_weights, weights_layout
    unit = torch.nn.Linear(3, 4)
    assert sorted(unit_weights(unit)) == ["bias", "weight"] and weights_layout(unit) == {}
    unit.weight = torch.nn.Parameter(torch.randn(3, 4).t())                       # a transposed view: strides (1, 4)
    assert weights_layout(unit) == {"weight": [1, 4]}
