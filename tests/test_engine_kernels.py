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


def test_a_key_not_built_is_named_with_the_built_ones(ort_artifacts, tmp_path):
    with pytest.raises(SystemExit, match=r"not built in .*: cfm-B9-T1-L1-float32; built: .*flow_encoder-"):
        profile_keys(ort_artifacts, ["cfm-B9-T1-L1-float32"], tmp_path)
