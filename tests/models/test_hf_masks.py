"""Hugging Face models whose masks are not causal, through `cpref.hf`: Gemma 3's bidirectional text (with and
without its sliding layers), Gemma 3's image tokens (`token_type_ids`, a tiny vision tower) and PaliGemma's prefix.

First the facts: the masks `transformers` 5.24 hands its eager attention, recorded layer by layer on a padded batch
of two rows, are `cpref.hf.model_masks` of the same batch, row by row. Then parity, as `test_hf_attention`: tiny
random models (2 layers, hidden 64, 4 heads, 2 kv heads, `test_hf_parity`'s weights); the reference is Hugging
Face's eager attention on every document alone (its images, its own masks); cpref's run is the same weights with
`attn_implementation="cpref"` (the vision tower `eager`) on the padded batch through `cpref.hf.shard_batch`, with
`token_type_ids` and `pixel_values` passed as to the model without CP, every mode at P = 2 and 4 (a layout each).
Logits, the loss and every parameter's gradient (summed over the ranks; a vision tower's parameters get none on a
rank whose shard holds no image token) agree within fp32's tolerance (eager's softmax is fp32). Then the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import cpref
import cpref.hf
from cpref.hf.masks import model_masks
from sim import SimCluster
from tests.models.cases import assert_hf_parity
from tests.models.test_hf_parity import random_hf_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, IMAGE = 300, 299  # the image token's id
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
SLIDING = ["sliding_attention", "full_attention"]
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_channels=3, patch_size=2)
SPLIT = {"text_config": cpref.hf.NAME, "vision_config": "eager", "": cpref.hf.NAME}  # the vision tower runs whole images


def config(name: str):
    """The tiny config of `name`; its documents in `DOCS`."""
    if name.startswith("gemma3-bidirectional"):  # sliding_window 8 -> 8 // 2 + 1 = 5 in the config: |x - y| < 5
        kinds = SLIDING if name == "gemma3-bidirectional" else ["full_attention"] * 2
        return transformers.Gemma3TextConfig(**TEXT, sliding_window=8, layer_types=kinds, use_bidirectional_attention=True)
    if name == "gemma3-images":  # 4 tokens an image (8 x 8 pixels, 4 x 4 patches pooled 2 x 2); windows of 3 keys
        return transformers.Gemma3Config(text_config=dict(TEXT, sliding_window=3, layer_types=SLIDING),
                                         vision_config=dict(VISION, image_size=8), mm_tokens_per_image=4,
                                         image_token_id=IMAGE, boi_token_id=297, eoi_token_id=298)  # fmt: skip
    # PaliGemma: 4 tokens an image (4 x 4 pixels, 2 x 2 patches), a Gemma text model
    return transformers.PaliGemmaConfig(text_config=dict(TEXT, model_type="gemma"), vision_config=dict(VISION, image_size=4),
                                        image_token_id=IMAGE, projection_dim=64, hidden_size=64, vocab_size=VOCAB)  # fmt: skip


CLASSES = {"gemma3-bidirectional": "Gemma3ForCausalLM", "gemma3-bidirectional-full": "Gemma3ForCausalLM",
           "gemma3-images": "Gemma3ForConditionalGeneration", "paligemma": "PaliGemmaForConditionalGeneration"}  # fmt: skip
# each document: text runs (a number of tokens) and images ("image"); PaliGemma's: (prefix, suffix) token types
DOCS = {
    "gemma3-bidirectional": [[13], [7], [20]],
    "gemma3-images": [[3, "image", 2, "image", 3], [2, "image", 5], [6]],
    "paligemma": [["image", 3, "|", 6], ["image", 2, "|", 9]],
}
DOCS["gemma3-bidirectional-full"] = DOCS["gemma3-bidirectional"]


def build(name: str, implementation):
    """The model `name` with `test_hf_parity`'s random weights, in fp32, eval mode."""
    c = config(name)
    c._attn_implementation = implementation
    return random_hf_model(CLASSES[name], c)


def documents(name: str, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Every document's `(input_ids (n,), token_type_ids (n,), images)`: Gemma 3's images are type 1, PaliGemma's
    prefix (its image and prompt) type 0 and its suffix (after "|") type 1."""
    g, out = torch.Generator().manual_seed(seed), []
    for parts in DOCS[name]:
        ids, types, images, kind = [], [], 0, 0
        for part in parts:
            if part == "|":
                kind = 1
            elif part == "image":
                ids, types, images = ids + [IMAGE] * 4, types + [0 if name == "paligemma" else 1] * 4, images + 1
            else:
                ids += torch.randint(1, 290, (part,), generator=g).tolist()
                types += [kind] * part
        out.append((torch.tensor(ids), torch.tensor(types), images))
    return out


def pixels(name: str, n: int) -> torch.Tensor:
    size = config(name).vision_config.image_size if "images" in name or name == "paligemma" else 0
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(7))


def padded(docs) -> dict[str, torch.Tensor]:
    """The documents as a right-padded `transformers` batch `(B, L)`."""
    L = max(len(ids) for ids, _, _ in docs)
    pad = lambda x: F.pad(x, (0, L - len(x)))  # noqa: E731
    return {"input_ids": torch.stack([pad(i) for i, _, _ in docs]), "token_type_ids": torch.stack([pad(t) for _, t, _ in docs]),
            "attention_mask": torch.stack([pad(torch.ones(len(i), dtype=torch.long)) for i, _, _ in docs])}  # fmt: skip


def call_args(name: str, ids, types, images: torch.Tensor | None) -> dict:
    if name.startswith("gemma3-bidirectional"):
        return {}
    return {"token_type_ids": types[None], **({"pixel_values": images} if images is not None and len(images) else {})}


def reference(name: str):
    """Hugging Face eager on each document alone: `(logits (T, V), loss, {parameter: gradient})`."""
    model, docs = build(name, "eager"), documents(name)
    pix, at, logits, labels = pixels(name, sum(n for _, _, n in docs)), 0, [], []
    for ids, types, n in docs:
        logits.append(model(ids[None], **call_args(name, ids, types, pix[at : at + n]), use_cache=False).logits[0])
        labels.append(torch.cat([ids[1:], ids.new_full((1,), -100)]))
        at += n
    logits, labels = torch.cat(logits), torch.cat(labels)
    loss = F.cross_entropy(logits, labels, ignore_index=-100)
    loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads  # a vision tower's unused head has none


def run_cp(name: str, P: int, mode: str, layout: str):
    """Per rank: `(logits (T_l, V), loss share, {parameter: gradient}, sharding)` through `cpref.hf`."""
    cpref.hf.register()
    base = build(name, cpref.hf.NAME if name.startswith("gemma3-bidirectional") else SPLIT)
    docs = documents(name)
    batch, pix = padded(docs), pixels(name, sum(n for _, _, n in docs))

    def rank(comm):
        model = copy.deepcopy(base)
        b = cpref.hf.shard_batch(batch, cp_size=P, rank=comm.rank, layout=layout)
        cp = cpref.hf.CP(comm, b["sharding"], mode, cpref.MODES[mode].example_options(P))
        logits = model(b["tokens"][None], **call_args(name, b["tokens"], b["token_type_ids"], pix), use_cache=False,
                       cp=cp).logits[0]  # fmt: skip
        loss = cpref.cp_loss(F.cross_entropy(logits, b["labels"], reduction="none"), b["loss_mask"], comm)
        loss.backward()
        return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}, b["sharding"]

    return SimCluster(P).run(rank)


NAMES = sorted(CLASSES)
MODES = sorted(cpref.MODES)
CASES = [(name, P, mode, cpref.LAYOUTS[(i + j + P) % len(cpref.LAYOUTS)])
         for j, name in enumerate(NAMES) for P in (2, 4) for i, mode in enumerate(MODES)]  # fmt: skip


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.sweep
@pytest.mark.parametrize("name, P, mode, layout", CASES)
def test_logits_loss_and_gradients_equal_hugging_faces(references, name, P, mode, layout):
    if name not in references:
        references[name] = reference(name)
    assert_hf_parity(run_cp(name, P, mode, layout), references[name], f"{name} P={P} {mode} {layout}")


def record_masks(name: str) -> dict[str, torch.Tensor]:
    """The masks `transformers` hands its eager attention on the padded batch of `DOCS[name]`, by layer kind: bool
    `(B, L, L)`, True where a query sees a key (an attention implementation that records them, eager's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    seen: dict[str, torch.Tensor] = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        kind = module.config.layer_types[module.layer_idx] if getattr(module.config, "layer_types", None) else "full_attention"
        seen[kind] = attention_mask[:, 0] == 0  # (B, L, L): additive 0 where seen
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("cpref_record", recording)
    AttentionMaskInterface.register("cpref_record", eager_mask)
    split = "cpref_record" if name.startswith("gemma3-bidirectional") else {**SPLIT, "text_config": "cpref_record", "": "cpref_record"}
    model, docs = build(name, split), documents(name)
    batch = padded(docs)
    with torch.no_grad():
        model(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
              **call_args(name, None, batch["token_type_ids"][0], pixels(name, sum(n for _, _, n in docs)))
              | ({} if name.startswith("gemma3-bidirectional") else {"token_type_ids": batch["token_type_ids"]}))  # fmt: skip
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_the_masks_are_transformers_own(name):
    """`model_masks` over the batch is, in every document's block, the mask `transformers` builds for that row; it is
    not causal (nor, on sliding layers, a causal window): the parity above is the mask's."""
    seen, docs = record_masks(name), documents(name)
    lengths = [len(ids) for ids, _, _ in docs]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ours = model_masks(config(name), cu, torch.cat([t for _, t, _ in docs]))
    assert sorted(ours) == sorted(seen) == sorted(set(getattr(config(name).get_text_config(), "layer_types", None) or ["full_attention"]))
    for kind, mask in ours.items():
        dense = mask.dense()
        for b, (a, e) in enumerate(zip(cu, cu[1:])):
            n = e - a
            assert torch.equal(dense[a:e, a:e], seen[kind][b, :n, :n]), f"{name} {kind} document {b}"
            assert not dense[a:e, :a].any() and not dense[a:e, e:].any()  # nothing across documents
        plain = cpref.Mask.causal_documents(cu).dense()  # what cpref's layers do without a mask: causal, windowed
        if kind == "sliding_attention":
            x, W = torch.arange(cu[-1]), config(name).get_text_config().sliding_window
            plain &= x[None, :] > x[:, None] - W
        assert not torch.equal(dense, plain), f"{name} {kind}"


# ---- refused, on every rank alike and before any communication, naming the fix ------------------------------------
def attempt(name: str, go, P: int = 2, plain: bool = False, implementation=None):
    """`(per-rank results of go(model, b, cp, pix), trace)` on `DOCS[name]`'s batch through `shard_batch` (with
    `plain`, a plain `Sharding` from `get_batch_on_this_cp_rank`); a rank's exception is its result."""
    cpref.hf.register()
    base = build(name, implementation or (cpref.hf.NAME if name.startswith("gemma3-bidirectional") else SPLIT))
    docs = documents(name)
    batch, pix = padded(docs), pixels(name, sum(n for _, _, n in docs))

    def rank(comm):
        b = cpref.hf.shard_batch(batch, cp_size=P, rank=comm.rank)
        if plain:
            cu = b["sharding"].cu_seqlens
            stream = {"tokens": torch.cat([i for i, _, _ in docs]), "token_type_ids": torch.cat([t for _, t, _ in docs])}
            b = cpref.get_batch_on_this_cp_rank(stream | {"labels": stream["tokens"]}, cu, cp_size=P, rank=comm.rank)
        try:
            return go(copy.deepcopy(base), b, comm, pix)
        except cpref.CPInputError as err:
            return err

    cluster = SimCluster(P)
    return cluster.run(rank), cluster.trace


def forward(model, b, cp, **kw):
    return model(b["tokens"][None], use_cache=False, cp=cp, **kw).logits[0].detach()


def alike(results, trace, match: str) -> None:
    """Every rank raised `match` (its own error, not a peer's), and nothing but the guard's row was communicated."""
    assert all(isinstance(r, cpref.CPInputError) and match in str(r) for r in results), results
    assert [e.op for e in trace] in ([], ["all_gather"]), trace


def test_a_vision_tower_with_cprefs_attention_is_refused_when_built():
    cpref.hf.register()
    with pytest.raises(cpref.CPInputError, match="its vision tower would run attn_implementation='cpref'"):
        build("gemma3-images", cpref.hf.NAME)


def test_bidirectional_attention_of_another_family_is_refused():
    """Gemma (1) with `use_bidirectional_attention`: its layers are not causal but its mask is; refused by name."""
    cpref.hf.register()
    c = transformers.GemmaConfig(**TEXT, use_bidirectional_attention=True)
    c._attn_implementation = cpref.hf.NAME
    model = random_hf_model("GemmaForCausalLM", c)
    b = cpref.hf.shard_batch({"input_ids": torch.arange(1, 9)[None]}, cp_size=1, rank=0)
    with pytest.raises(cpref.CPInputError, match="use_bidirectional_attention=True on a gemma config"):
        forward(model, b, cpref.hf.CP(cpref.SingleRank(), b["sharding"]))


@pytest.mark.parametrize("name, plain, kw, match", [
    ("paligemma", False, lambda b, pix: {}, "built from the whole batch's token_type_ids"),
    ("gemma3-images", True, lambda b, pix: {"token_type_ids": b["token_type_ids"][None]}, "built from the whole batch's"),
    ("gemma3-images", False, lambda b, pix: {"token_type_ids": 1 - b["token_type_ids"][None]}, "are not its shard"),
    ("gemma3-images", False, lambda b, pix: {"pixel_values": pix[:2]}, "image tokens (id 299) but pixel_values 2 images"),
    ("gemma3-images", True, lambda b, pix: {"pixel_values": pix}, "need the input_ids and the whole batch's token ids"),
    ("gemma3-images", False, lambda b, pix: {"mm_encoder_outputs": {}}, "mm_encoder_outputs= is not supported"),
])  # fmt: skip
def test_what_the_models_mask_and_images_cannot_be_built_from_is_refused(name, plain, kw, match):
    def go(model, b, comm, pix):
        return forward(model, b, cpref.hf.CP(comm, b["sharding"], "p2p"), **kw(b, pix))

    alike(*attempt(name, go, plain=plain), match)


def test_input_ids_that_are_not_the_shards_with_images_are_refused():
    def go(model, b, comm, pix):
        ids = b["tokens"].roll(1)[None]
        return model(ids, pixel_values=pix, use_cache=False, cp=cpref.hf.CP(comm, b["sharding"], "p2p")).logits

    alike(*attempt("gemma3-images", go), "input_ids of rank")


def test_a_given_mask_is_the_models_own_or_refused():
    """`CP(mask=cpref.hf.model_masks(...))` with a plain sharding gives the logits of the mask cpref builds itself;
    another mask for a model that builds its own, or one Mask for a model with sliding layers, is refused."""
    name = "gemma3-bidirectional"
    own = model_masks(config(name), [0, 13, 20, 40])

    def go(model, b, comm, pix):
        return forward(model, b, cpref.hf.CP(comm, b["sharding"], "p2p", mask=own)), b["sharding"]

    def derived(model, b, comm, pix):
        return forward(model, b, cpref.hf.CP(comm, b["sharding"], "p2p")), b["sharding"]

    given, made = attempt(name, go, plain=True)[0], attempt(name, derived)[0]
    torch.testing.assert_close(given[0][1].unpad(given[0][1].unshard([r[0] for r in given])),
                               made[0][1].unpad(made[0][1].unshard([r[0] for r in made])), atol=1e-6, rtol=1e-6)  # fmt: skip
    swapped = {"full_attention": own["sliding_attention"], "sliding_attention": own["full_attention"]}
    for mask, match in [(swapped, "differs from the mask the model builds from this batch on its full_attention, "
                                  "sliding_attention layers"),
                        (own["full_attention"], "is one Mask but the model has sliding_attention layers"),
                        ({"full_attention": own["full_attention"]}, "has no mask for the layer kinds ['sliding_attention']")]:  # fmt: skip
        def bad(model, b, comm, pix, mask=mask):
            return forward(model, b, cpref.hf.CP(comm, b["sharding"], "p2p", mask=mask))

        alike(*attempt(name, bad), match)


@pytest.mark.parametrize("mask, match", [
    ("causal", "the mask of every layer is str, not a cpref.Mask"),
    ({"global": cpref.Mask.causal_documents([0, 40])}, "mask has a key 'global'"),
    (cpref.Mask.causal_documents([0, 39]), "the mask of every layer is over 39 tokens, the sharding's batch has 40"),
])  # fmt: skip
def test_a_mask_that_is_not_one_is_refused_by_cp(mask, match):
    with pytest.raises(cpref.CPInputError, match=match):
        cpref.hf.CP(cpref.SingleRank(), cpref.Sharding([0, 40], cp_size=1), mask=mask)


def test_ranks_with_other_masks_are_refused_on_every_rank():
    """Any model takes `CP(mask=)` (here Llama, full layers only); a rank whose mask differs is named on every rank."""
    from tests.models.test_hf_attention import build as build_text

    cpref.hf.register()
    base, tokens = build_text("llama3", cpref.hf.NAME), torch.arange(1, 17)

    def rank(comm):
        b = cpref.hf.shard_batch({"input_ids": tokens[None]}, cp_size=2, rank=comm.rank)
        prefix = cpref.Mask.prefix_lm([0, 16], prefix_lengths=[4 + comm.rank])
        try:
            return forward(copy.deepcopy(base), b, cpref.hf.CP(comm, b["sharding"], "p2p", mask=prefix))
        except cpref.CPInputError as err:
            return err

    cluster = SimCluster(2)
    alike(cluster.run(rank), cluster.trace, "the attention masks: rank 0: digest")
