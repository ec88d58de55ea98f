"""runtime/engines/onnxruntime.py: ONNX Runtime engines on the CPU (their parity with eager is
tested through the runtime in tests/runtime/test_runtime.py)."""
import torch

from c2w import runtime
from c2w.runtime.units import ShapeKey


def test_cpu_sessions_use_as_many_threads_as_torch(ort_artifacts, monkeypatch):
    """Without a setting each session would start one thread per core (intra_op_num_threads 0)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    rt = runtime.load(ort_artifacts)
    key = ShapeKey("flow_encoder", (1, 28, 150, 0), "float32")
    assert rt.cache.load(key)
    engine = rt.cache._engines[key]
    assert engine.session.get_session_options().intra_op_num_threads == 3
    rt.release()
