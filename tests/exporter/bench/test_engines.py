"""`c2w bench` plumbing on the tiny CPU artifacts: schema and same-function checks, never a time."""
import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from c2w.cli import app
from c2w.exporter.bench.engines import bench_dir, to_markdown
from c2w.runtime.ring import RingCache
from c2w.runtime.units import SPECS

pytestmark = pytest.mark.slow


KEYS = ["cfm-B1-T50-L150-float32", "hift-B1-F58-S3840-float32"]
OOM = "RuntimeError: CUDA out of memory (simulated)"
EAGER_OOM = "CUDA out of memory. Tried to allocate 21.50 GiB (simulated)"


class OutOfMemoryEager:
    """An eager runner whose every call runs out of device memory, as the B=32 CFM key's eager
    solve does on an 80 GB GPU."""
    def run(self, key, inputs, trim=None):
        import torch
        raise torch.cuda.OutOfMemoryError(EAGER_OOM + "\nmore lines of allocator detail")


@pytest.fixture(scope="module")
def bench_run(ort_artifacts, tmp_path_factory):
    """One library bench run over the session's directory, shared by the tests below: two keys,
    a B=2 streaming row whose measurement raises (a simulated CUDA out-of-memory) and then the
    B=1 28-token row; the second key's eager run runs out of device memory (simulated). Returns
    (result, what it wrote, (stream rows, key rows) at every save)."""
    import logging

    import c2w.exporter.bench.engines as bench
    import c2w.runtime.cache
    import c2w.runtime.manifest
    out = tmp_path_factory.mktemp("bench") / "b.json"
    saved, reads, precision_log = [], [], []
    real_write, real_row, real_read = bench.write, bench._stream_row, c2w.runtime.manifest.read_manifest
    real_cells = bench.eager_cells

    def cells(row, eager, eager32, key, inputs, *rest):
        return real_cells(row, OutOfMemoryEager() if key.id == KEYS[1] else eager, eager32, key, inputs, *rest)

    def counted(out_dir):
        reads.append(out_dir)
        return real_read(out_dir)

    class Recorder(logging.Handler):
        def emit(self, record):
            precision_log.append(record.getMessage())

    def row(model, cache, device, B, N, P, trim, reps, **kw):
        if B == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_row(model, cache, device, B, N, P, trim, reps, **kw)
    log, handler = logging.getLogger("c2w.precision"), Recorder()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "write", lambda res, o: (saved.append((len(res["stream"]), len(res["keys"]))),
                                                   real_write(res, o)))
        mp.setattr(bench, "_stream_row", row)
        mp.setattr(bench, "eager_cells", cells)
        for module in (c2w.runtime.manifest, c2w.runtime.cache, bench):
            mp.setattr(module, "read_manifest", counted)
        try:
            res = bench_dir(ort_artifacts, reps=2, warmup=1, stream_reps=2, stream_warmup=1, peer=False, out=out,
                            keys=KEYS, stream_batches=[2, 1])
        finally:
            log.removeHandler(handler)
            log.setLevel(level)
    return res, out, saved, (reads, precision_log)


def test_bench_schema_and_same_function(bench_run):
    res, out, saved, _ = bench_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(res, default=str))
    # written as it went: after each streaming row, after each key, and at the end (the stream's
    # last entry, its cache stats, comes with the first key's save)
    n = len(res["stream"])
    assert saved == [(1, 0), (2, 0), (n, 1), (n, 2), (n, 2)]
    assert not list(out.parent.glob("*.tmp"))
    assert {"device", "torch", "backend", "model", "precision", "commit", "keys", "stream"} <= set(res)
    assert [r["id"] for r in res["keys"]] == KEYS
    r = res["keys"][0]
    for v in ("eager", "engine"):
        assert r[v]["reps"] == 2 and r[v]["median_ms"] > 0 and r[v]["p95_ms"] >= r[v]["median_ms"]
    # the engine timed is the eager function: same outputs on the same inputs
    assert r["engine"]["max_rel_l2_vs_eager"] <= SPECS[r["component"]].rtol[r["dtype"]]
    assert r["served_variant"] == "engine"          # ONNX Runtime on CPU: no graphs
    assert r["speedup_vs_eager"] == r["eager"]["median_ms"] / r["engine"]["median_ms"]
    assert r["engine"]["load_and_first_call_s"] > 0
    rows = [s for s in res["stream"] if "B" in s and "error" not in s]
    assert [(s["B"], s["chunk_tokens"]) for s in rows] == [(1, 28)]
    assert rows[0]["audio_s_per_s_first"] > 0
    # every unit call of the engines rows is accounted for: 3 units x (1 warm-up + 2 timed) chunks,
    # all served by engines (the directory holds every key of a B=1 28-token session)
    for phase in ("first", "steady"):
        assert rows[0][f"engines_{phase}"]["reps"] == 2
        assert rows[0][f"engines_{phase}"]["engine_calls"] == 9
        assert rows[0][f"engines_{phase}"]["eager_fallbacks"] == 0
        assert "engine_calls" not in rows[0][f"eager_{phase}"]
    stats = res["stream"][-1]["cache_stats"]
    assert stats["cfm"]["cfm-B1-T50-L100-float32"]["hits"] > 0        # the engine rows used engines
    md = to_markdown(res)
    assert "| cfm-B1-T50-L150-float32 |" in md and "| 1 | 28 |" in md and "| 9 / 0 |" in md
    # a CPU run of float32 artifacts leaves three sections out, and says why
    assert res["omitted"] == ["device memory the engines add at load: measured on CUDA only; this run is on the CPU",
                              "step-audio2 peer row: turned off (--no-peer)",
                              "B=1 session audio SNR against float32: the artifacts are float32 already"]


def test_a_failing_stream_row_is_reported_and_the_rest_goes_on(bench_run):
    res = bench_run[0]
    rows = [r for r in res["stream"] if "B" in r]
    assert rows[0] == {"B": 2, "chunk_tokens": 28, "prompt_frames": 100, "error": OOM}
    assert rows[1]["B"] == 1 and rows[1]["engines_first"]["median_ms"] > 0
    assert len(res["keys"]) == 2
    assert f"| 2 | 28 | failed: {OOM} |" in to_markdown(res)


def test_a_key_whose_eager_runs_out_of_memory_keeps_its_engine_cells_and_says_what_to_do(bench_run, ort_artifacts):
    res = bench_run[0]
    r = res["keys"][1]
    assert r["eager"] == {"error": f"eager {KEYS[1]} ran out of device memory (OutOfMemoryError: {EAGER_OOM}); "
                                   f"to time it, bench the key on its own (c2w bench {ort_artifacts} --keys "
                                   f"{KEYS[1]}) or on a GPU with more memory"}
    # the engine is still timed; what needs eager's outputs or time is left out, not made up
    assert r["engine"]["reps"] == 2 and r["engine"]["median_ms"] > 0
    assert "max_rel_l2_vs_eager" not in r["engine"]
    assert r["speedup_vs_eager"] is None and r["best_speedup_vs_eager"] is None
    md = to_markdown(res)
    row = next(line for line in md.splitlines() if line.startswith(f"| {KEYS[1]} |"))
    assert row.split(" | ")[1] == "-" and row.split(" | ")[5] == "-" and row.split(" | ")[6] == "nan"
    assert f"- {KEYS[1]}, eager: {r['eager']['error']}" in md.splitlines()


def test_eager_cells_keep_eager_when_only_the_float32_reference_runs_out_of_memory():
    import torch

    from c2w.exporter.bench.engines import eager_cells
    from c2w.runtime.units import ShapeKey

    class Eager:
        def run(self, key, inputs, trim=None):
            return [inputs[0] * 2]
    key = ShapeKey.named("cfm", "float16", B=32, T=150, L=400)
    row = {}
    want, ref32 = eager_cells(row, Eager(), OutOfMemoryEager(), key, [torch.ones(3)], torch.device("cpu"),
                              0, 1, Path("art"))
    assert torch.equal(want[0], torch.full((3,), 2.0)) and ref32 is None
    assert row["eager"]["reps"] == 1 and "fp32_fidelity" not in row["eager"]
    assert row["eager"]["fp32_fidelity_error"].startswith(
        f"the float32 model's {key.id} ran out of device memory (OutOfMemoryError: {EAGER_OOM}); ")
    row = {}
    assert eager_cells(row, Eager(), Eager(), key, [torch.ones(3)], torch.device("cpu"), 0, 1, Path("art"))[1] \
        .equal(torch.full((3,), 2.0))
    assert row["eager"]["fp32_fidelity"]["rel_l2"] == 0.0


def test_eager_under_one_graph_frees_its_graph_and_says_what_to_do_when_out_of_memory(monkeypatch):
    """The eager-graph cell's graph (and its pool: at the B=32 CFM key as large as the eager solve)
    is gone once the cell is timed, so the engines timed next have the memory; out of memory, the
    cell says what to do."""
    import gc
    import weakref

    import torch

    import c2w.exporter.bench.engines as bench
    from c2w.runtime.units import ShapeKey
    graphs = []

    class Graph:                                   # a stand-in CapturedCall: replays eager on the CPU
        def __init__(self, fn, shapes, dtypes, device, pool):
            self.fn = fn
            graphs.append(weakref.ref(self))

        def __call__(self, *a):
            return self.fn(*a)

    class Eager:
        def run(self, key, inputs, trim=None):
            return [inputs[0] * 2]
    monkeypatch.setattr(bench, "CapturedCall", Graph)
    monkeypatch.setattr(bench, "GraphPool", lambda device: None)
    key = ShapeKey.named("cfm", "float16", B=32, T=150, L=400)
    info, inputs, cpu = type("Info", (), {"input_shapes": [(3,)]})(), [torch.ones(3)], torch.device("cpu")
    cell = bench.eager_graph_cell(Eager(), key, info, inputs, [torch.full((3,), 2.0)], cpu, 0, 2, Path("art"))
    gc.collect()
    assert cell["reps"] == 2 and cell["max_rel_l2_vs_eager"] == 0.0
    assert len(graphs) == 1 and graphs[0]() is None

    def out_of_memory(*a):
        raise torch.cuda.OutOfMemoryError(EAGER_OOM + "\nmore lines of allocator detail")
    monkeypatch.setattr(bench, "CapturedCall", out_of_memory)
    cell = bench.eager_graph_cell(Eager(), key, info, inputs, [torch.full((3,), 2.0)], cpu, 0, 2, Path("art"))
    assert cell == {"error": f"eager under one CUDA graph ran out of device memory (OutOfMemoryError: "
                             f"{EAGER_OOM}); to time it, bench the key on its own (c2w bench art --keys "
                             f"{key.id}) or on a GPU with more memory"}


def _bench_stand_in(monkeypatch, result):
    """The CLI's bench_dir, recording its arguments and returning `result` (a real run's): the
    command is an adapter over the library function the tests above run."""
    import c2w.exporter.bench.engines as bench
    calls = []

    def stand_in(artifact_dir, **kw):
        calls.append((artifact_dir, kw))
        return copy.deepcopy(result)
    monkeypatch.setattr(bench, "bench_dir", stand_in)
    return calls


def test_chunk_sizes_add_built_encoder_keys(ort_artifacts):
    """Streaming rows cover the schedule's chunk sizes plus those of built extra encoder keys."""
    import dataclasses

    from c2w.exporter.bench.engines import chunk_sizes
    from c2w.runtime.manifest import read_manifest
    m = read_manifest(ort_artifacts)
    assert chunk_sizes(m, 1) == [28]
    e = next(e for e in m.entries if e.id.startswith("flow_encoder-B1-"))
    extra = dataclasses.replace(e, id=e.id.replace("N28", "N78"), dims={**e.dims, "N": 78})
    m.entries.append(extra)
    assert chunk_sizes(m, 1) == [28, 78] and chunk_sizes(m, 2) == [28]
    m.entries.append(dataclasses.replace(extra, status="failed"))
    assert chunk_sizes(m, 1) == [28, 78]
    m.entries.append(dataclasses.replace(extra, id=extra.id.replace("N78", "N11").replace("last0", "last1"),
                                         dims={**extra.dims, "N": 11, "last": 1}))
    assert chunk_sizes(m, 1) == [28, 78]                    # a final-chunk key is not a steady chunk
    m.entries.append(dataclasses.replace(extra, id=f"flow_encoder-B1-N153-C0-last0-{extra.dtype}",
                                         dims={**extra.dims, "N": 153, "C": 0}))
    assert chunk_sizes(m, 1) == [28, 78]                    # nor is a prompt's set-up (no cache)


def test_bench_reads_the_manifest_once_and_sets_its_precision_through_the_policy(bench_run, ort_artifacts):
    """The shared bench_dir run (streaming and per-key parts) read the manifest once and handed it
    to every part (each EngineCache included); the model was built, and TF32 set and logged, once,
    by runtime.manifest.model_from_manifest."""
    reads, precision_log = bench_run[3]
    assert reads == [ort_artifacts]
    assert precision_log == [
        "c2w: TF32 off for CUDA matmuls and cuDNN convolutions in this process (the manifest's precision.tf32)"]


def test_bench_cli_writes_json_and_markdown_beside_the_artifacts_and_says_what_it_omits(
        bench_run, tmp_path, monkeypatch):
    calls = _bench_stand_in(monkeypatch, bench_run[0])
    art = tmp_path / "art"
    art.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    r = CliRunner().invoke(app, ["bench", str(art), "--reps", "1", "--warmup", "1", "--stream-reps", "1",
                                 "--no-peer", "--keys", "flow_encoder-B1-N28-C100-last0-float32", "--batches", "1"])
    assert r.exit_code == 0, r.output
    out = art / "bench.json"
    # the counts asked for: 1 timed call per key and per streaming chunk, after 1 warm-up call
    assert calls == [(art, {"reps": 1, "keys": ["flow_encoder-B1-N28-C100-last0-float32"], "stream_batches": [1],
                            "peer": False, "out": out, "stream_reps": 1, "traffic": None, "cuda_graphs": None,
                            "warmup": 1, "stream_warmup": 1})]
    assert not list(work.iterdir())                                  # not into the working directory
    assert json.loads(out.read_text()) == json.loads(json.dumps(bench_run[0], default=str))
    assert out.with_suffix(".md").read_text().startswith("Device cpu")
    assert "Omitted: step-audio2 peer row: turned off (--no-peer)." in r.output
    for flag, graphs in (("--no-cuda-graphs", False), ("--cuda-graphs", True)):    # runtime.load's option
        r = CliRunner().invoke(app, ["bench", str(art), "--no-peer", flag])
        assert r.exit_code == 0, r.output
        assert calls[-1][1]["cuda_graphs"] is graphs


def test_snr_and_fidelity_values():
    import torch

    from c2w.exporter.bench.engines import fidelity, snr_db
    ref = torch.ones(1000, dtype=torch.float64)
    assert snr_db(ref, ref) == float("inf")
    assert abs(snr_db(ref * 1.1, ref) - 20.0) < 1e-9            # error 0.1 of the signal -> 20 dB
    f = fidelity(ref * 0.99, ref)
    assert abs(f["rel_l2"] - 0.01) < 1e-6 and abs(f["snr_db"] - 40.0) < 1e-4   # rel-L2 in float32


def test_session_fidelity_plumbing(ort_artifacts):
    """Same function on both sides: float32 eager against itself is exact; the engines (fp32 ORT)
    stay within the HiFT engine tolerance of it."""
    import torch

    from c2w.exporter.bench.engines import session_fidelity
    from c2w.runtime.cache import EngineCache
    from c2w.runtime.manifest import read_manifest
    from c2w.runtime.model.weights import load_model
    m = read_manifest(ort_artifacts)
    model = load_model(m.model.spec)
    cache = EngineCache(ort_artifacts, model)
    f = session_fidelity(model, model, cache, torch.device("cpu"), P=m.schedule["prompt_frames"], trim=True, chunks=2)
    assert f["chunks"] == 2 and f["samples"] > 0
    assert f["eager_vs_fp32"]["rel_l2"] == 0.0 and f["eager_vs_fp32"]["snr_db"] == float("inf")
    assert f["engines_vs_fp32"]["rel_l2"] <= 5e-3 and f["engines_vs_fp32"]["snr_db"] > 40
    assert sum(c["hits"] for c in cache.stats()["cfm"].values()) > 0


def test_bench_cli_profile_resolves_the_export_dir(bench_run, tmp_path, monkeypatch):
    calls = _bench_stand_in(monkeypatch, bench_run[0])
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["bench"])
    assert r.exit_code == 2 and "no artifact directory and no --profile" in r.output
    r = CliRunner().invoke(app, ["bench", "--profile", "cpu", "--out", "b.json", "--reps", "1", "--no-peer"])
    assert r.exit_code == 0, r.output
    # where `c2w export --profile cpu` writes, relative to the working directory
    assert [(d, kw["out"]) for d, kw in calls] == [(Path("artifacts") / "cpu", Path("b.json"))]
    assert json.loads((tmp_path / "b.json").read_text())["keys"][0]["id"] == KEYS[0]


def test_load_memory_counts_each_engine_as_it_loads(ort_artifacts, monkeypatch):
    """Per-engine load deltas (the weight-sharing check), with stand-ins for the three CUDA
    counters: every load adds 10 MiB to PyTorch's allocated memory, 4 more to its reserved
    memory (a graph pool) and 3 outside it, so each engine is credited exactly that."""
    import torch

    from c2w.exporter.bench.engines import load_memory, to_markdown
    from c2w.runtime.cache import EngineCache
    from c2w.runtime.manifest import read_manifest
    from c2w.runtime.model.weights import load_model
    model = load_model(read_manifest(ort_artifacts).model.spec)
    MiB = 1 << 20
    c = {"allocated": 1000 * MiB, "reserved": 1200 * MiB, "used": 1500 * MiB}
    real_load = EngineCache.load

    def load(self, key):
        c["allocated"] += 10 * MiB
        c["reserved"] += 14 * MiB
        c["used"] += 17 * MiB
        return real_load(self, key)

    monkeypatch.setattr(EngineCache, "load", load)
    cache, mem = load_memory(lambda: EngineCache(ort_artifacts, model), model, torch.device("cpu"),
                             counters=lambda: (c["allocated"], c["reserved"], c["used"]))
    assert len(cache.loaded) == 8 and sorted(mem["per_engine_bytes"]) == sorted(k.id for k in cache.loaded)
    split = {"total": 17 * MiB, "allocated": 10 * MiB, "pool": 4 * MiB, "outside": 3 * MiB}
    assert all(v == split for v in mem["per_engine_bytes"].values())
    assert set(mem["per_engine_added_bytes"].values()) == {10 * MiB}
    assert mem["added_bytes"] == 80 * MiB and mem["added_device_bytes"] == 8 * 17 * MiB
    assert mem["engines"] == {"flow_encoder": 3, "cfm": 3, "hift": 2}
    res = {"device": "cpu", "torch": "t", "backend": {"name": "onnxruntime", "version": "v"}, "model": {"spec": "m"},
           "precision": {}, "commit": "c", "date": "d", "keys": [],
           "stream": [{"memory": {**mem, "budget_bytes": 1 << 30, "within_budget": True}}]}
    md = to_markdown(res)
    assert "added 80 MiB of PyTorch-allocated memory (136 MiB on the whole device)" in md
    assert f"{cache.loaded[0].id} 17 (10 / 4 / 3)" in md
    cache.release()


def test_timed_runs_setup_outside_the_call_once_per_rep():
    import torch

    from c2w.exporter.bench.engines import timed
    made, got = [], []

    def setup():
        made.append(len(made))
        return made[-1]

    r = timed(got.append, torch.device("cpu"), warmup=2, reps=3, setup=setup)
    assert made == [0, 1, 2, 3, 4] and got == made            # each call gets its own fresh argument
    assert r["reps"] == 3 and r["p95_ms"] >= r["median_ms"] >= 0
    calls = []
    timed(lambda: calls.append(1), torch.device("cpu"), warmup=1, reps=2)
    assert len(calls) == 3



class RingEngine:
    """A stand-in for AOTI's in-place CFM engine: records the cache and trim of every call and
    returns a new object as the cache, which the next call must be handed."""
    takes_rings, solve_graphs = True, None

    def __init__(self):
        self.calls = []

    def run(self, inputs, trim=None):
        self.calls.append((inputs[5], trim))
        return [inputs[0], inputs[4], object()]


def test_a_steady_stream_hands_each_call_the_cache_the_last_one_returned():
    import torch

    from c2w.exporter.bench.engines import STREAM_WARMUP, steady_stream
    from c2w.runtime.trim import CacheTrim
    from c2w.runtime.units import ShapeKey
    key = ShapeKey.named("cfm", "float16", B=32, T=150, L=400)
    example = torch.zeros(1, 400, 1)
    inputs = [torch.zeros(1)] * 5 + [example]
    eng = RingEngine()
    out = steady_stream(eng, key, inputs, torch.device("cpu"), warmup=1, reps=3)
    assert out["reps"] == 3 and "solve_graphs" not in out
    assert len(eng.calls) == STREAM_WARMUP + 3
    first = eng.calls[0][0]                                   # the example cache, as a ring of its frames
    assert isinstance(first, RingCache) and first.buffer is example and list(first.order) == list(range(400))
    assert all(trim == CacheTrim(300) for _, trim in eng.calls)            # P = L - 100: back to L frames
    assert len({id(c) for c, _ in eng.calls[1:]}) == len(eng.calls) - 1    # each call its predecessor's cache
    # no steady stream for an engine that copies its cache, nor for a cache shorter than what the trim keeps
    plain = RingEngine()
    plain.takes_rings = False
    assert steady_stream(plain, key, inputs, torch.device("cpu"), 1, 3) is None and not plain.calls
    short = ShapeKey.named("cfm", "float16", B=1, T=300, L=0)
    assert steady_stream(RingEngine(), short, inputs, torch.device("cpu"), 1, 3) is None


def test_a_steady_stream_is_served_from_the_solve_graph_of_its_ring(monkeypatch):
    """AOTI's in-place replay with solve graphs (on the fake GPU of tests/runtime/engines/
    test_graphs.py, the tiny model's step): the first call lays the example cache out in a ring
    of the replay's own, the second, handed that ring back, captures the whole solve over its
    buffer, and every later call replays that graph, writing the same buffer in place."""
    import torch

    from c2w.exporter.bench.engines import STREAM_WARMUP, steady_stream
    from c2w.runtime.engines.aoti import AOTIEngine, EulerReplay
    from c2w.runtime.model.weights import load_model
    from c2w.runtime.units import ShapeKey
    from tests.runtime.engines.test_aoti import info_for
    from tests.runtime.engines.test_graphs import fake_cuda
    cuda, cpu = fake_cuda(monkeypatch), torch.device("cpu")
    model = load_model("random:tiny")
    key, spec = ShapeKey.named("cfm", "float32", B=1, T=4, L=100), SPECS["cfm"]
    unit = spec.export_variant.build(model).eval()
    replay = EulerReplay(cuda.kernel(lambda *a: torch.no_grad()(unit)(*a)), model.cfg.n_timesteps, cpu,
                         "in_place", solve_graphs=2)
    eng = AOTIEngine(info_for("cfm", (1, 4, 100), "float32", "tiny"), replay, cpu, [])
    inputs = spec.example_inputs(model.cfg, key, seed=7, device=cpu)
    buffers = []
    real = eng.run_impl
    monkeypatch.setattr(eng, "run_impl", lambda ins, trim=None: buffers.append(ins[5].buffer) or real(ins, trim))
    out = steady_stream(eng, key, inputs, cpu, warmup=1, reps=3)
    calls = STREAM_WARMUP + 3
    assert out["solve_graphs"] == {"captures": 1, "replays": calls - 1, "declined": 0, "held": 1}
    assert buffers[0] is inputs[5] and all(b is buffers[1] for b in buffers[2:])     # one buffer from call 2 on
    assert buffers[1].shape[-2] == 4 + 100
    eng.release()


def test_the_markdown_shows_the_served_variants_steady_stream():
    row = {"id": "cfm-B32-T150-L400-float16", "build_seconds": 1, "served_variant": "engine",
           "eager": {"median_ms": 160.0, "p95_ms": 161.0}, "speedup_vs_eager": 160 / 58,
           "engine": {"median_ms": 58.0, "p95_ms": 58.5, "max_rel_l2_vs_eager": 1e-3,
                      "steady_stream": {"median_ms": 52.0, "p95_ms": 52.5}},
           "stream_speedup_vs_eager": 160 / 52}
    res = {"device": "cuda", "torch": "t", "backend": {"name": "aoti", "version": "v"}, "model": {"spec": "s"},
           "precision": {}, "commit": "c", "date": "d", "keys": [row], "stream": []}
    line = next(x for x in to_markdown(res).splitlines() if x.startswith("| cfm-B32"))
    assert line.endswith("| 1 | 52.000 / 3.1x |")
