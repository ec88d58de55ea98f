"""The flow encoder's relative positions: the table rows a chunk reads (a width rounded up to
POSITION_ALIGN), the one product per head that scores the queries against them, and the skew
that turns those scores into scores against keys (design note 29). The skew and the window are
slices and reshapes, so those comparisons are bit for bit; the oracle tests (test_encoder.py)
check the whole attention's values."""
import pytest
import torch

from c2w.runtime.model.config import TINY
from c2w.runtime.model.encoder import (MAX_POS, POSITION_ALIGN, ConformerEncoder, _align_relative,
                                       _RelPosSelfAttention, relative_position_table)


def skew_by_index(scores: torch.Tensor, keys: int) -> torch.Tensor:
    """The reference: query i of T against key j reads column T-1-i+j (offset (S-1) - column)."""
    t = scores.shape[2]
    i = torch.arange(t)[:, None]
    j = torch.arange(keys)[None, :]
    return scores[:, :, i, t - 1 - i + j]


@pytest.mark.parametrize("queries, keys", [(1, 1), (3, 3), (5, 11), (25, 175), (50, 350), (8, 24)])
@pytest.mark.parametrize("spare", range(POSITION_ALIGN))
def test_the_skew_reads_each_key_at_its_offset_whatever_the_spare_columns(queries, keys, spare):
    scores = torch.randn(2, 3, queries, queries + keys - 1 + spare)
    assert torch.equal(_align_relative(scores, keys), skew_by_index(scores, keys))


@pytest.mark.parametrize("queries, keys", [(1, 1), (25, 175), (50, 350), (75, 275), (150, 550), (8, 24),
                                           (1, MAX_POS), (300, MAX_POS), (MAX_POS, MAX_POS)])
def test_a_chunk_reads_an_aligned_window_starting_at_its_oldest_key(queries, keys):
    enc = ConformerEncoder(TINY.encoder)
    rows = enc._rel_pos(queries, keys, torch.float32)
    width = rows.shape[1]
    assert width % POSITION_ALIGN == 0 and queries + keys - 1 <= width < queries + keys - 1 + POSITION_ALIGN
    table = enc.pos_table[0]
    centre = MAX_POS - 1                                  # the row of offset 0
    assert torch.equal(rows[0], table[centre - keys + 1: centre - keys + 1 + width])
    # the rows the keys are read at: offsets +(keys-1) .. -(queries-1)
    assert torch.equal(rows[0, : queries + keys - 1], table[centre - (keys - 1): centre + queries])


def test_the_spare_rows_leave_upstreams_rows_as_they_were():
    plain = relative_position_table(64)
    padded = relative_position_table(64, spare=POSITION_ALIGN - 1)
    assert padded.shape == (1, 2 * MAX_POS - 1 + POSITION_ALIGN - 1, 64)
    assert torch.equal(padded[:, : 2 * MAX_POS - 1], plain)
    assert torch.equal(padded[0, -1], relative_position_table(64, MAX_POS + POSITION_ALIGN - 1)[0, -1])


def test_the_position_term_is_one_product_per_head_over_every_query_row():
    """Not a product per (sequence, head) with the projected table broadcast along the batch,
    which the libraries take as a copy of the table per sequence."""
    attn = _RelPosSelfAttention(32, 4).eval()
    b, t, cached, width = 3, 5, 6, 16
    args = (torch.randn(b, t, 32), torch.randn(1, width, 32), torch.randn(b, 4, cached, 16))
    graph = torch.export.export(attn, args).run_decompositions().graph
    products = [tuple(n.meta["val"].shape) for n in graph.nodes if n.target is torch.ops.aten.bmm.default]
    assert [s for s in products if s[-1] == width] == [(4, b * t, width)]
