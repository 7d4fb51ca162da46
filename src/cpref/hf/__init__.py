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
| forward | `logits_to_keep`, image or audio inputs | they read the shard's last tokens, or are not text |
| forward | `softcap=` or `s_aux=` passed to the model | it would reach layers whose own attention has none; a layer that has them gives its own |
| forward | `is_causal=` passed to the model that is not every layer's own `is_causal` | the layers attend with their own |
| forward | `labels` or `shift_labels` that are not this rank's `T / P` integer labels | they label the shard's tokens |
| forward | `labels=` of a head that is not a causal LM | only causal LM labels are shifted |
| forward | `labels=` that are `shard_batch`'s labels (already the next tokens; pass `shift_labels=batch["shift_labels"][None]`) | the model would shift them a second time |
| forward | `labels=` that are already the next tokens (each the id of the token after it in its document: `get_batch_on_this_cp_rank`'s, Megatron's; pass them as `shift_labels=`) | the model would shift them a second time |
| forward | `labels=` that label the first token of a row padded on its left (pass `shift_labels=batch["shift_labels"][None]`, or -100 there) | `transformers` would have the padding before it predict it, and `shard_batch` dropped that padding |
| forward | another rank's inputs that failed these checks (a `cpref.base.errors.PeerInputError` naming that rank) | that rank does not go on to the collectives |
| forward | ranks that pass different loss arguments, `use_cache` or caches, training modes, activation checkpointing, autograd or position starts | the ranks would compute different things, or refuse at different layers |
| layer | a layer reached without the model-level checks (called on its own, or the model's forward pre-hook removed) | its positions, masks and labels were not checked |
| layer | a key/value cache (more keys than queries, `use_cache=True` in training) | a rank's keys are not its queries' keys |
| layer | attention dropout in training | cpref's kernels have none; set `attention_dropout=0.0` |
| layer | an attention mask that reaches the layer (one the model makes of its own) | the padding is the sharding's |
| layer | a sliding window without a causal mask | models differ in what it means |
| layer | a mask function of the model's own (`or_mask_function`, e.g. image tokens) | cpref's masks are the sharding's |
| `CP(...)` | a communicator that is not a `cpref.comm.protocol.Collectives`, a sharding that is not a `cpref.Sharding`, or one over another CP size than the group's | every layer attends the batch's shards over the group |
| `CP(...)` | a mode not in `cpref.MODES`, `options` that are not a dict, or with `causal`, `softmax_scale` or `window` | every layer gives its own causal mask, scale and window |
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

__all__ = ["CP", "attention", "mask", "forward", "register", "shard_batch", "NAME"]

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
