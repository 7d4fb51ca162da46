r"""Hugging Face models with cpref's CP: one attention implementation, registered by name.

`transformers` routes its models' attention (Llama, Qwen2/3, Mistral, Gemma, GPT-2, BERT, ...)
through one seam: a function registered under a name with `transformers.AttentionInterface`,
chosen with `attn_implementation=name`, and a mask function registered under the same name with
`AttentionMaskInterface`. [`register`][cpref.hf.register] puts cpref's
[`attention`][cpref.hf.layer.attention] and [`mask`][cpref.hf.layer.mask] there, so a model built
or loaded with `attn_implementation="cpref"` runs every attention layer with CP. Its embeddings,
RoPE (scaled RoPE included), norms and MLPs are per-token and see the rank's shard.

```python
# given: comm, P, path, batch; comm: this rank's CP group, path: a checkpoint, batch: a padded transformers batch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
import cpref, cpref.hf
cpref.hf.register()                                           # once: the name "cpref"
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cpref")
b = cpref.hf.shard_batch(batch, cp_size=P, rank=comm.rank)    # a padded or flattened batch -> this rank's
cp = cpref.hf.CP(comm, b["sharding"], mode="p2p")
logits = model(b["tokens"][None], position_ids=b["position_ids"][None], use_cache=False, cp=cp).logits[0]
loss = cpref.cp_loss(F.cross_entropy(logits, b["labels"], reduction="none"), b["loss_mask"], comm)
loss.backward()                                               # then sum the gradients over the CP group
```

## Right, or refused when the model is built

`register()` also wraps the one method `transformers` asks of every model it builds whether an
attention implementation can be used ([`cpref.hf.admit`][cpref.hf.admit]). A model built with
cpref's name is refused there, naming its class and why, when cpref would compute something
else: attention layers that do not pass the forward's arguments on (StableLm), heads that read a
token by its index in the sequence (sequence classification), and layer kinds cpref does not
run (Llama 4's attention temperature tuning, linear attention, convolutions). Other models get a
check of every forward. Gemma 2's logit soft-capping, GPT-OSS's attention sinks and Llama 4's
chunked layers run ([Attention variants](variants.md)).

## Every forward: positions, masks, labels

**The CP arguments travel with the call.** `model(..., cp=cpref.hf.CP(...))`: `transformers`
hands the model's extra keyword arguments down to every attention call, so each layer finds the
communicator, the batch's [`Sharding`][cpref.batch.sharding] and the mode there, and gradient
checkpointing, which runs a layer's forward again in the backward with the same arguments,
finds them too. Nothing is global: two models, or two steps with two batches, share no state.

Before the model runs, [`cpref.hf.guard`][cpref.hf.guard] checks what the model's own per-token
code would get wrong on a shard, on every rank alike:

* **positions**: missing `position_ids` are filled in from the sharding (each token's
  position in its document), and given ones must be the sharding's (up to a start offset that
  every rank shares): `transformers` would number a shard `0 .. T / P - 1`;
* **masks**: a padding `attention_mask` is honoured where its padding is the sharding's and
  refused where it marks a real token as padding;
  [`shard_batch`][cpref.hf.batch.shard_batch] is how a padded batch becomes the sharding's;
* **labels**: `labels=` keeps its meaning (the model shifts them), shifted over the unsharded
  batch (one all-gather of the label ids) inside each row of the batch `shard_batch` was given,
  so the loss is `transformers`' own on that batch with `-100` at its padding (no token predicts
  another row's first, nor padding); `num_items_in_batch` counts the whole batch's loss tokens,
  so the model's `loss` on a rank is its share of the batch's mean. Labels that would have a
  left-padded row's padding predict its first token are refused. The labels of `shard_batch`
  are already the next tokens: the model's loss takes them as
  `shift_labels=b["shift_labels"][None]` (alone: cpref hands them on as `labels` too); as
  `labels=` they are refused.

**The gradients.** Every rank holds a replica of the parameters and its loss share reaches
only its tokens' part of each gradient: the gradient of the batch's loss is the **sum** of the
ranks' gradients over the CP group (over DP x CP with data parallelism too), one all-reduce with a
sum, as [`cpref.train.training`][cpref.train.training] does. A mean would make it `P` times too small.

**Each layer's own settings** come from the layer: its `scaling` (`softmax_scale`), its heads
(GQA: fewer key/value heads than query heads), `is_causal`, and `sliding_window`, which
`transformers` gives as the number of keys a query sees, itself included: `window=(W - 1, 0)`
in cpref's convention ([the kernel contract][cpref.kernels.contract]).

## Models whose masks are not causal: Gemma 3, PaliGemma

Gemma 3 text with `use_bidirectional_attention=True` (with or without its sliding layers),
Gemma 3's image tokens (`token_type_ids` 1: an image sees itself whole) and PaliGemma's prefix
(`token_type_ids` 0: the image and prompt see each other whole) build masks of their own.
Under CP cpref builds the same masks, one [`cpref.Mask`][cpref.batch.mask.Mask] per layer kind,
windows included ([`cpref.hf.masks`][cpref.hf.masks], checked against the masks `transformers`
5.24 builds), from the **whole** batch's `token_type_ids`, which
[`shard_batch`][cpref.hf.batch.shard_batch] keeps in the batch's sharding: pass the batch with
its `token_type_ids` to `shard_batch`, and the rank's `token_type_ids` and every image of the
batch to the model, as without CP. Each rank runs the vision tower (build it with another
implementation: `attn_implementation={"text_config": "cpref", "vision_config": "sdpa", "": "cpref"}`)
on the images its shard has tokens of, and writes only its tokens' features:

```python
# run by tests/models/test_hf_masks.py::test_logits_loss_and_gradients_equal_hugging_faces
# model: Gemma3ForConditionalGeneration or PaliGemmaForConditionalGeneration, its vision tower not cpref's;
# batch: a padded transformers batch with input_ids, attention_mask and token_type_ids; pixel_values: all its images
b = cpref.hf.shard_batch(batch, cp_size=P, rank=comm.rank)    # keeps the whole batch's token_type_ids and ids
cp = cpref.hf.CP(comm, b["sharding"], mode="p2p")             # the model's masks: built by cpref from the batch
logits = model(b["tokens"][None], token_type_ids=b["token_type_ids"][None], pixel_values=pixel_values,
               use_cache=False, cp=cp).logits[0]
```

The masks are the same on every rank (the ranks compare them before any communication).
With a batch of your own sharding (`get_batch_on_this_cp_rank`), pass them:
`cpref.hf.CP(comm, sharding, mode, mask=cpref.hf.model_masks(model.config, cu_seqlens, token_type_ids))`
(images need `shard_batch`). `CP(mask=)` takes any mask for any model: a `cpref.Mask` for a
model of full layers only, a dict of one per layer kind otherwise; for the models above it must
be the one they build. A vision tower's parameters get no gradient on a rank whose shard holds
no image token (`None`), and the sum over the ranks is the batch's gradient.

## Under torch.compile

`torch.compile(model)` compiles the model's own code (embeddings, RoPE, norms, MLPs, the loss)
and leaves cpref's to run eagerly: the model-level checks ([`cpref.hf.guard`][cpref.hf.guard], a
forward pre-hook) and every layer's [`attention`][cpref.hf.layer.attention] are graph breaks
(`torch.compiler.disable`), as [`cpref.attention`][cpref.api.attention] is. The loss and gradients
are the eager model's, and the next batch (another `CP`, another sharding) reuses the compiled
graphs. With `fullgraph=True`, dynamo refuses at the checks, naming them.

## Everything refused

Each raises `cpref.CPInputError` naming the value and the fix (`register()`: an `ImportError`).
The model-level checks and the layers raise on every rank alike, before any communication: where
only one rank's inputs are wrong (its positions, say), that rank raises its error and the others
raise a `cpref.base.errors.PeerInputError` naming it; where the ranks pass different arguments, every rank
raises the same error naming them. `CP(...)`, `shard_batch` and `register()` raise on the rank
that calls them. A test keeps this table complete: every refusal of `cpref.hf` has its row.

| when | refused | why |
| --- | --- | --- |
| `register()` | a `transformers` without `PreTrainedModel._check_and_adjust_attn_implementation` (before 5) | that is where the models built with cpref's name are checked |
| built | a class with `_supports_attention_backend = False` (StableLm) | its layers drop `cp=` |
| built | a head that reads tokens by index (`...ForSequenceClassification`, `...ForQuestionAnswering`, multiple choice, next sentence, pre-training) | the index is the shard's |
| built | a `layer_types` entry but `full_attention`, `sliding_attention` and `chunked_attention` (linear attention, ...) | cpref runs causal, full, sliding-window and chunked layers |
| built | `attn_temperature_tuning` with NoPE layers (Llama 4) | it scales a query by its index in the shard |
| first forward | a pooler of the first token (BERT's: build with `add_pooling_layer=False`) | the first token is the shard's |
| forward | no `cp=cpref.hf.CP(...)`, or not a `CP` (at a layer too) | the layers cannot know the CP group or the documents |
| forward | extra positional arguments, or arguments the forward does not take | the checks read the arguments by name |
| forward | no `input_ids` (nor `inputs_embeds`), batch size above 1 (at a layer too), or not `T / P` tokens | cpref attends one packed sequence, sharded |
| forward | a model whose forward has no `position_ids` parameter (nor `**kwargs`), called without them | it would number each shard from 0 |
| forward | `position_ids` that are not `(1, T / P)` integers, or not the sharding's (another rank's, another layout's, `0 .. T / P - 1`) | RoPE and learned positions would be wrong |
| forward | an `attention_mask` that is not a `(1, T / P)` padding mask (a 4-D mask), holds values other than 0 and 1, or marks a real token as padding | the padding is the sharding's |
| forward | `cu_seq_lens_q`/`_k` that are not the sharding's boundaries | the documents are the sharding's |
| forward | `logits_to_keep`, image or audio inputs (but Gemma 3's and PaliGemma's `pixel_values`), `mm_encoder_outputs` | they read the shard's last tokens, or are not text, or the batch's |
| forward | `softcap=` or `s_aux=` passed to the model | it would reach layers whose own attention has none; a layer that has them gives its own |
| forward | `is_causal=` passed to the model that is not every layer's own `is_causal` | the layers attend with their own |
| forward | `labels` or `shift_labels` that are not this rank's `T / P` integer labels | they label the shard's tokens |
| forward | `labels=` of a head that is not a causal LM | only causal LM labels are shifted |
| forward | `labels=` that are `shard_batch`'s labels (already the next tokens; pass `shift_labels=batch["shift_labels"][None]`) | the model would shift them a second time |
| forward | `labels=` that are already the next tokens (each the id of the token after it in its document: `get_batch_on_this_cp_rank`'s, Megatron's; pass them as `shift_labels=`) | the model would shift them a second time |
| forward | `labels=` that label the first token of a row padded on its left (pass `shift_labels=batch["shift_labels"][None]`, or -100 there) | `transformers` would have the padding before it predict it, and `shard_batch` dropped that padding |
| forward | another rank's inputs that failed these checks (a `cpref.base.errors.PeerInputError` naming that rank) | that rank does not go on to the collectives |
| forward | ranks that pass different loss arguments, `use_cache` or caches, training modes, activation checkpointing, autograd, position starts or masks | the ranks would compute different things, or refuse at different layers |
| layer | a layer reached without the model-level checks (called on its own, or the model's forward pre-hook removed) | its positions, masks and labels were not checked |
| layer | a key/value cache (more keys than queries, `use_cache=True` in training) | a rank's keys are not its queries' keys |
| layer | attention dropout in training | cpref's kernels have none; set `attention_dropout=0.0` |
| layer | an attention mask that reaches the layer (one the model makes of its own) | the padding is the sharding's |
| layer | a sliding window without a causal mask | models differ in what it means |
| layer | a mask function of the model's own (`or_mask_function`, e.g. image tokens) | cpref's masks are the sharding's |
| `CP(...)` | a communicator that is not a `cpref.comm.protocol.Collectives`, a sharding that is not a `cpref.Sharding`, or one over another CP size than the group's | every layer attends the batch's shards over the group |
| `CP(...)` | a mode not in `cpref.MODES`, `options` that are not a dict, or with `causal`, `softmax_scale` or `window` | every layer gives its own causal mask, scale and window |
| built | a vision tower with cpref's attention (`attn_implementation="cpref"` for every sub-config) | every rank runs it on whole images |
| first forward | `use_bidirectional_attention=True` on a config but Gemma 3 text's and PaliGemma's | cpref builds the masks of those only |
| forward | PaliGemma without `token_type_ids`, or Gemma 3 images' `token_type_ids` with a sharding that is not `shard_batch`'s (and no `CP(mask=)`) | the mask is built from the whole batch's types |
| forward | `token_type_ids` that are not the rank's shard of the batch's, or with `pixel_values` `input_ids` that are not | the mask and the images are the batch's |
| forward | `pixel_values` with a sharding that is not `shard_batch`'s, or not one image per `mm_tokens_per_image` (PaliGemma: `num_image_tokens`) image tokens, or a vision tower that gives another number | a rank finds its tokens' images in the whole batch |
| forward | a `CP(mask=)` that is not the mask the model builds, one `Mask` for a model with sliding or chunked layers, or a dict without a layer kind of the model | the layers would attend another mask |
| `CP(...)` | a `mask` that is not a `cpref.Mask` or a dict of them by layer kind, or over another number of tokens than the batch's | the layers attend the batch's real tokens |
| `shard_batch` | no `input_ids` tensor, ids that are not integers `(B, L)`, a per-token tensor of another shape, a float `attention_mask`, `position_ids` or `labels`, `shift_labels` in the batch | what the documents and labels are read from |
| `shard_batch` | an `attention_mask` with values other than 0 and 1, or padding between a row's tokens; a batch of padding only | a row's tokens are one run |
| `shard_batch` | `position_ids` that do not restart at 0 at every document and count up by 1 | they tell the documents of a pack |
| `shard_batch` | the collator's `cu_seq_lens_q`/`_k` or `seq_idx` that are not the batch's documents | the documents are told once |
"""

from __future__ import annotations

from typing import Any

import torch

from cpref.hf.batch import shard_batch
from cpref.hf.layer import CP, NAMES, attention, mask
from cpref.hf.masks import model_masks

__all__ = ["CP", "attention", "mask", "forward", "register", "shard_batch", "model_masks", "NAME"]

NAME = "cpref"  # the attn_implementation register() adds


def register(name: str = NAME) -> str:
    """Register cpref's attention and mask with `transformers` under `name`, and check the models built with it.

    Imports `transformers`; idempotent. Returns the name (`attn_implementation=name`).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from cpref.hf.admit import install
    from cpref.hf.guard import guard

    install(guard)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    NAMES.add(name)
    return name


def forward(model: torch.nn.Module, batch: dict, ctx: Any) -> torch.Tensor:
    """`cpref.train.training`'s `forward` for a Hugging Face causal LM: logits `(T_l, V)` of this rank's shard.

    `batch` is `get_batch_on_this_cp_rank`'s (`tokens`, `position_ids`); `ctx` a `cpref.models.CPContext`
    (`comm`, `sharding`, `mode`, `options`)."""
    options = dict(ctx.options) | ({"kernel": ctx.kernel} if getattr(ctx, "kernel", None) is not None else {})
    cp = CP(ctx.comm, ctx.sharding, ctx.mode, options)
    return model(batch["tokens"][None], position_ids=batch["position_ids"][None], use_cache=False, cp=cp).logits[0]
