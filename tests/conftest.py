"""Shared fixtures: one tiny ONNX Runtime artifact directory built by the real exporter."""
import dataclasses
import logging
import shutil
from pathlib import Path

import pytest

from exporter.profile import load_profile

logging.getLogger("torch.onnx").setLevel(logging.ERROR)


def small_profile(**schedule):
    """profiles/cpu.yaml with one batch size and 3 chunks: 8 keys, ~40 s to build on 2 cores."""
    p = load_profile("cpu")
    s = dataclasses.replace(p.schedule, batch_sizes=(1,), max_chunks=3, **schedule)
    return dataclasses.replace(p, schedule=s)


@pytest.fixture(scope="session")
def ort_artifacts(tmp_path_factory) -> Path:
    from exporter.export import export_profile
    out = tmp_path_factory.mktemp("art") / "cpu"
    res = export_profile(small_profile(), out)
    assert res.failed == 0, [e.error for e in res.manifest.entries if e.error]
    return out


@pytest.fixture
def artifacts_copy(ort_artifacts, tmp_path) -> Path:
    """A private copy a test may damage."""
    dst = tmp_path / "art"
    shutil.copytree(ort_artifacts, dst)
    return dst
