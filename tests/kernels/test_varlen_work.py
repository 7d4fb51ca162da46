"""`Varlen.work` in closed form equals the row-by-row count of `Varlen.visible` and the FP64 oracle's mask.

The planner prices every kernel call by its work (`sim.plan.dry`), at up to 10^6 rows a call: `work` sums each
sequence's row widths as arithmetic series between the kinks of the mask's two ends, not row by row. An off-by-one at
a kink, a window's left edge taken as inclusive on the wrong side, or a shift ignored would change the count.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpref.kernels import Varlen
from sim import oracle


def row_by_row(seqs: Varlen, causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """`(rows that see a key, visible pairs)`, row by row."""
    widths = [max(0, hi - lo) for i in range(seqs.num_seqs) for lo, hi in
              (seqs.visible(i, x, causal, window) for x in range(seqs.cu_q[i + 1] - seqs.cu_q[i]))]  # fmt: skip
    return sum(w > 0 for w in widths), sum(widths)


@settings(max_examples=300, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(-45, 45)), min_size=1, max_size=4),
    causal=st.booleans(),
    left=st.sampled_from([-1, 0, 1, 3, 17, 60]),
    right=st.sampled_from([-1, 0, 2, 9, 60]),
)
def test_work_and_rows_seeing_in_closed_form_are_the_rows_visible_keys(lens, causal, left, right):
    q_lens, kv_lens, shifts = zip(*lens)
    for seqs in (Varlen.from_lengths(q_lens, kv_lens), Varlen.from_lengths(q_lens, kv_lens, shifts)):
        window = (left, 0 if causal else right)
        assert (seqs.rows_seeing(causal, window), seqs.work(causal, window)) == row_by_row(seqs, causal, window)


def test_work_is_the_oracles_visible_pairs_on_packed_documents():
    """Self-attention over documents of 1 to 300 tokens: the oracle's mask, counted."""
    cu = torch.tensor([0, 1, 65, 365, 372])
    seqs = Varlen(cu.tolist())
    for causal, window in ((True, (-1, -1)), (True, (31, 0)), (False, (-1, -1)), (False, (5, 12))):
        mask = oracle.visibility_mask(cu, causal=causal, window=window)
        assert seqs.work(causal, window) == int(mask.sum()), (causal, window)
