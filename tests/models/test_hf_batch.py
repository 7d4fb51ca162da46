"""The batches Hugging Face users have, through `cpref.hf.shard_batch`: padded and flattened.

Four documents of unequal length (13, 7, 20 and 5 tokens), as a tokenizer's padded batch (`attention_mask`,
padding on the right, or on the left) and as `transformers.DataCollatorWithFlattening` makes them (one row,
`position_ids` restarting at every document, `-100` at each document's first label, with its flash
boundaries and `seq_idx`). The reference is the model without CP on that very batch, Hugging Face's eager
attention with its own masks (padding, or the packed documents it finds from the position ids) and its own
loss (`labels=`, shifted by the model; left-padded rows label their first token -100, or the pad before it
would predict it). cpref's run is the same weights with `attn_implementation="cpref"`
on the rank's `shard_batch`, every mode at CP = 2 and 4 (a layout each, all four covered), over Llama with
scaled RoPE, Qwen3 with a sliding layer and GPT-2: the logits of the real tokens, the loss (`cpref.cp_loss`,
the ranks' shares summed) and every parameter's gradient (summed over the ranks) within fp32's 1e-5.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import cpref
import cpref.hf
from cpref.base.errors import PeerInputError
from cpref.hf.batch import BatchSharding, documents
from sim import SimCluster
from tests.helpers import assert_close
from tests.models.test_hf_attention import VOCAB, build

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

LENGTHS = [13, 7, 20, 5]
FAMILIES = ["llama3", "qwen3-sliding", "gpt2"]
PATHS = ["padded right", "padded left", "flattened"]
MODES = sorted(cpref.MODES)
CASES = [(name, P, mode, cpref.LAYOUTS[(i + j + P) % 4], path)
         for j, name in enumerate(FAMILIES) for P in (2, 4) for i, mode in enumerate(MODES)
         for path in ("flattened", PATHS[(i + j + P // 2) % 2])]  # fmt: skip


def docs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def hf_batch(path: str) -> dict:
    """The batch a user has: padded (`B = 4` rows of `L = 20`) or flattened (one row of 45)."""
    if path == "flattened":
        collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
        return collate([{"input_ids": d.tolist()} for d in docs()])
    L = max(LENGTHS)
    ids, mask = torch.zeros(len(LENGTHS), L, dtype=torch.long), torch.zeros(len(LENGTHS), L, dtype=torch.long)
    for b, d in enumerate(docs()):
        cols = slice(0, len(d)) if path == "padded right" else slice(L - len(d), L)
        ids[b, cols], mask[b, cols] = d, 1
    labels = ids.masked_fill(mask == 0, -100)
    if path == "padded left":  # the pad before a row's first token would predict it in the model's own shift
        labels[torch.arange(len(LENGTHS)), L - torch.tensor(LENGTHS)] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference(name: str, path: str):
    """The model without CP on the batch itself: `(logits of the real tokens (T, V), loss, gradients)`."""
    model = build(name, "eager")
    batch = hf_batch(path)
    if path == "flattened":
        out = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False)
        real = out.logits[0]
    else:  # positions from each row's first token, as generate() numbers a left-padded row
        positions = (batch["attention_mask"].cumsum(1) - 1).clamp_min(0)
        out = model(**batch, position_ids=positions, use_cache=False)
        real = out.logits[batch["attention_mask"] == 1]  # (T, V) in row order
    out.loss.backward()
    return real.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.sweep
@pytest.mark.parametrize("name, P, mode, layout, path", CASES)
def test_the_batch_users_have_trains_as_without_cp(references, name, P, mode, layout, path):
    if (name, path) not in references:
        references[name, path] = reference(name, path)
    want_logits, want_loss, want_grads = references[name, path]
    cpref.hf.register()
    base = build(name, cpref.hf.NAME)
    batch = hf_batch(path)

    def rank(comm):
        model = copy.deepcopy(base)
        b = cpref.hf.shard_batch(batch, cp_size=P, rank=comm.rank, layout=layout)
        cp = cpref.hf.CP(comm, b["sharding"], mode, cpref.MODES[mode].example_options(P))
        logits = model(b["tokens"][None], position_ids=b["position_ids"][None], use_cache=False, cp=cp).logits[0]
        loss = cpref.cp_loss(F.cross_entropy(logits, b["labels"], reduction="none"), b["loss_mask"], comm)
        loss.backward()
        return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}, b["sharding"]

    results = SimCluster(P).run(rank)
    sharding = results[0][3]
    what = f"{name} P={P} {mode} {layout} {path}"
    assert sharding.cu_seqlens == (0, 13, 20, 40, 45)
    assert_close(sharding.unpad(sharding.unshard([r[0] for r in results])), want_logits, torch.float32, msg=f"{what}: logits")
    assert_close(sum(r[1] for r in results), want_loss, torch.float32, msg=f"{what}: loss")
    for n, g in want_grads.items():
        assert_close(sum(r[2][n] for r in results), g, torch.float32, msg=f"{what}: gradient of {n}")


def test_every_path_and_layout_is_covered():
    assert {c[4] for c in CASES} == set(PATHS)
    assert {c[3] for c in CASES} == set(cpref.LAYOUTS)
    assert {(c[0], c[1], c[2]) for c in CASES} == {(n, P, m) for n in FAMILIES for P in (2, 4) for m in MODES}


@pytest.mark.parametrize("path", PATHS)
def test_labels_are_each_documents_next_tokens(path):
    b = cpref.hf.shard_batch(hf_batch(path), cp_size=1, rank=0, layout="contiguous")
    tokens = torch.cat(docs())
    assert torch.equal(b["tokens"], tokens) and torch.equal(b["position_ids"], torch.cat([torch.arange(n) for n in LENGTHS]))
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    mask = torch.ones(45)
    mask[ends] = 0  # a document's last token predicts nothing
    assert torch.equal(b["loss_mask"], mask)
    assert torch.equal(b["labels"][mask == 1], tokens.roll(-1)[mask == 1])
    assert torch.equal(b["labels"][mask == 0], torch.zeros(len(LENGTHS), dtype=torch.long))  # pad_token_id


def test_ignored_labels_and_other_per_token_tensors_follow_the_tokens():
    ids = torch.tensor([[4, 5, 6, 7, 0], [8, 9, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    labels = torch.tensor([[4, 5, -100, 7, -100], [8, 9, 1, -100, -100]])
    types = torch.arange(10).view(2, 5)
    b = cpref.hf.shard_batch({"input_ids": ids, "attention_mask": mask, "labels": labels, "token_type_ids": types},
                             cp_size=1, rank=0, layout="contiguous")  # fmt: skip
    assert b["tokens"].tolist() == [4, 5, 6, 7, 8, 9, 1]
    assert b["loss_mask"].tolist() == [1, 0, 1, 0, 1, 1, 0]  # 5 -> -100 and each document's end masked
    assert b["labels"].tolist() == [5, 0, 7, 0, 9, 1, 0]
    assert b["token_type_ids"].tolist() == [0, 1, 2, 3, 5, 6, 7]


def test_a_padded_row_may_be_a_pack_and_rows_of_padding_only_are_skipped():
    ids = torch.ones(3, 6, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 0, 0, 0, 0, 0], [5, 5, 0, 1, 2, 3]])
    assert documents(ids, mask, pos) == ([0, 2, 5, 9], [(0, 2), (2, 5), (14, 18)])


@pytest.mark.parametrize("batch, match", [
    ({"tokens": torch.zeros(4)}, "needs a batch with an input_ids tensor, got \\['tokens'\\]"),
    ({"input_ids": torch.zeros(1, 4)}, "input_ids must be integer token ids"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long)},
     "attention_mask has shape \\(2, 5\\) but input_ids \\(2, 4\\)"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 0, 1, 1]])},
     "row 0 has padding between its tokens"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 2, 1, 1]])},
     "1 \\(token\\) and 0 \\(padding\\) only"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 4)}, "attention_mask must be an integer"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.zeros(1, 4, dtype=torch.long)},
     "holds no token"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.tensor([[1, 2, 3, 4]])},
     "must restart at 0 at every document and count up by 1"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 3, 4]])},
     "must restart at 0 at every document"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]]),
      "cu_seq_lens_q": torch.tensor([0, 4])}, "cu_seq_lens_q=\\[0, 4\\] are not the boundaries \\[0, 2, 4\\]"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]]),
      "seq_idx": torch.tensor([[0, 0, 0, 1]])}, "seq_idx does not number the batch's documents"),
])  # fmt: skip
def test_batches_that_are_not_what_they_claim_are_refused(batch, match):
    with pytest.raises(cpref.CPInputError, match=match):
        cpref.hf.shard_batch(batch, cp_size=2, rank=0)


# ---- labels= of a padded batch: shifted inside each row, as transformers does ----------------------------------------
def own_labels(b: dict, path: str) -> torch.Tensor:
    """The labels `hf_batch(path)` gives the model without CP, on this rank's shard: each token's own id, and -100 at
    each document's first token where `hf_batch` has it (left padding, the collator)."""
    return b["tokens"] if path == "padded right" else b["tokens"].masked_fill(b["position_ids"] == 0, -100)


@pytest.mark.parametrize("P, path", [(1, "padded right"), (2, "padded right"), (4, "padded right"), (1, "padded left"),
                                     (2, "padded left"), (4, "padded left"), (2, "flattened")])  # fmt: skip
def test_labels_of_a_padded_batch_are_shifted_inside_each_row(references, P, path):
    """Issue 56: `labels=input_ids` of a padded batch were shifted over the packed rows, each row's last token learning
    the next row's first: 47 loss tokens against transformers' 44 here (rows of 13, 7, 20 (no padding) and 5). Now the
    ranks' losses add up to transformers' own loss on the padded batch (-100 at the padding), and their gradients to
    its gradients, at CP = 1, 2 and 4, padding on either side; and the flattened batch (one row) still crosses its
    documents as transformers does."""
    if ("llama3", path) not in references:
        references["llama3", path] = reference("llama3", path)
    _, want_loss, want_grads = references["llama3", path]
    cpref.hf.register()
    base = build("llama3", cpref.hf.NAME)
    batch = hf_batch(path)

    def rank(comm):
        model = copy.deepcopy(base)
        b = cpref.hf.shard_batch(batch, cp_size=P, rank=comm.rank, layout=cpref.LAYOUTS[P % 4])
        cp = cpref.hf.CP(comm, b["sharding"], "p2p")
        out = model(b["tokens"][None], position_ids=b["position_ids"][None], labels=own_labels(b, path)[None],
                    use_cache=False, cp=cp)  # fmt: skip
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    results = SimCluster(P).run(rank)
    assert_close(sum(r[0] for r in results), want_loss, torch.float32, msg=f"P={P} {path}: loss")
    for n, g in want_grads.items():
        assert_close(sum(r[1][n] for r in results), g, torch.float32, msg=f"P={P} {path}: gradient of {n}")


def test_the_rows_marks_of_shard_batch():
    """Rows padded right, left, on both sides, not at all, a pack in a row, a row of padding only: each row's last
    token, and the first of each row padded on its left, in the stream; pickled and copied, the marks stay."""
    ids = torch.ones(5, 6, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0] * 6])
    pos = torch.tensor([[0, 1, 2, 0, 0, 0], [0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3], [0] * 6])
    b = cpref.hf.shard_batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, cp_size=2, rank=1)
    s = b["sharding"]
    assert s.cu_seqlens == (0, 3, 7, 11, 13, 17)  # the fourth row: a pack of 2 and 4
    assert s.row_ends == (2, 6, 10, 16) and s.left_firsts == (3, 7)
    flags = torch.zeros(17, dtype=torch.bool)
    flags[[3, 7]] = True
    assert torch.equal(s.left_padded_firsts(0), s.shard(s.pad(flags, value=False), 0))
    for again in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert type(again) is BatchSharding and again == s and again.row_ends == s.row_ends
        assert again.left_firsts == s.left_firsts and again.rank == 1 and torch.equal(again.labels, s.labels)


def test_labels_that_would_have_padding_predict_a_rows_first_token_are_refused_on_every_rank():
    """transformers' shift has the pad before a left-padded row's first token predict it; shard_batch dropped that
    pad, so `labels=input_ids` of left padding cannot be transformers' loss: refused, naming shift_labels=, on every
    rank, before any collective but the guard's row."""
    cpref.hf.register()
    base = build("llama3", cpref.hf.NAME)
    batch = hf_batch("padded left")

    def rank(comm):
        b = cpref.hf.shard_batch(batch, cp_size=2, rank=comm.rank)
        try:
            copy.deepcopy(base)(b["tokens"][None], position_ids=b["position_ids"][None], labels=b["tokens"][None],
                                use_cache=False, cp=cpref.hf.CP(comm, b["sharding"]))  # fmt: skip
        except cpref.CPInputError as err:
            return err

    cluster = SimCluster(2)
    errors = cluster.run(rank)
    own, peer = errors  # zigzag: every document's first chunk is rank 0's
    assert type(own) is cpref.CPInputError and "labels= label the first token of 3 rows padded on their left" in str(own)
    assert "pass shift_labels=batch['shift_labels'][None], or labels with -100 at every row's first token" in str(own)
    assert isinstance(peer, PeerInputError) and "the inputs of rank 0" in str(peer)
    assert [e.op for e in cluster.trace] == ["all_gather"]
