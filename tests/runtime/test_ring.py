"""The estimator's attention cache held in place (runtime/ring.py): a RingCache's logical tensor,
its free slots, the trim as a change of order only, and the code that takes only tensors
(the slot pool) getting the logical tensor."""
import pytest
import torch

from c2w.runtime.ring import RingCache, logical
from c2w.runtime.trim import CacheTrim


def frames(S: int, steps: int = 2) -> torch.Tensor:
    """A (steps, depth 1, 2, heads 1, S, 2) buffer whose slot i holds the value i (both channels)."""
    return torch.arange(S, dtype=torch.float32)[:, None].expand(S, 2).expand(steps, 1, 2, 1, S, 2).contiguous()


def slots_of(t: torch.Tensor) -> list[int]:
    return t[0, 0, 0, 0, :, 0].int().tolist()


def test_a_ring_reads_as_its_frames_in_order_and_names_its_free_slots():
    buffer = frames(8)
    ring = RingCache(buffer, [5, 6, 7, 0, 1])
    assert ring.shape == (2, 1, 2, 1, 5, 2) and ring.frames == 5 and ring.dtype == torch.float32
    assert ring.free() == [2, 3, 4]
    assert slots_of(ring.logical()) == [5, 6, 7, 0, 1] and ring.runs() == [(0, 5, 3), (3, 0, 2)]
    assert slots_of(logical(ring)) == [5, 6, 7, 0, 1] and logical(buffer) is buffer
    # one run of consecutive slots is a view of the buffer, no copy
    run = RingCache(buffer, [2, 3, 4]).logical()
    assert run.data_ptr() == buffer[..., 2:, :].data_ptr() and slots_of(run) == [2, 3, 4]
    # a tensor is a ring that fills its buffer in order: itself
    whole = RingCache.of(buffer)
    assert whole.buffer is buffer and whole.free() == [] and whole.logical().data_ptr() == buffer.data_ptr()
    assert RingCache.of(ring) is ring


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 8]], ids=["repeated", "outside"])
def test_an_order_that_does_not_name_distinct_slots_of_the_buffer_is_refused(order):
    with pytest.raises(ValueError, match=r"order must name distinct slots of the buffer's 8"):
        RingCache(frames(8), order)


def test_the_trim_of_a_ring_drops_frames_from_its_order_and_keeps_the_buffer():
    """CacheTrim(P=2) on 110 frames keeps the first 2 and the last 100: upstream's frames
    [0, 2) and [10, 110). On a ring those are positions in its order, not slots; the buffer is
    the ring's own, and the dropped frames' slots are free for the next chunk."""
    buffer = frames(115)
    order = list(range(5, 115))                 # 110 frames; slots 0..4 free
    ring = RingCache(buffer, order)
    trimmed = CacheTrim(2).apply(ring)
    assert isinstance(trimmed, RingCache) and trimmed.buffer is buffer
    assert trimmed.order == tuple(order[:2] + order[10:])
    assert trimmed.free() == [0, 1, 2, 3, 4] + list(range(7, 15))
    assert torch.equal(trimmed.logical(), CacheTrim(2).apply(ring.logical()))
    assert CacheTrim(2).apply(trimmed) is trimmed           # nothing more to drop


def test_a_clone_is_independent_and_laid_out_as_the_ring():
    ring = RingCache(frames(6), [4, 5, 0])
    copy = ring.clone()
    ring.buffer.zero_()
    assert copy.order == ring.order and copy.buffer.shape == ring.buffer.shape
    assert slots_of(copy.logical()) == [4, 5, 0]


def test_the_slot_pool_stores_a_ring_as_its_frames_in_order():
    """The server's pool takes tensors only: a stream whose estimator cache is a ring is written
    as the ring's logical tensor, and gathered back so."""
    from tests.runtime.test_slots import LENGTHS, P, pool, state
    p, st = pool(2), state(1)
    want = st.estimator_att
    L = want.shape[-2]
    # two runs of slots after L free ones: frames [2, L) in slots [L, 2L - 2), frames [0, 2) after them
    buffer = torch.cat([torch.full_like(want, float("nan")), want[..., 2:, :], want[..., :2, :]], dim=-2)
    st.estimator_att = RingCache(buffer, [2 * L - 2, 2 * L - 1, *range(L, 2 * L - 2)])
    assert [(f, n) for f, _, n in st.estimator_att.runs()] == [(0, 2), (2, L - 2)]
    assert p.scatter([1], st) == LENGTHS
    assert torch.equal(p.gather([1], LENGTHS, P, [None]).estimator_att, want)
