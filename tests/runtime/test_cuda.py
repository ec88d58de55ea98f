"""On a CUDA GPU: AOTI engines built for the device, loaded with CUDA graphs, checked on many inputs.

The rest of the suite runs on the CPU, where the graph policy is only bookkeeping
(engines/test_aoti.py) and the capture helper runs on a fake of torch.cuda's graph calls
(engines/test_graphs.py). These tests run the capture itself; without CUDA they are skipped.
Run them alone with `python -m pytest -q -m gpu tests` (docs/testing.md).
"""
import dataclasses

import pytest
import torch

import c2w.runtime.memory
from c2w.exporter.export import export_profile, prepare_model
from c2w.exporter.plan import make_plan, precision_weights
from c2w.exporter.profile import Precision
from c2w.runtime.engines.aoti import AOTIBackend
from c2w.runtime.engines.graphs import CapturedCall, GraphPool
from c2w.runtime.manifest import read_manifest
from c2w.runtime.units import SPECS, ShapeKey, rel_l2
from c2w.runtime.verify import artifact_info, entry_key, unit_weights
from tests.conftest import EstimatedMemory, small_profile
from tests.exporter.test_export import fewer_layers_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# One key per unit, the CFM in float16 as the GPU profiles build it.
KEYS = (ShapeKey("flow_encoder", (1, 28, 150, 0), "float16"), ShapeKey("cfm", (1, 50, 150), "float16"),
        ShapeKey("hift", (1, 58, 3840), "float32"))


@pytest.fixture(scope="module")
def cuda_aoti(tmp_path_factory):
    """The three KEYS built by the exporter for CUDA (parity checked there, fail closed)."""
    tmp = tmp_path_factory.mktemp("cuda_aoti")
    p = dataclasses.replace(small_profile(), model=fewer_layers_checkpoint(tmp / "model"), device="cuda",
                            backend="aoti", extra_keys=KEYS, priority=("extra", "steady", "first", "tail"),
                            precision=Precision(flow_encoder="float16", cfm="float16", hift="float32", tf32=True))
    model, _ = prepare_model(p)
    weights = precision_weights(model, p)
    est = sum(e.est_bytes for e in make_plan(model.cfg, p, weights).entries if e.key in KEYS)
    p = dataclasses.replace(p, budget_bytes=sum(weights.values()) + est)   # room for KEYS only
    with pytest.MonkeyPatch.context() as mp:   # each key measures its estimate (conftest.EstimatedMemory)
        mp.setattr(c2w.runtime.memory, "MeasureProcess", EstimatedMemory)
        export_profile(p, tmp / "aoti")
    return model, tmp / "aoti"


def test_cuda_engines_build_and_pass_parity(cuda_aoti):
    _, out = cuda_aoti
    m = read_manifest(out)
    built = {e.id: e for e in m.entries if e.status == "built"}
    assert sorted(built) == sorted(k.id for k in KEYS), [(e.id, e.status, e.error) for e in m.entries]
    assert all(e.parity.passed for e in built.values())


@pytest.mark.parametrize("component", ["flow_encoder", "cfm", "hift"])
def test_graphed_engine_matches_eager_on_every_new_input(cuda_aoti, component):
    """A graphed engine must be right for every input copied into it, not only the first after
    capture: a CFM replay captured as one graph was right once and NaN after (docs/aoti.md)."""
    model, out = cuda_aoti
    entry = next(e for e in read_manifest(out).entries if e.status == "built" and e.component == component)
    key, spec, device = entry_key(entry), SPECS[component], torch.device("cuda")
    unit = spec.build(model, key).eval()
    backend = AOTIBackend(cuda_graphs=True, graph_max_bytes=None)
    engine = backend.load(artifact_info(out, entry, model.cfg), unit_weights(unit), device)
    assert backend.graphed(engine.info, device)
    try:
        for seed in (1, 2, 3):
            inputs = spec.example_inputs(model.cfg, key, torch.Generator().manual_seed(seed), device=device)
            got = engine.run(inputs)
            with torch.inference_mode():
                want = list(unit(*inputs))
            for name, g, w in zip(spec.output_names, got, want):
                assert torch.isfinite(g).all(), f"{component} {name}: non-finite output for seed {seed}"
                assert rel_l2(g, w) <= spec.tolerance(key), f"{component} {name}: seed {seed}"
    finally:
        engine.release()


def test_a_resident_ring_is_solved_from_one_graph_on_new_inputs(cuda_aoti):
    """The CFM engine as a B=32 key is served (runtime.engines.solve_graphs), forced at this small
    key by a byte bar that graphs no step: `c2w verify`'s steady-ring check (a ring laid out,
    handed back for the capture, handed back again on other inputs) passes, from one capture and
    two replays."""
    from c2w.runtime.verify import VERIFY_SEED, steady_ring_errors
    model, out = cuda_aoti
    entry = next(e for e in read_manifest(out).entries if e.status == "built" and e.component == "cfm")
    key, spec, device = entry_key(entry), SPECS["cfm"], torch.device("cuda")
    unit = spec.build(model, key).eval()
    backend = AOTIBackend(cuda_graphs=True, graph_max_bytes=0)
    engine = backend.load(artifact_info(out, entry, model.cfg), unit_weights(unit), device)
    assert backend.solve_graphed(engine.info, device) and engine.solve_graphs is not None
    try:
        inputs = spec.example_inputs(model.cfg, key, seed=VERIFY_SEED, device=device)
        errs, wrong = steady_ring_errors(engine, unit, model.cfg, key, inputs, device)
        assert not wrong and errs and max(errs.values()) <= spec.tolerance(key), (errs, wrong)
        counts = engine.solve_graphs.counts()
        assert (counts["captures"], counts["replays"], counts["held"]) == (1, 2, 1), counts
    finally:
        engine.release()


def test_captured_call_recaptures_when_what_it_baked_in_moves():
    """The helper's TensorRT-style path on a real graph (no TensorRT run has exercised it): captured
    on the first call, replayed on new inputs, captured again into the same pool once the buffer
    its work reads (TensorRT: the shared scratch) is reallocated, beside a graph that allocates in
    the pool (AOTI-style); released, the pool retires."""
    device, n = torch.device("cuda"), 1 << 12
    pool = GraphPool(device)
    scratch = {"buffer": torch.full((n,), 1.0, device=device), "generation": 0}
    static_out = torch.empty(n, device=device)

    def enqueue(x):
        torch.add(x, scratch["buffer"], out=static_out)
        return [static_out]
    trt_like = CapturedCall(enqueue, [(n,)], [torch.float32], device, pool, warmups=1, lazy=True,
                            generation=lambda: scratch["generation"])
    aoti_like = CapturedCall(lambda a: a * 3, [(n,)], [torch.float32], device, pool)
    assert not trt_like.captured and pool.captured == 1
    x = torch.arange(n, dtype=torch.float32, device=device)
    assert torch.equal(trt_like(x)[0], x + 1) and torch.equal(trt_like(2 * x)[0], 2 * x + 1)
    scratch["buffer"], scratch["generation"] = torch.full((n,), 5.0, device=device), 1
    first = trt_like(x)[0]
    assert torch.equal(first, x + 5) and (pool.captured, pool.live) == (3, 2)
    assert torch.equal(aoti_like(x)[0], 3 * x) and torch.equal(first, x + 5)    # a clone survives replays
    trt_like.release()
    aoti_like.release()
    assert pool.retired


def test_example_inputs_are_drawn_on_the_device_they_are_for():
    """Without a generator, inputs for a CUDA device come from a CUDA generator (the export's,
    verification's and memory measurement's draws: a B=32 CFM key's 4.2 G values drawn on the host
    took ~26 s); same shapes and dtypes as a host draw."""
    from c2w.runtime.model.config import preset
    cfg, key = preset("tiny"), ShapeKey.named("cfm", "float16", B=2, T=50, L=100)
    host = SPECS["cfm"].example_inputs(cfg, key, torch.Generator().manual_seed(1), device="cuda")
    dev = SPECS["cfm"].example_inputs(cfg, key, torch.Generator(device="cuda").manual_seed(1), device="cuda")
    default = SPECS["cfm"].example_inputs(cfg, key, seed=1, device="cuda")
    assert [(t.device.type, t.shape, t.dtype) for t in dev] == [(t.device.type, t.shape, t.dtype) for t in host]
    assert all(torch.equal(a, b) for a, b in zip(default, dev))


def test_eager_hift_is_captured_in_one_cuda_graph():
    """Eager HiFT on CUDA copies its constant tables from pinned host memory (hift._on_device), so
    one CUDA graph captures it; replayed on new inputs, it gives eager's output to 1e-5."""
    from c2w.runtime.model.config import TINY
    from c2w.runtime.model.hift import HiftVocoder
    torch.manual_seed(0)
    hift = HiftVocoder(TINY.hift).cuda().eval()
    frames, spf, harmonics = 20, TINY.hift.samples_per_frame, TINY.hift.nb_harmonics + 1
    mel = torch.randn(2, TINY.mel_bins, frames, device="cuda")
    noise = torch.randn(2, frames * spf, harmonics, device="cuda")
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                hift(mel, noise)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            speech, _ = hift(mel, noise)
        for _ in range(2):
            mel.copy_(torch.randn_like(mel))
            noise.copy_(torch.randn_like(noise))
            graph.replay()
            torch.testing.assert_close(speech, hift(mel, noise)[0], rtol=1e-5, atol=1e-5)
