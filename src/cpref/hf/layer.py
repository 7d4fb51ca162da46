"""What every attention layer of a Hugging Face model calls under CP: `attention`, and the mask it is handed.

`transformers` calls an attention implementation as
`fn(module, query (B, Hq, T_l, D), key, value (B, Hkv, T_l, X), attention_mask, scaling=, dropout=, **kwargs)`,
with the model's forward's keyword arguments in `kwargs`, `cp=` among them. Its masks come from
the function registered under the same name with `AttentionMaskInterface`: [`mask`][cpref.hf.layer.mask]
here, which refuses what cpref cannot honour and hands on a padding mask that the model-level
checks ([`cpref.hf.guard`][cpref.hf.guard]) did not take, for the layer to refuse.

A model that builds a mask of its own (Gemma 3's image spans and bidirectional text, PaliGemma's
prefix: [`cpref.hf.masks`][cpref.hf.masks]) gets it from cpref instead: the model-level checks
build it from the whole batch, one `cpref.Mask` per layer kind, and each layer attends with its
kind's (`mask=`, in place of its causal mask and window); the mask `transformers` builds of the
shard is not used ([`mask`][cpref.hf.layer.mask] returns none for such a model).

Under `torch.compile`, [`attention`][cpref.hf.layer.attention] is a graph break
(`torch.compiler.disable`): the layer's checks and its `cpref.attention` call run eagerly, the
model's code around them compiles ([`cpref.hf`][cpref.hf]).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from cpref.api import MODES
from cpref.api import attention as cp_attention
from cpref.base.checks import as_choice
from cpref.base.errors import CPInputError
from cpref.batch.mask import Mask
from cpref.batch.sharding import Sharding
from cpref.comm.protocol import Collectives, check_comm
from cpref.kernels.contract import NO_WINDOW

__all__ = ["CP", "attention", "mask", "NAMES", "LAYER_OWN", "OWN_MASKS", "kind_of"]

NAMES: set[str] = set()  # the attn_implementation names cpref.hf.register() added
# id -> config of the (text) configs whose masks cpref builds (cpref.hf.masks), registered by the guard every forward
OWN_MASKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
KINDS = ("full_attention", "sliding_attention", "chunked_attention")  # the layer kinds cpref runs (cpref.hf.admit)

# options each layer gives itself: an option of that name in CP would collide with it
LAYER_OWN = {"causal": "is_causal", "softmax_scale": "scaling", "window": "sliding_window"}
# dynamo's graph-break reason: the layer's checks and its cpref.attention call run eagerly, the model's code around them compiles
EAGER = "cpref.hf's attention runs eagerly under torch.compile: its checks, and cpref.attention (communication across ranks)"


@dataclass(frozen=True)
class CP:
    """What every attention call of one forward needs: pass it as `model(..., cp=CP(...))`.

    Attributes:
        comm: this rank's CP group (`cpref.comm.protocol.Collectives`: gloo, NCCL, HCCL or the simulated cluster).
        sharding: the batch's `cpref.Sharding` (from `cpref.hf.shard_batch` or `cpref.get_batch_on_this_cp_rank`).
        mode: a name of `cpref.MODES`.
        options: the mode's options (e.g. `{"a2a_size": 2}`), `kernel`, `deterministic`, as `cpref.attention`
            takes them; not `causal`, `softmax_scale` or `window`, which every layer gives itself.
        mask: None (the default: the layers' own causal masks and windows, or the mask a model builds of its own
            from the batch, [`cpref.hf.masks`][cpref.hf.masks]); or a `cpref.Mask` over the batch's real tokens for
            every layer of a model of full layers only, or a dict of one per layer kind (`"full_attention"`,
            `"sliding_attention"`, `"chunked_attention"`), in place of the layers' causal masks and windows.

    Raises:
        CPInputError: for a communicator, sharding or mode that is not one, a sharding of another CP size, an
            option that a layer gives itself, or a mask that is not one, of another layer kind or another batch.
    """

    comm: Collectives
    sharding: Sharding
    mode: str = "p2p"
    options: Mapping[str, Any] = field(default_factory=dict)
    mask: Mask | Mapping[str, Mask] | None = None

    def __post_init__(self) -> None:
        _, size = check_comm(self.comm, fix="pass the CP group's collectives: cpref.hf.CP(comm, sharding, mode=...)")
        if not isinstance(self.sharding, Sharding):
            raise CPInputError(f"cpref.hf.CP: sharding must be the batch's cpref.Sharding, got "
                               f"{type(self.sharding).__name__}; use batch['sharding'] of cpref.hf.shard_batch")  # fmt: skip
        if self.sharding.cp_size != size:
            raise CPInputError(f"cpref.hf.CP: the sharding is over cp_size={self.sharding.cp_size} but the CP group "
                               f"has {size} ranks; shard the batch with cp_size={size}")  # fmt: skip
        as_choice("mode", self.mode, list(MODES))
        if not isinstance(self.options, Mapping):
            raise CPInputError(f"cpref.hf.CP: options must be a dict, got {type(self.options).__name__}")
        for name, own in LAYER_OWN.items():
            if name in self.options:
                raise CPInputError(f"cpref.hf.CP: options may not set {name}={self.options[name]!r}: every layer gives "
                                   f"its own (its {own}); remove it from options")  # fmt: skip
        if self.mask is not None:
            _check_given_mask(self.mask, self.sharding.cu_seqlens[-1])


def _check_given_mask(given: Any, total: int) -> None:
    """`CP(mask=)`: a `Mask`, or a dict of one per layer kind, over the batch's `total` real tokens."""
    masks = dict(given) if isinstance(given, Mapping) else {"every layer": given}
    for kind, m in masks.items():
        if isinstance(given, Mapping) and kind not in KINDS:
            raise CPInputError(f"cpref.hf.CP: mask has a key {kind!r}; its keys are layer kinds, {list(KINDS)}")
        if not isinstance(m, Mask):
            raise CPInputError(f"cpref.hf.CP: the mask of {kind} is {type(m).__name__}, not a cpref.Mask; build one with "
                               "cpref.Mask.from_slices (or cpref.hf.model_masks)")  # fmt: skip
        if (m.total or max(max(sl[1], sl[3]) for sl in m.slices)) > total or (m.total is not None and m.total != total):
            raise CPInputError(f"cpref.hf.CP: the mask of {kind} is over {m.total} tokens, the sharding's batch has "
                               f"{total} real tokens; build the mask over this batch")  # fmt: skip


@dataclass(frozen=True)
class Checked(CP):
    """A `CP` that has passed the model-level checks of this forward (`cpref.hf.guard` makes it)."""


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
         mask_function: Any = None, attention_mask: torch.Tensor | None = None, use_vmap: bool = False,
         **kwargs: Any) -> torch.Tensor | None:  # fmt: skip
    """`transformers`' mask entry for cpref: what `create_causal_mask` and its kin hand every layer.

    cpref's masks are the sharding's (its documents, its padding), causal or not, and each layer's
    window: nothing is built here. A mask function the model adds of its own (`or_mask_function`,
    `and_mask_function`, which `transformers` marks `use_vmap`) is refused; a 2-D padding mask is
    handed on as it is (the model-level checks take one that matches the sharding; any other
    reaches the layer, which refuses it).
    """
    if use_vmap and kwargs.get("config") is not None and OWN_MASKS.get(id(kwargs["config"])) is kwargs["config"]:
        return attention_mask  # cpref builds this model's mask (cpref.hf.masks); the layers refuse any other
    if use_vmap:
        raise CPInputError("the model adds a mask of its own to the causal one (an or_mask_function or "
                           "and_mask_function, e.g. image tokens that see each other): cpref attends the sharding's "
                           "documents, causal or not, with each layer's window, and nothing else")  # fmt: skip
    return attention_mask


def _refuse(module, query, key, attention_mask, dropout, kwargs) -> None:
    """Everything the layer refuses, each naming the value and the fix."""
    what = type(module).__name__
    cp = kwargs.get("cp")
    if cp is None:
        raise CPInputError(f"{what}: attn_implementation='cpref' needs the CP arguments of this forward: call "
                           "model(..., cp=cpref.hf.CP(comm, sharding, mode=...))")  # fmt: skip
    if not isinstance(cp, CP):
        raise CPInputError(f"{what}: cp= must be a cpref.hf.CP, got {type(cp).__name__}")
    if not isinstance(cp, Checked):
        raise CPInputError(f"{what}: cpref.hf.attention was reached without the model-level checks of positions, "
                           "masks and labels; build the model after cpref.hf.register(), with "
                           "attn_implementation='cpref' (the name register() returns)")  # fmt: skip
    if query.shape[0] != 1:
        raise CPInputError(f"{what}: cpref runs one packed sequence (batch size 1), got batch size {query.shape[0]}; "
                           "pack the documents into one sequence with cpref.hf.shard_batch")  # fmt: skip
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
        raise CPInputError(f"{what}: an attention mask of shape {tuple(attention_mask.shape)} reached the layer: "
                           "cpref's masks are the sharding's documents and padding; pass the padding to "
                           "cpref.hf.shard_batch, and call the model without attention_mask")  # fmt: skip


def kind_of(module: torch.nn.Module) -> str:
    """The layer's kind: `config.layer_types[layer_idx]`, else `"full_attention"`."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = list(getattr(config, "layer_types", None) or [])
    return kinds[index] if index is not None and 0 <= index < len(kinds) else "full_attention"


def chunk_of(module: torch.nn.Module) -> int | None:
    """The layer's chunk size if its kind is `chunked_attention` (Llama 4: `config.layer_types[layer_idx]`, chunks
    of `config.attention_chunk_size` positions), else None."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = list(getattr(config, "layer_types", None) or [])
    if index is None or not 0 <= index < len(kinds) or kinds[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


@torch.compiler.disable(reason=EAGER)
def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """`transformers`' attention signature over cpref: `query (1, Hq, T_l, D)`, `key`/`value (1, Hkv, T_l, X)`
    of this rank's shard -> `(attn_output (1, T_l, Hq, Dv), None)` (no attention weights)."""
    _refuse(module, query, key, attention_mask, dropout, kwargs)
    cp, window = kwargs["cp"], kwargs.get("sliding_window")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T_l, H, X) each
    scale = None if scaling is None else float(scaling)
    variants = dict(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    if cp.mask is not None:  # the model's own mask, or CP(mask=): one per layer kind (resolved by the guard)
        out = cp_attention(q, k, v, cp.sharding, comm=cp.comm, mode=cp.mode, mask=cp.mask[kind_of(module)],
                           softmax_scale=scale, **variants, **cp.options)  # fmt: skip
        return out[None], None  # (1, T_l, Hq, Dv)
    causal = bool(getattr(module, "is_causal", True))
    if window is not None and not causal:
        raise CPInputError(f"{type(module).__name__}: a sliding window without a causal mask (sliding_window={window}) "
                           "is not supported: its convention differs between models")  # fmt: skip
    window = NO_WINDOW if window is None else (int(window) - 1, 0)  # W keys a query sees, itself included
    out = cp_attention(q, k, v, cp.sharding, comm=cp.comm, mode=cp.mode, causal=causal, window=window,
                       softmax_scale=scale, chunk=chunk_of(module), **variants, **cp.options)  # fmt: skip
    return out[None], None  # (1, T_l, Hq, Dv)
