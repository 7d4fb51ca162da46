r"""Hugging Face models with cpref's CP: one attention implementation, registered by name.

`transformers` routes most of its models' attention (Llama, Qwen2/3, Mistral, Gemma, GPT-2,
...) through one seam: a function registered under a name with
`transformers.AttentionInterface.register`, chosen with `attn_implementation=name`. cpref
registers [`attention`][cpref.hf.attention] there, so a model of `transformers`, loaded or
built with `attn_implementation="cpref"`, runs every attention layer with CP, and nothing else
of it changes: its embeddings, RoPE (scaled RoPE included), norms and MLPs are per-token and
see the rank's shard.

```python
import cpref, cpref.hf
cpref.hf.register()                                    # once: the name "cpref"
model = AutoModelForCausalLM.from_config(config, attn_implementation="cpref")
batch = cpref.get_batch_on_this_cp_rank(sample, cu_seqlens, cp_size=P, rank=comm.rank)
logits = model(batch["tokens"][None], position_ids=batch["position_ids"][None], use_cache=False,
               cp=cpref.hf.CP(comm, batch["sharding"], mode="p2p")).logits[0]
loss = cpref.cp_loss(logits, batch["labels"], batch["loss_mask"], total_tokens)
```

**The CP arguments travel with the call.** `model(..., cp=cpref.hf.CP(...))`: `transformers`
hands the model's extra keyword arguments down to every attention call, so each call finds
the communicator, the batch's [`Sharding`][cpref.sharding] and the mode there, and gradient
checkpointing, which runs a layer's forward again in the backward with the same arguments,
finds them too. Nothing is global: two models, or two steps with two batches, do not share
state.

**Each layer's own settings** come from the layer: its `scaling` (`softmax_scale`), its heads
(GQA: fewer key/value heads than query heads), `is_causal`, and `sliding_window`, which
`transformers` gives as the number of keys a query sees, itself included: `window=(W - 1, 0)`
in cpref's convention ([the kernel contract][cpref.kernels.contract]).

**Positions.** The batch must be one packed sequence (batch size 1) described by the sharding;
pass `position_ids` from `cpref.get_batch_on_this_cp_rank` (positions restart at every
document), so that RoPE rotates each token by its position in its document, on every rank.

**Refused, by name, before any communication**, rather than computing something else:
attention dropout in training (cpref's kernels have none), logit soft-capping, attention
sinks, a key/value cache (a query shard's keys are not its own; `use_cache=True` in training),
a batch of more than one
sequence, a call without `cp=`, an `attention_mask` tensor (the documents are the sharding's;
a padding mask would be ignored), and a sliding window without a causal mask (models differ
in what it means).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cpref.api import attention as cp_attention
from cpref.comm import Collectives
from cpref.errors import CPInputError
from cpref.kernels.contract import NO_WINDOW
from cpref.sharding import Sharding

__all__ = ["CP", "attention", "forward", "register", "NAME"]

NAME = "cpref"  # the attn_implementation register() adds


@dataclass(frozen=True)
class CP:
    """What every attention call of one forward needs: pass it as `model(..., cp=CP(...))`.

    Attributes:
        comm: this rank's CP group (`cpref.comm.Collectives`: gloo, NCCL, HCCL or the simulated cluster).
        sharding: the batch's `cpref.Sharding` (from `cpref.get_batch_on_this_cp_rank`).
        mode: a name of `cpref.MODES`.
        options: the mode's options (e.g. `{"a2a_size": 2}`) and `kernel`, as `cpref.attention` takes them.
    """

    comm: Collectives
    sharding: Sharding
    mode: str = "p2p"
    options: dict[str, Any] = field(default_factory=dict)


def register(name: str = NAME) -> str:
    """Register `attention` with `transformers` under `name` (imports `transformers`); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    return name


def _refuse(module, query, key, attention_mask, dropout, kwargs) -> None:
    """Everything the module docstring refuses, each naming the value and the fix."""
    what = type(module).__name__
    if kwargs.get("cp") is None:
        raise CPInputError(f"{what}: attn_implementation={NAME!r} needs the CP arguments of this forward: call "
                           "model(..., cp=cpref.hf.CP(comm, sharding, mode=...))")  # fmt: skip
    if not isinstance(kwargs["cp"], CP):
        raise CPInputError(f"{what}: cp= must be a cpref.hf.CP, got {type(kwargs['cp']).__name__}")
    if query.shape[0] != 1:
        raise CPInputError(f"{what}: cpref runs one packed sequence (batch size 1), got batch size {query.shape[0]}; "
                           "pack the documents into one sequence described by the sharding")  # fmt: skip
    if key.shape[2] != query.shape[2]:
        raise CPInputError(f"{what}: {key.shape[2]} keys for {query.shape[2]} queries: a key/value cache is not "
                           "supported with CP; call the model with use_cache=False")  # fmt: skip
    if kwargs.get("use_cache") and module.training:
        raise CPInputError(f"{what}: use_cache=True in training: a key/value cache is not supported with CP; call the "
                           "model with use_cache=False")  # fmt: skip
    if dropout and module.training:
        raise CPInputError(f"{what}: attention dropout {dropout} in training is not supported by cpref's kernels; set "
                           "the config's attention_dropout to 0.0")  # fmt: skip
    if attention_mask is not None:
        raise CPInputError(f"{what}: an attention_mask tensor is not supported (the documents are the sharding's, a "
                           "padding mask would be ignored); call the model without attention_mask")  # fmt: skip
    for name, what_it_is in (("softcap", "logit soft-capping"), ("s_aux", "attention sinks")):
        if kwargs.get(name) is not None:
            raise CPInputError(f"{what}: {what_it_is} ({name}={kwargs[name]!r}) is not supported by cpref")


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """`transformers`' attention signature over cpref: `query (1, Hq, T_l, D)`, `key`/`value (1, Hkv, T_l, X)`
    of this rank's shard -> `(attn_output (1, T_l, Hq, Dv), None)` (no attention weights)."""
    _refuse(module, query, key, attention_mask, dropout, kwargs)
    cp, window = kwargs["cp"], kwargs.get("sliding_window")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T_l, H, X) each
    causal = bool(getattr(module, "is_causal", True))
    if window is not None and not causal:
        raise CPInputError(f"{type(module).__name__}: a sliding window without a causal mask (sliding_window={window}) "
                           "is not supported: its convention differs between models")  # fmt: skip
    window = NO_WINDOW if window is None else (int(window) - 1, 0)  # W keys a query sees, itself included
    out = cp_attention(q, k, v, cp.sharding, comm=cp.comm, mode=cp.mode, causal=causal, window=window,
                       softmax_scale=None if scaling is None else float(scaling), **cp.options)  # fmt: skip
    return out[None], None  # (1, T_l, Hq, Dv)


def forward(model: torch.nn.Module, batch: dict, ctx: Any) -> torch.Tensor:
    """`cpref.training`'s `forward` for a Hugging Face causal LM: logits `(T_l, V)` of this rank's shard.

    `batch` is `get_batch_on_this_cp_rank`'s (`tokens`, `position_ids`); `ctx` a `cpref.models.CPContext`
    (`comm`, `sharding`, `mode`, `options`)."""
    options = dict(ctx.options) | ({"kernel": ctx.kernel} if getattr(ctx, "kernel", None) is not None else {})
    cp = CP(ctx.comm, ctx.sharding, ctx.mode, options)
    return model(batch["tokens"][None], position_ids=batch["position_ids"][None], use_cache=False, cp=cp).logits[0]
