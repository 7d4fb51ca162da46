"""Packed documents at CP = 1: attention never crosses a document, positions restart at each one.

The logits of every document of a pack equal those of the document run alone (fp64, 1e-10),
whatever the family, with sliding windows too; EOD padding (`cu_seqlens_padded`) leaves the
real rows unchanged; and the positions are an input the model uses (with RoPE, only through
their differences). A window of `left + 1` keys changes exactly the rows past `left` of a
document, and a model without windows is bitwise the one it was.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.models import CPContext
from tests.helpers import assert_close
from tests.models.cases import FAMILIES, WINDOWED, packed, tiny_model, whole, windowed_model

LENGTHS = [5, 11, 1, 8]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_document_of_a_pack_gives_its_logits_alone(family):
    model = tiny_model(family)
    cu, tokens = packed(LENGTHS)
    logits = whole(model, tokens, cu)  # (T, V)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = whole(model, tokens[a:b], torch.tensor([0, b - a]))  # (L_i, V)
        assert_close(logits[a:b], alone, torch.float64, msg=f"{family} document {i}")


@pytest.mark.parametrize("family", FAMILIES)
def test_eod_padding_leaves_real_rows_unchanged(family):
    model = tiny_model(family)
    cu, tokens = packed(LENGTHS)
    padding = cpref.Sharding.eod_padded(cu, cp_size=4, layout="zigzag")  # every document to a multiple of 8
    padded = whole(model, padding.pad(tokens, value=3), cu, padding.cu_seqlens_padded)  # (T_pad, V) at CP = 1
    assert_close(padding.unpad(padded), whole(model, tokens, cu), torch.float64)


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_are_an_input_the_model_uses(family):
    """Positions reversed inside each document change every document longer than one token."""
    model = tiny_model(family)
    cu, tokens = packed(LENGTHS)
    reversed_pos = torch.cat([torch.arange(n).flip(0) for n in LENGTHS])
    with torch.no_grad():
        wrong = model(tokens, reversed_pos, CPContext.single(cu))
    right = whole(model, tokens, cu)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert torch.allclose(wrong[a:b], right[a:b]) == (b - a == 1), f"document {i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shift_of_a_documents_positions(family):
    """Positions counted across the pack (a constant shift per document): GPT-2's learned table
    sees other positions, RoPE only their differences (so LLaMA and Qwen3 give the same logits)."""
    model = tiny_model(family)
    cu, tokens = packed(LENGTHS)
    with torch.no_grad():
        shifted = model(tokens, torch.arange(tokens.numel()), CPContext.single(cu))
    right = whole(model, tokens, cu)
    if family == "gpt2":
        assert not torch.allclose(shifted[LENGTHS[0] :], right[LENGTHS[0] :])
    else:
        assert_close(shifted, right, torch.float64)


@pytest.mark.parametrize("name", WINDOWED)
def test_with_windows_each_document_gives_its_logits_alone(name):
    model = windowed_model(name)
    cu, tokens = packed(LENGTHS)
    logits = whole(model, tokens, cu)  # (T, V)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = whole(model, tokens[a:b], torch.tensor([0, b - a]))  # (L_i, V)
        assert_close(logits[a:b], alone, torch.float64, msg=f"{name} document {i}")
    padding = cpref.Sharding.eod_padded(cu, cp_size=4, layout="zigzag")
    padded = whole(model, padding.pad(tokens, value=3), cu, padding.cu_seqlens_padded)  # (T_pad, V)
    assert_close(padding.unpad(padded), logits, torch.float64, msg=f"{name} with EOD padding")


@pytest.mark.parametrize("name", WINDOWED)
def test_a_window_of_left_plus_one_keys_changes_the_rows_past_left(name):
    """Position `p` sees `p - left .. p`: the rows `p <= left` see their whole past, as without the window."""
    model = windowed_model(name)
    left = max(w for w in model.config.layer_windows if w is not None)
    unwindowed = tiny_model(model.config.family)  # the same weights: a window adds no parameter
    cu, tokens = packed(LENGTHS)
    with_window, without = whole(model, tokens, cu), whole(unwindowed, tokens, cu)  # (T, V) x 2
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        seen = min(b, a + left + 1)  # rows a .. a + left see every earlier key of the document
        assert_close(with_window[a:seen], without[a:seen], torch.float64, msg=f"{name} document {i}, rows <= left")
        for row in range(seen, b):
            assert not torch.allclose(with_window[row], without[row]), f"{name} document {i} row {row - a}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_without_windows_is_bitwise_unchanged(family):
    """`layer_windows` of `None`s is no window: the same config, the same logits bit for bit."""
    cu, tokens = packed(LENGTHS)
    default = tiny_model(family)
    nones = tiny_model(family, layer_windows=[None, None])
    assert nones.config == default.config and nones.config.layer_windows is None
    assert torch.equal(whole(nones, tokens, cu), whole(default, tokens, cu))
