"""ONNX graphs whose weights live once on disk (exporter/backends/onnx_export.py): every
initializer moves to a content-addressed file beside the graph, equal tensors share one file
within a graph and across graphs, and the graph still computes what the module does."""
import numpy as np
import onnx
import torch

from c2w.exporter.backends.onnx_export import WEIGHTS_DIR, export_onnx, onnx_bytes_on_disk


class TwoEqualLinears(torch.nn.Module):
    """Two layers holding equal (not shared) 16 x 16 weights: one file's worth of content."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
            self.b.weight.copy_(self.a.weight)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_equal_weights_are_stored_once_and_the_graph_runs(tmp_path):
    import onnxruntime as ort
    unit, x = TwoEqualLinears().eval(), torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stats = export_onnx(unit, [x], ["x"], ["y"], tmp_path / "g1.onnx")
        again = export_onnx(unit, [torch.zeros(3, 16)], ["x"], ["y"], tmp_path / "g2.onnx")   # another shape
        want = unit(x).numpy()
    assert stats.initializer_bytes == 2 * 16 * 16 * 4 and stats.unique_bytes == 16 * 16 * 4
    assert len(stats.files) == 1 and stats.files[0].startswith(f"{WEIGHTS_DIR}/") and again.files == stats.files
    assert sorted(p.name for p in (tmp_path / WEIGHTS_DIR).iterdir()) == [stats.files[0].split("/")[1]]
    model = onnx.load(str(tmp_path / "g1.onnx"), load_external_data=False)
    assert all(i.data_location == onnx.TensorProto.EXTERNAL for i in model.graph.initializer if i.dims)
    # the graph file plus its one weights file, counted once
    assert onnx_bytes_on_disk(tmp_path / "g1.onnx") == ((tmp_path / "g1.onnx").stat().st_size
                                                        + (tmp_path / stats.files[0]).stat().st_size)
    got = ort.InferenceSession(str(tmp_path / "g1.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
