"""Every engine's `run` checks its inputs against the artifact before the backend sees them."""
from pathlib import Path

import pytest
import torch

from c2w.runtime.engines import NAMES, get_backend
from c2w.runtime.engines.base import ArtifactInfo, Engine
from c2w.runtime.errors import C2WUserError
from c2w.runtime.trim import CacheTrim


class _Echo(Engine):
    def __init__(self, info):
        self.info, self.calls, self.trims = info, 0, []

    def run_impl(self, inputs, trim=None):
        self.calls += 1
        self.trims.append(trim)
        return list(inputs)


INFO = ArtifactInfo(Path("a/hift-B1-F50-S0-float32.onnx"), ("mel", "noise"), ("speech", "source"),
                    ((1, 80, 50), (1, 24000, 9)), ("float32", "float32"))


def test_run_checks_count_shape_and_dtype_then_calls_run_impl():
    engine = _Echo(INFO)
    mel, noise = torch.zeros(1, 80, 50), torch.zeros(1, 24000, 9)
    assert engine.run([mel, noise])[0] is mel and engine.calls == 1
    cases = [([mel], r"inputs for hift-B1-F50-S0-float32.onnx: received 1 tensors; expected 2 tensors \['mel', 'noise'\]"),
             ([mel, torch.zeros(1, 24000, 8)], r"tensor 'noise': received shape \(1, 24000, 8\); expected shape \(1, 24000, 9\)"),
             ([mel.half(), noise], r"tensor 'mel': received dtype torch.float16; expected dtype torch.float32")]
    for inputs, message in cases:
        with pytest.raises(C2WUserError, match=message):
            engine.run(inputs)
    assert engine.calls == 1


def test_run_returns_the_last_output_trimmed_by_the_streams_trim():
    """The last output of the encoder and the CFM is the attention cache: `run` trims it (frames on
    axis -2) by the trim it is given, and leaves every output as it is without one."""
    engine = _Echo(INFO)
    mel, noise = torch.zeros(1, 80, 50), torch.arange(24000 * 9.0).reshape(1, 24000, 9)
    out = engine.run([mel, noise], CacheTrim(10))
    assert out[0] is mel and torch.equal(out[1], torch.cat([noise[:, :10], noise[:, -100:]], 1))
    assert engine.run([mel, noise])[1] is noise
    assert engine.trims == [CacheTrim(10), None]          # the backend is told, to write it itself


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_declares_its_graph_policy(name, monkeypatch):
    """`cuda_graphs` and `graphed` are the Backend protocol's, on every backend: what a caller
    (runtime.load, c2w bench) asks instead of probing attributes. A small key is captured on CUDA
    exactly when the backend captures at all and was asked to; never on the CPU."""
    monkeypatch.delenv("C2W_AOTI_CUDA_GRAPHS", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for requested in (False, True):
        backend = get_backend(name, cuda_graphs=requested)
        assert backend.cuda_graphs is (requested and backend.captures_cuda_graphs)
        assert backend.graphed(INFO, cuda) is backend.cuda_graphs
        assert backend.graphed(INFO, cpu) is False
    assert get_backend(name).cuda_graphs is (name == "aoti")       # the defaults: only AOTI captures
