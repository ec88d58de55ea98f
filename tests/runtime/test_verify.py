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


class StaleAfterCapture:
    """An engine whose solves of a resident ring, after the first, return that first one's mel
    and cnn caches (the ring's frames are right): a whole-solve graph that followed only the
    inputs it was captured on, as design note 8's first graph did."""

    def __init__(self, engine):
        self.engine, self.solve_graphs, self.calls, self.first = engine, engine.solve_graphs, 0, None

    def run(self, inputs, trim=None):
        out = self.engine.run(inputs, trim)
        self.calls += 1
        if self.calls == 3:                # chunk 0 laid the ring out; chunk 1 was the capture's
            self.first = out[:2]
        return list(self.first) + out[2:] if self.calls > 3 else out

    def release(self):
        self.engine.release()


class CopiesItsRing:
    """An engine that hands its inner engine a copy of each ring (RingCache.clone): right values,
    but never a ring the replay returned, so its solve graphs never run."""

    def __init__(self, engine):
        self.engine, self.solve_graphs = engine, engine.solve_graphs

    def run(self, inputs, trim=None):
        from c2w.runtime.ring import RingCache
        *rest, att = inputs
        return self.engine.run(rest + [att.clone() if isinstance(att, RingCache) else att], trim)

    def release(self):
        self.engine.release()


def test_an_engine_that_solves_resident_rings_in_graphs_is_checked_as_a_steady_stream(tmp_path, monkeypatch):
    """An AOTI CFM engine with solve graphs (runtime.engines.solve_graphs; here over the eager
    in-place step on the fake GPU of tests/runtime/engines/test_graphs.py) is verified on a
    tensor, then as a steady stream: a ring it laid out, handed back (the graph's capture) and
    handed back again on other inputs (its replay). Right, it passes every check (fp32: the
    attention's key order is all that differs, rel-L2 well under 1e-4); an engine right only on
    its capture's inputs fails closed on the replay chunk, and so does one that never ran its
    graph."""
    from c2w.runtime.engines.aoti import AOTIEngine, EulerReplay
    from c2w.runtime.manifest import Entry, Status
    from c2w.runtime.units import SPECS
    from c2w.runtime.verify import artifact_info, check_entry
    from tests.runtime.engines.test_graphs import fake_cuda
    cuda = fake_cuda(monkeypatch)
    model = load_model("random:tiny")
    key = ShapeKey.named("cfm", "float32", B=1, T=4, L=100)
    spec = SPECS["cfm"]
    unit = spec.export_variant.build(model).eval()
    step = cuda.kernel(lambda *a: torch.no_grad()(unit)(*a))     # as a package runs it: no autograd

    def entry():
        return Entry(key.id, "cfm", {"B": 1, "T": 4, "L": 100}, "float32", "steady", Status.PENDING, artifact="x",
                     input_names=list(spec.input_names(key)), output_names=list(spec.output_names))

    made = []

    def engine(info):
        made.append(EulerReplay(step, model.cfg.n_timesteps, torch.device("cpu"), "in_place", solve_graphs=2))
        return AOTIEngine(info, made[-1], torch.device("cpu"), [])

    good = type("B", (), {"load": lambda self, info, w, d: engine(info)})()
    e = check_entry(model, good, tmp_path, entry(), torch.device("cpu"))
    assert e.status == Status.BUILT, e.error
    names = list(spec.output_names)
    assert sorted(e.parity.rel_l2) == sorted(names + [f"{n} (ring {c})" for n in names for c in ("capture", "replay")])
    assert max(e.parity.rel_l2.values()) < 1e-5
    assert made[0].graphs.captures == 1 and made[0].graphs.live == 0        # captured once, released with the engine

    stale = type("B", (), {"load": lambda self, info, w, d: StaleAfterCapture(engine(info))})()
    e = check_entry(model, stale, tmp_path, entry(), torch.device("cpu"))
    assert e.status == Status.FAILED and e.parity.rel_l2["mel (ring replay)"] > 1e-2
    assert e.parity.rel_l2["mel (ring capture)"] < 1e-5 and "mel (ring replay)" in e.error

    # right values without the graph: the check says it checked no graph
    copies = type("B", (), {"load": lambda self, info, w, d: CopiesItsRing(engine(info))})()
    e = check_entry(model, copies, tmp_path, entry(), torch.device("cpu"))
    assert e.status == Status.FAILED and max(e.parity.rel_l2.values()) < 1e-5
    assert "chunk capture: solved without its solve graph" in e.error and "chunk replay" in e.error
