"""Upstream's trim of a growing attention cache (runtime.trim): which frames survive, and the copy."""
import pytest
import torch

from c2w.runtime.trim import KEEP_RECENT, CacheTrim, trim_last


@pytest.mark.parametrize("P, n, kept", [(50, 150, [(0, 150)]), (50, 151, [(0, 50), (51, 100)]),
                                        (50, 400, [(0, 50), (300, 100)]), (0, 100, [(0, 100)]),
                                        (0, 130, [(30, 100)])])
def test_a_cache_keeps_its_first_P_and_last_100_frames_once_it_passes_P_plus_100(P, n, kept):
    assert KEEP_RECENT == 100
    assert CacheTrim(P).kept(n) == kept


@pytest.mark.parametrize("dtype, width, wide", [(torch.float16, 128, True), (torch.float32, 16, True),
                                               (torch.float16, 3, False), (torch.float32, 5, False)])
def test_trim_keeps_the_prompt_and_the_last_100_frames_byte_for_byte(dtype, width, wide, monkeypatch):
    """The trim copies through int64 views where a frame's row allows it (fp16 x 128: yes; 3 fp16
    or 5 fp32 values: no), and only there; either way the result is the first P and the last 100
    frames, exactly, and a cache within P + 100 frames is returned as it is."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 3, 4, 170, width, generator=g).to(dtype)
    cache[0, 0, 0, 0, 0] = float("nan")                       # bytes, not values: a NaN survives
    copied = []                                                # the dtype of each copy the trim makes
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, *a, **k: copied.append(src.dtype) or real_copy(dst, src, *a, **k))
    got = CacheTrim(50).apply(cache)
    monkeypatch.undo()
    assert copied == [torch.int64 if wide else dtype] * 2
    want = torch.cat([cache.narrow(3, 0, 50), cache.narrow(3, 70, 100)], 3)
    assert got.shape == (2, 3, 4, 150, width) and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    short = cache.narrow(3, 0, 150)
    assert CacheTrim(50).apply(short) is short
    assert CacheTrim(50).apply(got) is got                     # a trimmed cache is trimmed already


def test_without_a_prompt_only_the_last_100_frames_stay():
    cache = torch.arange(130.0).reshape(1, 130, 1)
    assert torch.equal(CacheTrim(0).apply(cache), cache[:, 30:])


def test_trim_last_trims_the_last_output_only():
    a, cache = torch.zeros(3), torch.arange(160.0).reshape(160, 1)
    got = trim_last((a, cache), CacheTrim(10))
    assert got[0] is a and torch.equal(got[1], torch.cat([cache[:10], cache[60:]]))
    assert trim_last((a, cache), None)[1] is cache
