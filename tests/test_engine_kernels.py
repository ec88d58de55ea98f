"""benchmarks/h200/engine_kernels.py on the CPU: it loads and runs built engines by key id, and
names what a directory lacks (the kernel table itself needs CUDA)."""
import json

import pytest

from benchmarks.h200.engine_kernels import profile_keys
from c2w.runtime.manifest import read_manifest


def test_built_keys_are_loaded_run_and_recorded(ort_artifacts, tmp_path):
    key = next(e.id for e in read_manifest(ort_artifacts).entries
               if e.status == "built" and e.component == "flow_encoder")
    (res,) = profile_keys(ort_artifacts, [key], tmp_path, warmup=1)
    saved = json.loads((tmp_path / f"engine_kernels_{key}.json").read_text())
    assert saved == res and res["key"] == key and res["backend"] == "onnxruntime" and res["profile"] is None
    assert res["call"] == "example inputs"


def test_an_engine_that_takes_rings_is_profiled_as_a_steady_stream_serves_it(ort_artifacts, tmp_path, monkeypatch):
    """A CFM engine taking its cache as a ring gets, in its warmup (and on CUDA in its profiled
    call), the ring the call before returned, not the example cache (which its replay would lay
    out anew)."""
    from c2w.runtime import engines
    from c2w.runtime.ring import RingCache
    key = next(e.id for e in read_manifest(ort_artifacts).entries if e.status == "built" and e.component == "cfm")
    backend = engines.get_backend("onnxruntime")
    real_load = type(backend).load
    caches = []

    def load(self, *args, **kwargs):
        engine = real_load(self, *args, **kwargs)

        class Rings:                    # the ORT engine, taking and returning rings as AOTI's in-place step does
            takes_rings = True

            def run(self, inputs, trim=None):
                caches.append(inputs[5])
                out = engine.run(list(inputs[:5]) + [inputs[5].logical()])
                return [*out[:2], trim.apply(RingCache.of(out[2]))]

            def release(self):
                engine.release()
        return Rings()
    monkeypatch.setattr(type(backend), "load", load)
    (res,) = profile_keys(ort_artifacts, [key], tmp_path, warmup=1)
    assert res["call"] == "steady stream"
    assert all(isinstance(c, RingCache) for c in caches) and len({id(c) for c in caches}) == len(caches)


def test_a_key_not_built_is_named_with_the_built_ones(ort_artifacts, tmp_path):
    with pytest.raises(SystemExit, match=r"not built in .*: cfm-B9-T1-L1-float32; built: .*flow_encoder-"):
        profile_keys(ort_artifacts, ["cfm-B9-T1-L1-float32"], tmp_path)
