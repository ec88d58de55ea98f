"""Shared fixtures: one tiny ONNX Runtime artifact directory built by the real exporter."""
import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

# Triton kernels run on the CPU under Triton's interpreter (tests/runtime/model/test_triton_kernels.py).
# It is read when a kernel is defined, Triton's own library included, so before anything imports
# Triton (torch._inductor does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from c2w.exporter.profile import load_profile
from c2w.runtime.model.config import TINY
from c2w.runtime.units import ShapeKey

logging.getLogger("torch.onnx").setLevel(logging.ERROR)

# One intra-op thread for PyTorch here and in the processes the tests start (the example server).
# Most tests run the tiny model, whose ops are too small to split well over 2 cores, and two
# threads that wait on each other lose badly as soon as anything else wants a core. Measured on
# this 2-core machine beside other jobs, this process at raised priority (nice -15): the full-size
# CFM parity test 28 s with one thread, 114 s with two; a 2-chunk tiny session 14 s against 57 s.
# Not measured on an idle machine, where two threads may win back some of the full-size tests.
# C2W_TEST_THREADS=N sets another count.
THREADS = int(os.environ.get("C2W_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)   # ONNX Runtime's CPU sessions follow it (runtime/engines/onnxruntime.py)

ROOT = Path(__file__).resolve().parent.parent
# What the README's command 1 (`c2w export --profile profiles/cpu.yaml`) writes: its B=1 keys are
# the keys of small_profile(), so the session's directory starts from them (see seed_artifacts).
EXPORTED = ROOT / "artifacts" / "cpu"


def fewer_layers(cfg):
    """`cfg` with fewer repeated layers: 1 + 1 conformer blocks, 2 DiT blocks, HiFT residual
    blocks of 2 kernels x 2 dilations. Repeated layers apply the same ops to tensors of the same
    shapes (a kernel size or dilation is an attribute of the same Conv), so a graph of this model
    holds every op, dtype and dynamic dim of the full stack, and caches still stack over blocks;
    exporting or compiling it takes a fraction of the time, which grows with the node count."""
    return dataclasses.replace(
        cfg, encoder=dataclasses.replace(cfg.encoder, blocks=1, up_blocks=1), dit=dataclasses.replace(cfg.dit, depth=2),
        hift=dataclasses.replace(cfg.hift, resblock_kernels=(3, 11), resblock_dilations=((1, 5), (1, 5)),
                                 source_resblock_dilations=((1, 5),) * len(cfg.hift.upsample_rates)))


def checkpoint_dir(cfg, directory: Path) -> str:
    """A seeded random model of config `cfg` as a checkpoint directory (flow.pt, hift.pt,
    c2w_config.json): a model spec the exporter and the runtime load like any. Returns it."""
    import json

    from c2w.runtime.model.flow import FlowModel
    from c2w.runtime.model.hift import HiftVocoder
    from c2w.runtime.model.weights import init_random_
    flow, hift = FlowModel(cfg), HiftVocoder(cfg.hift)
    init_random_(flow, 0)
    init_random_(hift, 1)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(flow.state_dict(), directory / "flow.pt")
    torch.save(hift.state_dict(), directory / "hift.pt")
    (directory / "c2w_config.json").write_text(json.dumps(cfg.to_dict()))
    return str(directory)


def small_profile(**schedule):
    """profiles/cpu.yaml with one batch size and 3 chunks: 8 keys, minutes to build on 2 cores."""
    p = load_profile("cpu")
    s = dataclasses.replace(p.schedule, batch_sizes=(1,), max_chunks=3, **schedule)
    return dataclasses.replace(p, schedule=s)


def seed_artifacts(src: Path, dst: Path, ids: set[str]) -> int:
    """Copy the built entries of the artifact directory `src` whose id is in `ids`, with the shared
    weights files they read, into `dst` under a manifest listing just those. Entries whose files
    are not intact (size, sha256), or that name no shared files (an older layout), are left out.
    Returns how many were copied. The exporter then reuses an entry only if its identity (model
    digest, key, backend and torch versions, device, precision, weights layout) is what it would
    build now, and builds every other key. What `src` measured is not copied (each entry's
    resident bytes, the engines' shared state, the whole directory): those numbers belong to
    `src`'s set of keys, so the export into `dst` measures the seeded keys against its own budget.

    The tests that stop an export part-way take a copied entry to be reused. An entry made by an
    older c2w (another ARTIFACT_FORMAT, another torch) is copied but rebuilt, and those tests then
    fail: run command 1 again, or set C2W_TEST_REBUILD=1, which seeds nothing (docs/testing.md)."""
    if os.environ.get("C2W_TEST_REBUILD") == "1":
        return 0
    from c2w.runtime.manifest import file_problem, read_manifest, write_manifest
    try:
        m = read_manifest(src)
    except Exception:  # noqa: BLE001 - no usable directory: nothing to seed
        return 0
    entries, shared = [], {}
    for e in m.entries:
        files = e.extra.get("weights_files") or []
        if e.status != "built" or e.id not in ids or not files or not all(rel in m.shared for rel in files):
            continue
        if file_problem(src, e.artifact, e.artifact_bytes, e.artifact_sha256) or any(
                file_problem(src, rel, m.shared[rel]["bytes"], m.shared[rel]["sha256"]) for rel in files):
            continue
        entries.append(dataclasses.replace(e, device_bytes=None, memory_kind=""))
        shared.update({rel: m.shared[rel] for rel in files})
    for rel in [e.artifact for e in entries] + sorted(shared):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dst / rel)
    if entries:
        write_manifest(dst, dataclasses.replace(m, entries=entries, shared=shared, engine_shared_bytes={}, measured=None))
    return len(entries)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on the file `path` (created if missing), held while the block runs."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_shared_dir(tmp_path_factory) -> Path:
    """A directory every process of this test run sees: the run's base temporary directory, or
    with pytest-xdist the one above the workers' own (docs/testing.md)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def ort_artifacts(tmp_path_factory) -> Path:
    """small_profile() exported by the real exporter. Its keys already built by command 1 into
    artifacts/cpu are reused (export's resume) instead of built a second time: that build is
    most of a CI run's test set-up. C2W_TEST_REBUILD=1 builds every key here instead.

    Exported once per test run: the first worker process (pytest-xdist) to ask builds it under a
    file lock in the directory the workers share, the others wait for it and use the same
    directory. Tests only read it (a test that damages a directory takes `artifacts_copy`)."""
    from c2w.exporter.export import export_profile
    from c2w.exporter.plan import make_plan, precision_weights
    from c2w.runtime.model.weights import load_model
    shared = run_shared_dir(tmp_path_factory)
    out, done = shared / "ort_artifacts" / "cpu", shared / "ort_artifacts" / "done"
    with _locked(shared / "ort_artifacts.lock"):
        if done.is_file():
            return out
        shutil.rmtree(out, ignore_errors=True)      # left by a worker whose export failed
        p = small_profile()
        model = load_model(p.model)
        planned = {e.key.id for e in make_plan(model.cfg, p, precision_weights(model, p)).selected}
        seed_artifacts(EXPORTED, out, planned)
        res = export_profile(p, out)
        assert res.failed == 0, [e.error for e in res.manifest.entries if e.error]
        assert res.built + res.reused == 8
        done.touch()
    return out


@pytest.fixture
def artifacts_copy(ort_artifacts, tmp_path) -> Path:
    """A private copy a test may damage."""
    dst = tmp_path / "art"
    shutil.copytree(ort_artifacts, dst)
    return dst


@pytest.fixture
def no_tensorrt(monkeypatch):
    """`import tensorrt` raises ImportError, whether or not TensorRT is installed."""
    import sys
    monkeypatch.setitem(sys.modules, "tensorrt", None)


class EstimatedMemory:
    """Stands in for runtime.memory.MeasureProcess in tests of the export loop that are not about
    memory (AOTI compiles, TensorRT stand-ins): every key measures exactly its estimate and
    engines share nothing, so budgets set from estimates select what they select."""
    kind, alive = "host_anon", True

    def __init__(self, out_dir, manifest, device):
        pass

    def add(self, entry) -> dict:
        return {"bytes": entry.est_bytes, "shared": {}, "seconds": 0.0}

    def drop(self, key_id) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def measured_as_estimated(monkeypatch):
    import c2w.runtime.memory
    monkeypatch.setattr(c2w.runtime.memory, "MeasureProcess", EstimatedMemory)


@pytest.fixture
def recorded_measurement(monkeypatch):
    """`c2w verify` / verify_budget without the fresh process that measures the directory again:
    the directory measures what its manifest records (`Manifest.measured`, the export's own
    measurement of the same keys). For tests of the other checks; verify's measurement is
    tested in tests/exporter/test_budget.py and, of an intact directory, in test_merge.py."""
    import c2w.exporter.verify
    monkeypatch.setattr(c2w.exporter.verify, "measure_directory",
                        lambda out_dir, manifest, device: manifest.measured.to_dict())


@pytest.fixture
def recorded_parity(monkeypatch) -> list[str]:
    """`c2w verify` / verify_directory without their parity re-runs: every entry keeps the parity
    its manifest records, so the file checks (size, sha256) alone decide the outcome. For tests
    of those checks; a file that passes them is byte for byte the one whose parity was recorded.
    Returns the ids of the entries that reached the (skipped) parity run."""
    import c2w.exporter.verify
    reached = []
    monkeypatch.setattr(c2w.exporter.verify, "check_entry",
                        lambda model, backend, out_dir, entry, device: reached.append(entry.id))
    return reached


# ---- the stream server's artifacts: tests/runtime/test_serving.py, tests/exporter/bench/test_serving.py

# PCM, batched vs alone: the HiFT's NSF source integrates f0 into phases of ~1e4 rad, so the ~5e-7
# relative mel difference of a batched chunk (tests/runtime/test_serving.py MEL_TOL) moves the sine by up to ~3e-4 (measured; runtime/serving.py and
# docs/serving.md). The bound is HiFT's engine tolerance (runtime/units.py).
PCM_TOL = 5e-3
STEADY_B3 = [ShapeKey("flow_encoder", (3, 28, 200, 0), "float32"), ShapeKey("cfm", (3, 50, 200), "float32"),
             ShapeKey("hift", (3, 58, 3840), "float32")]
SETUP_B1 = [ShapeKey("flow_encoder", (1, 53, 0, 0), "float32"), ShapeKey("cfm", (1, 100, 0), "float32")]


SERVE_CFG = dataclasses.replace(fewer_layers(TINY), n_timesteps=2)


@pytest.fixture(scope="module")
def serve_dir(tmp_path_factory):
    """Built once per test file that uses it (module scope): small_profile()'s B=1 keys plus the B=1 prompt set-up keys and B=3 steady keys, of a
    SERVE_CFG model, built and verified by the real exporter. What the engines hold is not
    measured (each key counts its estimate: tests.conftest.EstimatedMemory); the budget's
    measurement is tested in tests/exporter/test_budget.py."""
    import c2w.runtime.memory
    from c2w.exporter.export import export_profile
    root = tmp_path_factory.mktemp("serve")
    p = dataclasses.replace(small_profile(setup_keys=True), extra_keys=tuple(STEADY_B3),
                            model=checkpoint_dir(SERVE_CFG, root / "model"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(c2w.runtime.memory, "MeasureProcess", EstimatedMemory)
        res = export_profile(p, root / "cpu")
    assert res.failed == 0 and res.built == 8 + len(STEADY_B3) + len(SETUP_B1), \
        [e.error for e in res.manifest.entries if e.error]
    return root / "cpu"


class _ProgramRunner:
    """What `torch._inductor.aoti_load_package` returns, for a stand-in package that is a saved
    ExportedProgram. Like a real package built without its constants, it refuses to run before
    `load_constants` binds them, and then runs with exactly the tensors bound."""

    def __init__(self, path, run_single_threaded: bool = False, device_index: int = -1):
        flags = {"c2w_constants_in_so": ""}
        self.program = torch.export.load(path, extra_files=flags)
        self.module = self.program.module()
        self.bound = {} if flags["c2w_constants_in_so"] == "1" else None

    def get_constant_fqns(self) -> list[str]:
        return [*self.program.state_dict, *self.program.constants]

    def load_constants(self, table, check_full_update: bool, user_managed: bool) -> None:
        assert user_managed and set(table) == set(self.get_constant_fqns())
        self.bound = dict(table)

    def __call__(self, *args):
        if self.bound is None:
            raise RuntimeError("run before its constants were bound (a real package crashes here)")
        with torch.no_grad():          # a compiled package records no autograd (and so writes its inputs freely)
            return torch.func.functional_call(self.module, self.bound, args)


@pytest.fixture
def aoti_without_compile(monkeypatch):
    """AOTI builds and loads without Inductor's C++ compile (~3 minutes of C++ a package on 2 cores):
    the builder's own code runs (torch.export, configs, the static-libstdc++ check) and the
    "package" is the ExportedProgram, saved; the runtime's AOTI loader loads it through
    `_ProgramRunner`, which runs it with the constants the loader binds. Parity is then a real
    comparison of what was saved against eager; it says nothing about Inductor's kernels."""
    def compile_and_package(ep, package_path, inductor_configs):
        in_so = inductor_configs["aot_inductor.package_constants_in_so"]
        torch.export.save(ep, package_path, extra_files={"c2w_constants_in_so": "1" if in_so else "0"})
        return package_path
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", _ProgramRunner)
