"""Resident stream state (runtime/slots.py): slots handed out and back, a batch's state written to
its streams' slots and gathered back in any order, caches too long for a slot refused before
anything is written. On a small hand-made StreamState (the pools never look inside a unit)."""
import pytest
import torch

from c2w.runtime.errors import C2WUserError
from c2w.runtime.slots import SlotPool, ServerFullError
from c2w.runtime.stream import StreamState
from c2w.runtime.trim import KEEP_RECENT

P = 4                   # the pool's max_prompt_frames: conformer and estimator caches hold P + KEEP_RECENT


def state(B: int, C: int = 3, L: int = 5, F: int = 2, S: int = 6, seed: int = 0) -> StreamState:
    """A B-row state with random values, in StreamState's layouts (the estimator's 2B rows are
    [conditional | unconditional])."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return StreamState(prompt_frames=P, spk=r(B, 4), conformer_cnn=r(B, 3, 2), conformer_att=r(2, B, 2, C, 4),
                       estimator_cnn=r(2, 2, 2 * B, 4, 2), estimator_att=r(2, 2, 2 * B, 2, L, 4),
                       hift_mel=r(B, 3, F), hift_source=r(B, 1, S), hift_speech=r(B, S), generators=[None] * B)


def pool(capacity: int) -> SlotPool:
    return SlotPool(state(1), capacity, P, hift_mel_frames=8, hift_source_samples=16)


LENGTHS = {"conformer_att": 3, "estimator_att": 5, "hift_mel": 2, "hift_source": 6, "hift_speech": 6}


def test_slots_are_handed_out_until_full_and_a_released_one_is_reused():
    p = pool(2)
    assert (p.acquire(), p.acquire(), p.in_use) == (0, 1, 2)
    with pytest.raises(ServerFullError, match=r"stream server: received 2 open streams; expected at most max_streams=2"):
        p.acquire()
    p.release(0)
    p.release(0)                                     # twice: still one free slot
    assert (p.in_use, p.acquire(), p.in_use) == (1, 0, 2)
    with pytest.raises(C2WUserError, match=r"max_streams: received 0; expected at least 1"):
        pool(0)


def test_pools_are_sized_for_the_longest_caches():
    p = pool(3)
    assert p.limits["conformer_att"] == p.limits["estimator_att"] == P + KEEP_RECENT
    assert p.pools["estimator_att"].shape == (2, 2, 2, 3, 2, P + KEEP_RECENT, 4)   # halves on an axis of their own
    assert p.pools["hift_speech"].shape == (3, 16)
    assert p.nbytes == sum(t.numel() * 4 for t in p.pools.values())


def test_a_scattered_batch_gathers_back_in_any_slot_order():
    """Rows 0 and 1 written to slots 3 and 1, gathered as slots [1, 3]: every field comes back with
    its rows swapped, the estimator's conditional and unconditional halves each swapped."""
    p, st = pool(4), state(2)
    assert p.scatter([3, 1], st) == LENGTHS
    back = p.gather([1, 3], LENGTHS, P, [None, None])
    for name in ("spk", "conformer_cnn", "hift_mel", "hift_source", "hift_speech"):
        assert torch.equal(getattr(back, name), getattr(st, name)[[1, 0]]), name
    assert torch.equal(back.conformer_att, st.conformer_att[:, [1, 0]])
    assert torch.equal(back.estimator_att, st.estimator_att[:, :, [1, 0, 3, 2]])
    assert torch.equal(back.estimator_cnn, st.estimator_cnn[:, :, [1, 0, 3, 2]])
    # a repeated slot is a padding row: the same values twice
    assert torch.equal(p.gather([3, 3], LENGTHS, P, [None] * 2).spk, st.spk[[0, 0]])


def test_rows_pick_what_is_written_and_copy_duplicates_a_slot():
    p, st = pool(3), state(3, seed=1)
    p.scatter([2], st, rows=[1])                         # rows 0 and 2 are padding: dropped
    assert torch.equal(p.gather([2], LENGTHS, P, [None]).hift_speech, st.hift_speech[[1]])
    assert p.pools["spk"][[0, 1]].abs().sum() == 0
    p.copy(2, 0)
    assert torch.equal(p.gather([0], LENGTHS, P, [None]).estimator_att, p.gather([2], LENGTHS, P, [None]).estimator_att)


def test_a_cache_too_long_for_its_slot_is_refused_before_anything_is_written():
    p = pool(2)
    too_long = state(1, C=P + KEEP_RECENT + 1, seed=2)
    with pytest.raises(C2WUserError, match=rf"stream cache 'conformer_att': received {P + KEEP_RECENT + 1} frames; "
                                           rf"expected at most {P + KEEP_RECENT}"):
        p.scatter([0], too_long)
    assert all(t.abs().sum() == 0 for t in p.pools.values())
