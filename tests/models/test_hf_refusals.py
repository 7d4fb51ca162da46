"""Every refusal of `cpref.hf` is in its page's table, and a refusal at a layer or at the first forward is raised on
every rank alike.

The table ("Everything refused", `cpref.hf`'s docstring) is kept complete by reading the source: every `raise` in
`src/cpref/hf/*.py` (and every call of the shared checks `check_comm` and `as_choice`) is matched by a fragment of
its text to one row of the table, and every row is the home of at least one; a new refusal fails here until the
table states it. Then, on the simulated cluster (`test_hf_guard`'s helpers): the refusals that read the model
(its layers, its forward's parameters) or what a layer reads (`use_cache`, training mode, a cache), with one rank
alone at fault and with every rank alike. On main a rank alone with `use_cache=True` in training, or a model with
a pooler, raised by itself while the other rank waited in a collective (the simulated cluster's `PeerFailure`).
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch

import cpref
import cpref.hf
from cpref.base.errors import PeerInputError
from cpref.hf.guard import ROW, guard
from sim import SimCluster
from tests.models.test_hf_attention import pack
from tests.models.test_hf_guard import logits, only_the_row, refused, run

transformers = pytest.importorskip("transformers")

HF = Path(cpref.hf.__file__).parent
# file -> [(a fragment of the refusal's source, a fragment of the table row that states it)]
ROWS = {
    "admit.py": [("_check_and_adjust_attn_implementation, which", "a `transformers` without"),
                 ("_supports_attention_backend = False), so", "`_supports_attention_backend = False`"),
                 ("its head ({head})", "a head that reads tokens by index"),
                 ("layer_types holds layer kinds", "a `layer_types` entry"),
                 ("attention temperature tuning", "`attn_temperature_tuning`"),
                 ("its vision tower would run", "a vision tower with cpref's attention"),
                 ("use_bidirectional_attention=True on a", "`use_bidirectional_attention=True` on a config"),
                 ("its pooler ({name})", "a pooler of the first token")],
    "guard.py": [("needs the CP arguments", "no `cp=cpref.hf.CP(...)`"),
                 ("cp= must be a cpref.hf.CP", "no `cp=cpref.hf.CP(...)`"),
                 ("does not match its forward", "extra positional arguments"),
                 ("extra positional ones", "extra positional arguments"),
                 ("or inputs_embeds (1, T_l, hidden) are needed", "no `input_ids` (nor `inputs_embeds`)"),
                 ("(batch size 1), got batch size", "no `input_ids` (nor `inputs_embeds`)"),
                 ("was given {x.shape[1]} tokens", "no `input_ids` (nor `inputs_embeds`)"),
                 ("is not supported under CP: cpref.hf runs text", "`logits_to_keep`, image or audio inputs"),
                 ("logits_to_keep={keep!r}", "`logits_to_keep`, image or audio inputs"),
                 ("({key}=) passed to the model would reach", "`softcap=` or `s_aux=` passed to the model"),
                 ("differs from its layers' own", "`is_causal=` passed to the model"),
                 ("are not the batch's document boundaries", "`cu_seq_lens_q`/`_k` that are not the sharding's"),
                 ("takes no position_ids", "no `position_ids` parameter"),
                 ("integer positions (1, T_l)", "`position_ids` that are not `(1, T / P)` integers"),
                 ("_wrong_positions(", "`position_ids` that are not `(1, T / P)` integers"),
                 ("is not a padding mask of this rank's", "an `attention_mask` that is not a `(1, T / P)`"),
                 ("must hold 1 (token) and 0 (padding) only", "an `attention_mask` that is not a `(1, T / P)`"),
                 ("real tokens of rank {rank}'s shard as", "an `attention_mask` that is not a `(1, T / P)`"),
                 ("failed the model-level checks", "another rank's inputs that failed these checks"),
                 ("pass different arguments to the model", "ranks that pass different loss arguments")],
    "labels.py": [("integer labels (1, T_l)", "`labels` or `shift_labels` that are not"),
                  ("shifted for causal LMs only", "`labels=` of a head that is not a causal LM"),
                  ("are cpref.hf.shard_batch's labels", "`labels=` that are `shard_batch`'s labels"),
                  ("labels= are already the next tokens", "`labels=` that are already the next tokens"),
                  ("rows padded on their left", "`labels=` that label the first token of a row padded on its left")],
    "layer.py": [("check_comm(", "a communicator that is not a `cpref.comm.protocol.Collectives`"),
                 ("sharding must be the batch's cpref.Sharding", "a communicator that is not a `cpref.comm.protocol.Collectives`"),
                 ("the sharding is over cp_size=", "a communicator that is not a `cpref.comm.protocol.Collectives`"),
                 ("as_choice(", "a mode not in `cpref.MODES`"),
                 ("options must be a dict", "a mode not in `cpref.MODES`"),
                 ("options may not set", "a mode not in `cpref.MODES`"),
                 ("adds a mask of its own", "a mask function of the model's own"),
                 ("needs the CP arguments", "no `cp=cpref.hf.CP(...)`"),
                 ("cp= must be a cpref.hf.CP", "no `cp=cpref.hf.CP(...)`"),
                 ("without the model-level checks", "a layer reached without the model-level checks"),
                 ("(batch size 1), got batch size", "no `input_ids` (nor `inputs_embeds`)"),
                 ("a key/value cache is not \"", "a key/value cache (more keys than queries"),
                 ("use_cache=True in training", "a key/value cache (more keys than queries"),
                 ("attention dropout {dropout}", "attention dropout in training"),
                 ("reached the layer", "an attention mask that reaches the layer"),
                 ("mask has a key", "a `mask` that is not a `cpref.Mask`"),
                 ("is {type(m).__name__}, not a cpref.Mask", "a `mask` that is not a `cpref.Mask`"),
                 ("the sharding's batch has", "a `mask` that is not a `cpref.Mask`"),
                 ("without a causal mask", "a sliding window without a causal mask")],
    "masks.py": [("PaliGemma under CP needs", "PaliGemma without `token_type_ids`"),
                 ("built from the whole batch's token_type_ids", "PaliGemma without `token_type_ids`"),
                 ("token_type_ids must be the batch's", "`token_type_ids` that are not the rank's shard"),
                 ("token_type_ids of rank {rank} are not", "`token_type_ids` that are not the rank's shard"),
                 ("input_ids of rank {rank} are not", "`token_type_ids` that are not the rank's shard"),
                 ("image tokens (id {image})", "`pixel_values` with a sharding that is not"),
                 ("the vision tower gives", "`pixel_values` with a sharding that is not"),
                 ("pixel_values under CP need", "`pixel_values` with a sharding that is not"),
                 ("differs from the mask the model builds", "a `CP(mask=)` that is not the mask the model builds"),
                 ("is one Mask but the model has", "a `CP(mask=)` that is not the mask the model builds"),
                 ("has no mask for the layer kinds", "a `CP(mask=)` that is not the mask the model builds")],
    "batch.py": [("a batch with an input_ids tensor", "no `input_ids` tensor"),
                 ("input_ids must be integer token ids", "no `input_ids` tensor"),
                 ("every per-token", "no `input_ids` tensor"),
                 ("must be an integer tensor", "no `input_ids` tensor"),
                 ("makes shift_labels itself", "no `input_ids` tensor"),
                 ("must hold 1 (token) and 0 (padding) only", "an `attention_mask` with values other than 0 and 1"),
                 ("has padding between its tokens", "an `attention_mask` with values other than 0 and 1"),
                 ("holds no token", "an `attention_mask` with values other than 0 and 1"),
                 ("must restart at 0 at every document", "`position_ids` that do not restart at 0"),
                 ("are not the boundaries", "`cu_seq_lens_q`/`_k` or `seq_idx`"),
                 ("seq_idx does not number", "`cu_seq_lens_q`/`_k` or `seq_idx`")],
}
SHARED_CHECKS = ("check_comm", "as_choice")  # cpref's checks that raise CPInputError for cpref.hf


def refusals(path: Path) -> list[str]:
    """The source of every refusal in `path`: each `raise` of an exception made there, each shared check called."""
    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            found.append(ast.get_source_segment(text, node.exc))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in SHARED_CHECKS:
            found.append(ast.get_source_segment(text, node))
    return found


def table() -> list[str]:
    """The rows of the refusal table in `cpref.hf`'s docstring (the page)."""
    section = cpref.hf.__doc__.split("## Everything refused", 1)[1]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| when", "| ---"))]


def test_every_refusal_of_cpref_hf_is_in_the_table():
    rows, homes, unmatched = table(), set(), []
    assert {p.name for p in HF.glob("*.py")} - {"__init__.py"} == set(ROWS)  # a new file gets its entries too
    for name, entries in ROWS.items():
        for source in refusals(HF / name):
            matched = [row for fragment, row in entries if fragment in source]
            if len(matched) != 1:
                unmatched.append(f"{name}: {source[:100]} (matched {len(matched)} fragments)")
                continue
            stating = [r for r in rows if matched[0] in r]
            assert len(stating) == 1, f"{name}: {matched[0]!r} is in {len(stating)} rows of the table"
            homes.add(stating[0])
    assert unmatched == [], "refusals without a row: add one to cpref.hf's table and an entry to ROWS\n" + "\n".join(
        unmatched)
    assert [r for r in rows if r not in homes] == []  # every row states a refusal that exists


def test_the_table_reader_sees_a_refusal_without_a_row(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def f(x):\n    if x:\n        raise CPInputError(f'a new refusal {x}')\n    check_comm(x)\n"
                      "    raise err\n")  # fmt: skip
    assert refusals(source) == ["CPInputError(f'a new refusal {x}')", "check_comm(x)"]
    assert any(row.startswith("| built |") and "(StableLm)" in row for row in table())


# ---- what a layer refuses, and the first forward: on every rank alike -----------------------------------------------
def forward(model, b, cp, comm, **kw):
    kw = {"use_cache": False, **kw}
    return model(b["tokens"][None], position_ids=b["position_ids"][None], cp=cp, **kw).logits[0].detach()


def test_use_cache_in_training_on_one_rank_is_refused_on_every_rank_before_any_communication():
    """On main rank 1 raised "use_cache=True in training" at its first layer while rank 0 waited in the attention's
    all-gather. Now the ranks' row holds `use_cache`: both raise the same error, naming it."""

    def go(model, b, cp, comm):
        model.train()
        return forward(model, b, cp, comm, use_cache=comm.rank == 1)

    results, trace = run("llama3", 2, "zigzag", go)
    assert all("use_cache: rank 0: False; rank 1: True" in str(r) for r in results), results
    assert str(results[0]) == str(results[1]) and only_the_row(trace)


def cached(model, b, cp, comm):
    """A key/value cache holding this rank's 22 tokens (one forward in evaluation with `use_cache=True`)."""
    return model(b["tokens"][None], position_ids=b["position_ids"][None], use_cache=True, cp=cp).cache


@pytest.mark.parametrize("how, match", [
    ("training", "training: rank 0: False; rank 1: True"),
    ("activation checkpointing", "activation checkpointing: rank 0: False; rank 1: True"),
    ("autograd", "autograd: rank 0: True; rank 1: False"),
    ("cache", "cached tokens: rank 0: no cache; rank 1: 22"),
])  # fmt: skip
def test_what_a_layer_reads_differing_between_ranks_is_refused_on_every_rank(how, match):
    def go(model, b, cp, comm):
        cache = cached(model, b, cp, comm) if how == "cache" else None  # every rank: a forward communicates
        kw = {"cache": cache} if how == "cache" and comm.rank == 1 else {}
        if comm.rank == 1 and how in ("training", "activation checkpointing"):
            model.train()
            if how == "activation checkpointing":
                model.activation_checkpointing_enable({"use_reentrant": False})
        with torch.set_grad_enabled(not (how == "autograd" and comm.rank == 1)):
            return forward(model, b, cp, comm, **kw)

    results, trace = run("llama3", 2, "zigzag", go)
    assert all(match in str(r) for r in results), results
    assert trace[-1].param == "host" and trace[-1].shape == (1, 1 + len(ROW))  # this forward's row, nothing after


@pytest.mark.parametrize("how, match", [
    ("use_cache", "use_cache=True in training"),
    ("dropout", "attention dropout 0.1 in training"),
    ("cache", "44 keys for 22 queries"),
])  # fmt: skip
def test_a_layers_refusal_is_raised_on_every_rank_alike_before_its_collectives(how, match):
    """Every rank passes the same: each raises at its first layer, after nothing but the row of this forward."""

    def go(model, b, cp, comm):
        if how == "cache":
            return forward(model, b, cp, comm, cache=cached(model, b, cp, comm), use_cache=True)
        model.train()
        for m in model.modules():
            if how == "dropout" and hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.1
        return forward(model, b, cp, comm, use_cache=how == "use_cache")

    results, trace = run("llama3", 2, "zigzag", go)
    assert all(match in str(r) and not isinstance(r, PeerInputError) for r in results), results
    assert trace[-1].param == "host" and trace[-1].shape == (1, 1 + len(ROW))  # this forward's row, nothing after


@pytest.mark.parametrize("how, match", [
    ("pooler", "its pooler (model.pooler) reads the first token"),
    ("softcap", "logit soft-capping (softcap=) passed to the model would reach every layer"),
    ("is_causal", "is_causal=False differs from its layers' own (is_causal [True])"),
    ("positional", "the call does not match its forward: too many positional arguments"),
])  # fmt: skip
def test_a_first_forward_refusal_of_one_rank_is_raised_on_every_rank(how, match):
    """Rank 1 alone: its model has a pooler (refused at the first forward, before the row on main), or its
    call passes `softcap=` (on main refused at the layer) or one positional argument too many."""

    def go(model, b, cp, comm):
        args, kw = (b["tokens"][None],), dict(position_ids=b["position_ids"][None], use_cache=False, cp=cp)
        if comm.rank == 1:
            if how == "pooler":
                model.model.pooler = torch.nn.Identity()
            elif how == "softcap":
                kw["softcap"] = 30.0
            elif how == "is_causal":  # SDPA would attend bidirectionally; cpref's layers would not: never silently
                kw["is_causal"] = False
            else:
                args, kw = (b["tokens"][None], None, b["position_ids"][None], None, None, None, False, 0, "more"), {"cp": cp}
        return model(*args, **kw).logits

    refused(*run("llama3", 2, "zigzag", go), fault=1, match=match)


# ---- a forward's parameters ----------------------------------------------------------------------------------------
class Plain(torch.nn.Module):
    """A model whose forward takes no `position_ids`, checked as `cpref.hf.admit` checks a model built with cpref."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(_attn_implementation=cpref.hf.NAME)
        self.register_forward_pre_hook(guard, with_kwargs=True)

    def forward(self, input_ids, cp=None):
        return input_ids


class Star(Plain):
    """One whose forward takes extra positional arguments."""

    def forward(self, input_ids, *extra, position_ids=None, cp=None):
        return input_ids


def on_two_ranks(call):
    """`(per-rank results of call(b, cp, comm), trace)` on `pack()` at P = 2, zigzag; an error is a result."""
    cu, tokens, labels, _ = pack()

    def rank(comm):
        b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels}, cu, cp_size=2, rank=comm.rank)
        try:
            return call(b, cpref.hf.CP(comm, b["sharding"]), comm)
        except cpref.CPInputError as err:
            return err

    cluster = SimCluster(2)
    return cluster.run(rank), cluster.trace


def test_a_forward_without_a_position_ids_parameter_is_refused():
    results, trace = on_two_ranks(lambda b, cp, comm: Plain()(input_ids=b["tokens"][None], cp=cp))
    assert all("Plain.forward takes no position_ids" in str(r) for r in results), results
    assert not any(isinstance(r, PeerInputError) for r in results) and only_the_row(trace)
    runs, _ = on_two_ranks(lambda b, cp, comm: Star()(b["tokens"][None], cp=cp))  # it takes position_ids: filled in
    assert all(isinstance(r, torch.Tensor) for r in runs), runs


def test_extra_positional_arguments_on_one_rank_are_refused_on_every_rank():
    go = lambda b, cp, comm: Star()(b["tokens"][None], *([7] if comm.rank == 1 else []), cp=cp)  # noqa: E731
    refused(*on_two_ranks(go), fault=1, match="Star: pass the forward's arguments by name under CP, got 1 extra")


def test_cp_that_is_not_a_cp_is_refused_by_the_model():
    cpref.hf.register()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        attn_implementation=cpref.hf.NAME))  # fmt: skip
    with pytest.raises(cpref.CPInputError, match="LlamaForCausalLM: cp= must be a cpref.hf.CP, got str"):
        model(torch.zeros(1, 4, dtype=torch.long), use_cache=False, cp="p2p")


def test_is_causal_that_is_every_layers_own_is_taken():
    """`is_causal=True` on a causal model changes nothing (the refusal above is of a value the layers do not have)."""

    def go(model, b, cp, comm):
        return logits(model, b, cp, comm, position_ids=b["position_ids"][None], is_causal=True), logits(
            model, b, cp, comm, position_ids=b["position_ids"][None])  # fmt: skip

    results, _ = run("llama3", 2, "zigzag", go)
    assert all(torch.equal(given, plain) for given, plain in results), results
