"""The checks of every forward of a Hugging Face model under CP (`cpref.hf.guard`): positions, masks, labels.

The silent-wrong paths of issue 40, each on the simulated cluster with `test_hf_attention`'s tiny random
models and pack (documents of 13, 7 and 20 tokens): a padding `attention_mask` (refused where it marks a
real token, honoured where it is the sharding's padding), a call without `position_ids` (filled in: the
logits equal Hugging Face's), position ids of another rank or layout (refused), and `labels=input_ids`
(shifted over the unsharded stream: the ranks' losses add up to the loss of the model without CP on the
same packed stream, and so do their gradients). Every refusal is raised on every rank, the rank at fault
naming the value and the others naming that rank, with nothing communicated but the ranks' one row.
"""

from __future__ import annotations

import copy
import pickle
import types

import pytest
import torch

import cpref
import cpref.hf
from cpref.base.errors import PeerInputError
from cpref.hf.batch import BatchSharding
from cpref.hf.guard import ROW
from sim import SimCluster
from tests.helpers import assert_close
from tests.models.test_hf_attention import VOCAB, build, pack, reference
from tests.models.test_hf_parity import random_hf_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def run(name: str, P: int, layout: str, call, mode: str = "p2p"):
    """`(per-rank results of call(model, batch, cp, comm), trace)`: a rank's exception is its result."""
    cpref.hf.register()
    base = build(name, cpref.hf.NAME)
    cu, tokens, labels, mask = pack()

    def rank(comm):
        model = copy.deepcopy(base)
        b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "loss_mask": mask}, cu, cp_size=P,
                                            rank=comm.rank, layout=layout)  # fmt: skip
        cp = cpref.hf.CP(comm, b["sharding"], mode, cpref.MODES[mode].example_options(P))
        try:
            return call(model, b, cp, comm)
        except cpref.CPInputError as err:
            return err

    cluster = SimCluster(P)
    return cluster.run(rank), cluster.trace


def only_the_row(trace) -> bool:
    """Nothing was communicated but the guard's one row of ints (`1 + len(ROW)` of them)."""
    return [(e.op, e.shape) for e in trace] == [("all_gather", (1, 1 + len(ROW)))]


def refused(results, trace, fault: int, match: str) -> None:
    """Rank `fault` raised `match`; every other rank raised too, naming it; nothing else was communicated."""
    assert all(isinstance(r, cpref.CPInputError) for r in results), results
    assert not isinstance(results[fault], PeerInputError) and match in str(results[fault]), results[fault]
    for r, err in enumerate(results):
        if r != fault:
            assert isinstance(err, PeerInputError) and f"rank {fault}" in str(err), err
    assert only_the_row(trace), trace


def logits(model, b, cp, comm, **kw):
    return model(b["tokens"][None], use_cache=False, cp=cp, **kw).logits[0].detach()


def whole(results):
    """The real rows of every rank's output, put back together."""
    sharding = results[0][1]
    return sharding.unpad(sharding.unshard([r[0] for r in results]))


# ---- positions ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, P, layout", [("llama3", 2, "zigzag"), ("gpt2", 4, "balanced"),
                                             ("qwen3-sliding", 4, "stream")])  # fmt: skip
def test_a_call_without_position_ids_gets_the_shardings(name, P, layout):
    """transformers would number each shard 0 .. T_l - 1 (72% off the model without CP on main); cpref fills in the
    positions in each document: the logits are Hugging Face's, on RoPE and on learned positions (GPT-2)."""
    want, _, _ = reference(name)
    results, _ = run(name, P, layout, lambda m, b, cp, comm: (logits(m, b, cp, comm), b["sharding"]))
    assert_close(whole(results), want, torch.float32, msg=f"{name} P={P} {layout}")


def test_the_roberta_family_numbers_its_positions_from_padding_idx_plus_1():
    """RoBERTa's embeddings count a document's positions from `padding_idx + 1` (and from the token ids, over the
    shard, without CP's help): filled in so, the masked-LM logits at CP = 2 and 4 are Hugging Face's per document."""
    cpref.hf.register()
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=48, pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    make = lambda impl: random_hf_model("RobertaForMaskedLM", transformers.RobertaConfig(**kw, attn_implementation=impl))
    ref, base = make("eager"), make(cpref.hf.NAME)
    cu, tokens, _, _ = pack()
    tokens = tokens.clamp_min(2)  # no padding id inside the documents
    with torch.no_grad():
        want = torch.cat([ref(tokens[a:b][None]).logits[0] for a, b in zip(cu, cu[1:])])
    for P, layout in [(2, "zigzag"), (4, "stream")]:

        def rank(comm, P=P, layout=layout):  # this case's, bound
            b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens}, cu, cp_size=P, rank=comm.rank,
                                                layout=layout, pad_token_id=1)  # fmt: skip
            with torch.no_grad():
                out = copy.deepcopy(base)(b["tokens"][None], cp=cpref.hf.CP(comm, b["sharding"])).logits[0]
            return out, b["sharding"]

        assert_close(whole(SimCluster(P).run(rank)), want, torch.float32, msg=f"P={P} {layout}")


def test_position_ids_offset_alike_on_every_rank_are_a_collators_start():
    """DataCollatorWithFlattening(position_ids_start=2): every document from 2; RoPE sees the same relative
    positions (the logits are the model's), and the ranks agree on the start."""
    want, _, _ = reference("llama3")
    go = lambda m, b, cp, comm: (logits(m, b, cp, comm, position_ids=b["position_ids"][None] + 2), b["sharding"])
    results, _ = run("llama3", 2, "zigzag", go)
    assert_close(whole(results), want, torch.float32)


@pytest.mark.parametrize("how, match", [
    ("another rank's", "they are rank 0's positions; at shard token 0 got 0, expected 4"),
    ("0 .. T_l - 1", "they count 0 .. 21 over the shard (transformers' numbering of a shard without CP); at shard "
     "token 0 got 0, expected 4. Pass batch['position_ids'] of cpref.hf.shard_batch (the sharding's positions(rank)), "
     "or omit them and cpref fills them in"),
    ("another layout's", "not this rank's positions in its documents; at shard token 0 got 8, expected 4"),
    ("float", "integer positions"),
    ("two rows", "position_ids must be this rank's 22 integer positions (1, T_l), got (1, 2, 11) torch.int64"),
])  # fmt: skip
def test_position_ids_that_are_not_this_ranks_are_refused_on_every_rank(how, match):
    cu, tokens, labels, mask = pack()

    def go(model, b, cp, comm):
        pos = b["position_ids"]
        if comm.rank == 1:
            padded = b["sharding"].cu_seqlens_padded  # the same shards' lengths, cut contiguously
            other = cpref.Sharding(cu, cp_size=2, layout="contiguous", cu_seqlens_padded=padded).positions(1)
            pos = {"another rank's": b["sharding"].positions(0), "0 .. T_l - 1": torch.arange(pos.numel()),
                   "another layout's": other, "float": pos.float(), "two rows": pos.view(2, -1)}[how]  # fmt: skip
        return logits(model, b, cp, comm, position_ids=pos[None])

    refused(*run("llama3", 2, "zigzag", go), fault=1, match=match)


def test_the_positions_of_the_shardings_padding_are_not_read():
    """Padding neither attends nor is attended: its position ids may be anything (0 here, as a collator's)."""
    plain, _ = run("llama3", 2, "zigzag", lambda m, b, cp, comm: logits(m, b, cp, comm, position_ids=b["position_ids"][None]))

    def go(model, b, cp, comm):
        s = b["sharding"]
        real = s.shard(s.pad(torch.ones(s.cu_seqlens[-1], dtype=torch.bool), value=False), comm.rank)
        return logits(model, b, cp, comm, position_ids=b["position_ids"].where(real, 0)[None]), bool((~real).any())

    results, _ = run("llama3", 2, "zigzag", go)
    assert all(torch.equal(a, b) for (a, _), b in zip(results, plain)) and results[0][1]  # rank 0 holds padding


def test_ranks_whose_positions_start_at_different_offsets_are_refused():
    go = lambda m, b, cp, comm: logits(m, b, cp, comm, position_ids=b["position_ids"][None] + comm.rank)
    results, trace = run("gpt2", 2, "zigzag", go)
    assert all("the position_ids' start: rank 0: 0; rank 1: 1" in str(r) for r in results), results
    assert only_the_row(trace)


# ---- masks --------------------------------------------------------------------------------------------------------
def test_a_padding_mask_over_real_tokens_is_refused_not_dropped():
    """On main the layer saw attention_mask=None (transformers builds masks only for implementations registered
    with AttentionMaskInterface) and the logits were as if there were no padding."""

    def go(model, b, cp, comm):
        am = torch.ones(1, b["tokens"].numel(), dtype=torch.long)
        if comm.rank == 1:
            am[0, 3] = 0  # a real token of rank 1 (zigzag pads only documents' ends)
        return logits(model, b, cp, comm, position_ids=b["position_ids"][None], attention_mask=am)

    refused(*run("llama3", 2, "zigzag", go), fault=1, match="marks 1 real tokens of rank 1's shard as padding")


@pytest.mark.parametrize("padding", ["all ones", "the sharding's padding"])
def test_a_mask_whose_padding_is_the_shardings_is_honoured(padding):
    plain, _ = run("llama3", 2, "zigzag", lambda m, b, cp, comm: logits(m, b, cp, comm, position_ids=b["position_ids"][None]))

    def go(model, b, cp, comm):
        am = b["loss_mask"].new_ones(1, b["tokens"].numel()).long()
        if padding != "all ones":
            real = b["sharding"].shard(b["sharding"].pad(torch.ones(b["sharding"].cu_seqlens[-1])), comm.rank)
            am = real.long()[None]
        return logits(model, b, cp, comm, position_ids=b["position_ids"][None], attention_mask=am), am

    results, _ = run("llama3", 2, "zigzag", go)
    assert all(torch.equal(a, b) for (a, _), b in zip(results, plain))
    if padding != "all ones":
        assert (results[0][1] == 0).any()  # rank 0 holds the padding (13 -> 16 and 7 -> 8 at P = 2)


def test_cpref_is_registered_for_masks_and_refuses_a_models_own_mask_function():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    cpref.hf.register()
    assert ALL_MASK_ATTENTION_FUNCTIONS[cpref.hf.NAME] is cpref.hf.mask
    padding = torch.ones(1, 4, dtype=torch.bool)
    assert cpref.hf.mask(1, 4, 4, attention_mask=padding) is padding  # handed on, for the layer to refuse
    assert cpref.hf.mask(1, 4, 4) is None
    with pytest.raises(cpref.CPInputError, match="adds a mask of its own"):
        cpref.hf.mask(1, 4, 4, mask_function=lambda *a: True, use_vmap=True)


@pytest.mark.parametrize("change, match", [
    (dict(attention_mask=torch.ones(1, 1, 22, 22)), "a prepared or custom mask is not supported"),
    (dict(attention_mask=torch.full((1, 22), 2)), "1 (token) and 0 (padding) only"),
    (dict(cu_seq_lens_q=torch.tensor([0, 20, 40])), "are not the batch's document boundaries"),
    (dict(logits_to_keep=1), "logits_to_keep=1 keeps the last tokens"),
    (dict(pixel_values=torch.zeros(1, 3, 4, 4)), "pixel_values= is not supported under CP"),
    (dict(input_ids=None), "input_ids (1, T_l) or inputs_embeds (1, T_l, hidden) are needed, got NoneType"),
    (dict(input_ids=torch.zeros(2, 22, dtype=torch.long)), "batch size 2"),
    (dict(input_ids=torch.zeros(1, 21, dtype=torch.long)), "was given 21 tokens but the sharding gives every rank 22"),
    (dict(labels=torch.zeros(1, 21, dtype=torch.long)), "labels must be this rank's 22 integer labels"),
])  # fmt: skip
def test_inputs_the_model_would_read_wrongly_are_refused_on_every_rank(change, match):
    """Rank 1 alone passes the bad value (P = 2, zigzag: 22 tokens a rank); rank 0 raises too, naming it."""

    def go(model, b, cp, comm):
        kw = dict(input_ids=b["tokens"][None], position_ids=b["position_ids"][None])
        kw.update(change if comm.rank == 1 else {})
        return model(**kw, use_cache=False, cp=cp).logits

    refused(*run("llama3", 2, "zigzag", go), fault=1, match=match)


def test_the_collators_boundaries_pass_where_they_are_the_shardings():
    plain, _ = run("llama3", 2, "zigzag", lambda m, b, cp, comm: logits(m, b, cp, comm, position_ids=b["position_ids"][None]))
    cu = torch.tensor(pack()[0], dtype=torch.int32)
    go = lambda m, b, cp, comm: logits(m, b, cp, comm, position_ids=b["position_ids"][None], cu_seq_lens_q=cu,
                                       cu_seq_lens_k=cu, max_length_q=20, max_length_k=20)  # fmt: skip
    results, _ = run("llama3", 2, "zigzag", go)
    assert all(torch.equal(a, b) for a, b in zip(results, plain))


# ---- labels -------------------------------------------------------------------------------------------------------
def packed_reference(name: str):
    """The model without CP on the whole packed stream, `labels=input_ids` (the usual call): `(loss, gradients)`;
    transformers finds the documents from the restarting position ids and shifts the labels over the stream."""
    model = build(name, "eager")
    cu, tokens, _, _ = pack()
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    loss = model(tokens[None], position_ids=positions[None], labels=tokens[None], use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name, P, mode, layout", [("llama3", 2, "p2p", "zigzag"), ("llama3", 4, "a2a", "balanced"),
                                                   ("gpt2", 2, "all_gather", "stream"),
                                                   ("qwen3-sliding", 4, "a2a+p2p", "contiguous")])  # fmt: skip
def test_labels_are_shifted_over_the_unsharded_batch(name, P, mode, layout):
    """`labels=input_ids` gave 3.634 at CP = 2 (zigzag) against 3.877 without CP on main: the model shifted inside
    each shard. Now the ranks' losses add up to the loss without CP, and their gradients to its gradients."""
    want, grads = packed_reference(name)

    def go(model, b, cp, comm):
        loss = model(b["tokens"][None], position_ids=b["position_ids"][None], labels=b["tokens"][None], use_cache=False,
                     cp=cp).loss  # fmt: skip
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, b["sharding"].local_tokens

    results, trace = run(name, P, layout, go, mode)
    assert label_collectives(trace) == [("all_gather", (results[0][2],))]  # one all-gather of T_l label ids
    rows = [e for e in trace if e.param == "host" and e.shape == (1, 1 + len(ROW))]
    assert len(rows) == 1  # one row a forward: the base model inside the causal LM is not checked again
    assert_close(sum(r[0] for r in results), want, torch.float32, msg=f"{name} P={P} {mode} {layout}: loss")
    for n, g in grads.items():
        assert_close(sum(r[1][n] for r in results), g, torch.float32, msg=f"{name}: gradient of {n}")


def label_collectives(trace) -> list:
    """The collectives of integers a run made, but the ranks' host rows: what the loss arguments cost."""
    return [(e.op, e.shape) for e in trace if e.dtype == torch.int64 and e.param != "host"]


def test_shift_labels_without_a_count_are_normalised_over_the_batch():
    """Hugging Face's own loss divides by the rank's loss tokens; under CP the count is the batch's (one all-reduce),
    so the ranks' losses add up to the mean, with or without num_items_in_batch."""
    _, want, _ = reference("llama3")
    cu, _, _, mask = pack()

    def go(model, b, cp, comm):
        shifted = b["labels"].masked_fill(b["loss_mask"] == 0, -100)[None]  # (1, T_l): already the next tokens
        call = lambda **kw: model(b["tokens"][None], position_ids=b["position_ids"][None], use_cache=False, cp=cp,
                                  labels=shifted, shift_labels=shifted, **kw).loss.detach()  # fmt: skip
        return call(num_items_in_batch=int(mask.sum())), call()

    results, trace = run("llama3", 4, "zigzag", go)
    for i in range(2):
        assert_close(sum(r[i] for r in results), want, torch.float32, msg=f"call {i}")
    assert label_collectives(trace) == [("all_reduce", (1,))]  # the second call's count, the first's given


def test_ranks_that_pass_different_loss_arguments_are_refused():
    go = lambda m, b, cp, comm: m(b["tokens"][None], position_ids=b["position_ids"][None], use_cache=False, cp=cp,
                                  **({"labels": b["tokens"][None]} if comm.rank == 0 else {}))  # fmt: skip
    results, trace = run("llama3", 2, "zigzag", go)
    assert all("labels: rank 0: given; rank 1: none" in str(r) for r in results), results
    assert only_the_row(trace)


def test_labels_of_a_head_that_is_not_a_causal_lm_are_refused():
    cpref.hf.register()
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, attn_implementation=cpref.hf.NAME)  # fmt: skip
    model = transformers.BertForMaskedLM(config).eval()
    sharding = cpref.Sharding([0, 8], cp_size=1)
    cp = cpref.hf.CP(cpref.SingleRank(), sharding)
    tokens = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(cpref.CPInputError, match="shifted for causal LMs only"):
        model(tokens, labels=tokens, cp=cp)
    assert model(tokens, cp=cp).logits.shape == (1, 8, VOCAB)  # without labels it runs


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
@pytest.mark.parametrize("masked", [False, True])
def test_labels_that_are_already_the_next_tokens_are_refused_on_every_rank(layout, masked):
    """get_batch_on_this_cp_rank's labels (Megatron's: the next tokens) as labels=: the model would shift them a second
    time, silently (every token learning the one after next); refused on every rank before any collective."""

    def go(model, b, cp, comm):
        y = b["labels"].masked_fill(b["loss_mask"] == 0, -100) if masked else b["labels"]
        return model(b["tokens"][None], position_ids=b["position_ids"][None], labels=y[None].clone(), use_cache=False,
                     cp=cp).loss  # fmt: skip

    results, trace = run("llama3", 4, layout, go)
    for err in results:
        assert isinstance(err, cpref.CPInputError) and not isinstance(err, PeerInputError), err
        assert "labels= are already the next tokens" in str(err) and "pass them as shift_labels=" in str(err)
    assert only_the_row(trace)


def test_next_token_labels_are_told_by_their_values_alone():
    """Own ids (transformers' labels) pass, with or without -100; repeated tokens (shifted or not, one loss) pass;
    without input_ids (inputs_embeds) nothing is compared; the next tokens inside each document are refused, even
    where the label of a document's last token is another document's first (the stream shifted as a whole)."""
    from cpref.hf.labels import next_tokens as _next_tokens

    s = cpref.Sharding([0, 5, 11], cp_size=2, layout="contiguous", cu_seqlens_padded=[0, 6, 12])
    ids = torch.tensor([11, 12, 13, 14, 15, 0, 21, 22, 23, 24, 25, 26])  # the padded stream
    stream_next = torch.cat([ids[1:], ids[:1]])  # every token's label the stream's next one
    for rank in range(2):
        mine = s.shard(ids, rank)
        assert not _next_tokens(mine, mine, s, rank, -100)
        assert not _next_tokens(mine.masked_fill(mine % 2 == 0, -100), mine, s, rank, -100)
        assert not _next_tokens(s.shard(stream_next, rank), None, s, rank, -100)
        assert _next_tokens(s.shard(stream_next, rank), mine, s, rank, -100)
        same = torch.full_like(mine, 7)
        assert not _next_tokens(same, same, s, rank, -100)
        assert not _next_tokens(torch.full_like(mine, -100), mine, s, rank, -100)
    # one pair differing from the next id is enough to pass: labels that are the next tokens but for one
    wrong = s.shard(stream_next, 0).clone()
    wrong[1] = 99
    assert not _next_tokens(wrong, s.shard(ids, 0), s, 0, -100)


# ---- shard_batch's labels: already the next tokens ---------------------------------------------------------------
def sharded(comm, P: int = 2, layout: str = "zigzag") -> dict:
    """`pack()` as DataCollatorWithFlattening makes it (position ids restart at every document), through shard_batch."""
    cu, tokens, _, _ = pack()
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    return cpref.hf.shard_batch({"input_ids": tokens[None], "position_ids": positions[None]}, cp_size=P, rank=comm.rank,
                                layout=layout)  # fmt: skip


def on_sharded(name: str, P: int, layout: str, call):
    """`(per-rank results of call(model, b, cp), trace)` with `b = sharded(...)`: a rank's CPInputError is its result."""
    cpref.hf.register()
    base = build(name, cpref.hf.NAME)

    def rank(comm):
        b = sharded(comm, P, layout)
        try:
            return call(copy.deepcopy(base), b, cpref.hf.CP(comm, b["sharding"]))
        except cpref.CPInputError as err:
            return err

    cluster = SimCluster(P)
    return cluster.run(rank), cluster.trace


@pytest.mark.parametrize("form", ["labels", "shift_labels"])
def test_shard_batchs_labels_passed_as_labels_are_refused_on_every_rank(form):
    """On main the model shifted them a second time, silently: every token learnt the one after next."""

    def go(model, b, cp):
        y = b[form][None].clone()  # a copy, as on another device: told by its values
        return model(b["tokens"][None], position_ids=b["position_ids"][None], labels=y, use_cache=False, cp=cp).loss

    results, trace = on_sharded("llama3", 2, "zigzag", go)
    for err in results:
        assert isinstance(err, cpref.CPInputError) and not isinstance(err, PeerInputError), err
        assert "shard_batch's labels, which are already the next tokens" in str(err)
        assert "pass shift_labels=batch['shift_labels'][None] instead" in str(err)
    assert only_the_row(trace)


@pytest.mark.parametrize("name, P, layout", [("llama3", 2, "zigzag"), ("gpt2", 4, "balanced")])
def test_shard_batchs_shift_labels_give_the_batchs_loss(name, P, layout):
    """`shift_labels=b["shift_labels"]` alone (cpref hands them on as labels, so that transformers computes a loss):
    the ranks' losses add up to the loss of the model without CP on each document, and so do their gradients; the
    tokens' own ids as `labels=` are not refused (shifted over the batch, as transformers does on the stream)."""
    _, want, grads = reference(name)
    packed, _ = packed_reference(name)

    def go(model, b, cp):
        kw = dict(position_ids=b["position_ids"][None], use_cache=False, cp=cp)
        loss = model(b["tokens"][None], shift_labels=b["shift_labels"][None], **kw).loss
        loss.backward()
        own = model(b["tokens"][None], labels=b["tokens"][None], **kw).loss.detach()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, own

    results, _ = on_sharded(name, P, layout, go)
    assert_close(sum(r[0] for r in results), want, torch.float32, msg=f"{name}: loss")
    for n, g in grads.items():
        assert_close(sum(r[1][n] for r in results), g, torch.float32, msg=f"{name}: gradient of {n}")
    assert_close(sum(r[2] for r in results), packed, torch.float32, msg=f"{name}: labels=input_ids")


def test_shard_batch_marks_its_sharding_and_its_shift_labels():
    b = sharded(types.SimpleNamespace(rank=1))
    s = b["sharding"]
    assert isinstance(s, BatchSharding) and s == cpref.Sharding.eod_padded(pack()[0], cp_size=2) and s.rank == 1
    assert torch.equal(b["shift_labels"], b["labels"].where(b["loss_mask"] == 1, -100))
    assert all(type(x) is BatchSharding and x == s for x in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)))
    assert s.made_labels(b["labels"].cuda() if torch.cuda.is_available() else b["labels"][None], None, 1)
    assert not s.made_labels(b["tokens"], b["tokens"], 1) and not s.made_labels(b["labels"], None, 0)
    with pytest.raises(cpref.CPInputError, match="shard_batch makes shift_labels itself"):
        cpref.hf.shard_batch({"input_ids": torch.ones(1, 4, dtype=torch.long), "shift_labels": torch.ones(1, 4)},
                             cp_size=1, rank=0)  # fmt: skip
