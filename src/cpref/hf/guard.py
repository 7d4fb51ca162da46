r"""The model-level checks of every forward under CP: positions, masks, labels, on every rank alike.

A Hugging Face model's forward does per-token work before and after its attention layers, and
some of it reads what only the whole sequence defines: position ids (transformers numbers a
shard `0 .. T_l - 1` when none are passed), a padding mask, labels that the model shifts itself.
Under CP each rank holds a shard, so that work would be silently wrong. A forward pre-hook,
installed on every model built with cpref's name ([`cpref.hf.admit`][cpref.hf.admit]), makes
it right or refuses, before the model runs:

1. **Inputs.** The layers cpref does not run are refused at the first forward
   ([`cpref.hf.admit`][cpref.hf.admit]); the call's arguments go by name (no extra positional
   ones); one packed sequence (batch size 1) of exactly this rank's `T / P` tokens; no
   `logits_to_keep` (it keeps the shard's last tokens), no image or audio inputs (but Gemma 3's and
   PaliGemma's `pixel_values`: [`cpref.hf.masks`][cpref.hf.masks]), no `softcap=`
   or `s_aux=` for the layers; the loss arguments are this rank's integer labels, of a causal LM,
   not already shifted ([`cpref.hf.labels`][cpref.hf.labels]).
2. **Positions.** Missing `position_ids` are filled in from the sharding: every token's
   position in its document (from `padding_idx + 1` for the RoBERTa family, as their
   embeddings count). Given ones must be the sharding's positions of this rank's real tokens,
   up to one start offset shared by every rank (a collator's `position_ids_start`); anything
   else (another rank's, another layout's, `0 .. T_l - 1`) is refused with the fix.
3. **Masks.** A 2-D `attention_mask` is honoured where its padding is the sharding's padding
   (then it is dropped: cpref keeps that padding out of attention already) and refused where
   it marks a real token as padding; the fix is [`cpref.hf.shard_batch`][cpref.hf.batch.shard_batch],
   which makes a padding mask the sharding's padding. A prepared (4-D) mask is refused.
   `transformers`' own packed-sequence signals, `cu_seq_lens_q`/`_k`, must be the sharding's
   boundaries, and are then dropped with `max_length_q`/`_k`. A model that builds a mask of its own
   (Gemma 3, PaliGemma) gets cpref's, built from the whole batch ([`cpref.hf.masks`][cpref.hf.masks]).
4. **Agreement.** The ranks exchange one row of ints (host side where the communicator can,
   as [`cpref.modes.consistency`][cpref.modes.consistency] does): whether each rank's inputs passed, which
   loss arguments it passed, what the layers' own refusals read (`use_cache` as the model takes
   it, training mode, activation checkpointing, autograd, the tokens a given key/value cache
   holds), a digest of its masks and its positions' start. A rank whose inputs failed raises its own error and every
   other rank raises too, naming it; ranks that disagree all raise, naming what differs. Nothing
   else has been communicated. So a layer that refuses (a cache, `use_cache=True` or dropout in
   training) refuses on every rank alike, the same model on each, and no rank waits for
   another in a collective.
5. **Labels.** `labels=` keeps its meaning in `transformers` (the model shifts them): shifted over
   the unsharded batch, inside each row of a `shard_batch` batch (no token predicts the next row's
   first), with `num_items_in_batch` the whole batch's loss tokens, so that the
   model's `loss` on a rank is its share of the batch's mean ([`cpref.hf.labels`][cpref.hf.labels],
   which also refuses, in step 1, labels that are already the next tokens).

The gradient of the batch's loss is the **sum** of the ranks' gradients (every rank holds a
replica of the parameters): all-reduce them over the CP group with a sum, as
[`cpref.train.training`][cpref.train.training] does.

Under `torch.compile` the hook is a graph break (`torch.compiler.disable`): the checks run
eagerly before the model's compiled code, and a new batch's `CP` and sharding compile nothing
new (traced, the checks' host code and exchange made dynamo compile every batch anew).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from cpref.base.errors import CPInputError, PeerInputError
from cpref.batch.sharding import Sharding
from cpref.hf.admit import check_bidirectional, check_config, check_modules
from cpref.hf.labels import check_labels, loss_arguments
from cpref.hf.layer import CP, NAMES, OWN_MASKS, Checked
from cpref.hf.masks import IMAGE_RULES, digest, image_features, prepare, rule
from cpref.modes.consistency import exchange

__all__ = ["guard", "LOSS_KEYS", "MULTIMODAL", "ROW"]

LOSS_KEYS = ("labels", "shift_labels", "num_items_in_batch")  # the loss arguments the ranks must pass alike
MULTIMODAL = ("pixel_values", "pixel_values_videos", "image_embeds", "input_features", "input_values", "mm_encoder_outputs")
FIRST_POSITION = {"paligemma": 1}  # models that number positions from 1 when given none (PaliGemma)
LAYER_ONLY = {"softcap": "logit soft-capping", "s_aux": "attention sinks"}  # what a layer gives itself, from its config
# step 4's row after "inputs valid": what the ranks must pass alike (the layers' refusals read the middle ones)
ROW = (*LOSS_KEYS, "use_cache", "training", "activation checkpointing", "autograd", "cached tokens", "the attention masks",
       "the position_ids' start")  # fmt: skip
EAGER = ("cpref.hf's model-level checks run eagerly under torch.compile (host checks and one exchange across "
         "ranks, once a forward, before the model's compiled code)")  # dynamo's graph-break reason


def _check_is_causal(model: torch.nn.Module, given: Any, what: str) -> None:
    """`is_causal=` passed to the model: `transformers`' SDPA lets it override each layer's own; cpref's layers read
    their own `is_causal`, so a value that is not every layer's is refused rather than ignored."""
    if given is None:
        return
    own = sorted({bool(m.is_causal) for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)})
    if own != [bool(given)]:
        raise CPInputError(f"{what}: is_causal={given!r} differs from its layers' own (is_causal {own}), which cpref "
                           "attends with; call the model without is_causal=, or build it with the layers you mean")  # fmt: skip


@torch.compiler.disable(reason=EAGER)
def guard(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The forward pre-hook (`with_kwargs=True`): the module docstring's five steps; returns the call's arguments."""
    if model.config._attn_implementation not in NAMES:
        return None  # set_attn_implementation chose another implementation since
    cp = kwargs.get("cp")
    if isinstance(cp, Checked):
        return None  # an outer model (the causal LM around this base model) checked this forward
    what = type(model).__name__
    if cp is None:
        raise CPInputError(f"{what}: attn_implementation='cpref' needs the CP arguments of this forward: call "
                           "model(..., cp=cpref.hf.CP(comm, sharding, mode=...))")  # fmt: skip
    if not isinstance(cp, CP):
        raise CPInputError(f"{what}: cp= must be a cpref.hf.CP, got {type(cp).__name__}")
    call, problem, offset, masks, images = dict(kwargs), None, -1, None, None
    try:
        # 1-3) the model's layers (once a model), then this rank's own inputs, and the model's own masks (cpref.hf.masks)
        check_config(model.config, what)
        check_bidirectional(model.config, what)
        start = _scan(model)
        call, accepts_positions = _bind(model, args, kwargs)
        _check_inputs(model, call, cp.sharding, cp.comm.rank, what)
        offset = _positions(call, cp.sharding, cp.comm.rank, start, accepts_positions, _device(call), what)
        _check_mask(call, cp.sharding, cp.comm.rank, what)
        masks, images = prepare(model, call, cp, what)
    except CPInputError as err:
        problem = err
    # 4) every rank's verdict, the arguments that decide what is communicated next and what the layers refuse
    _agree(cp, what, problem, _row(model, call, offset, digest(masks)), _device(call))
    # 5) labels over the unsharded batch; the images of this rank's image tokens
    loss_arguments(model, call, cp)
    if images is not None:
        call["mm_encoder_outputs"] = image_features(model, call.pop("pixel_values"), images, what)
    if rule(model.config) is not None:  # transformers' masks of the shard are not used (cpref.hf.layer.mask)
        for config in (model.config, model.config.get_text_config()):
            OWN_MASKS[id(config)] = config
    call["cp"] = Checked(cp.comm, cp.sharding, cp.mode, cp.options, masks)
    return (), call


def _scan(model: torch.nn.Module) -> int:
    """Refuse the layers cpref does not run (once a model); the first position of a document in its embeddings."""
    start = getattr(model, "_cpref_start", None)
    if start is None:
        check_modules(model)
        starts = [m.padding_idx + 1 for m in model.modules()
                  if hasattr(type(m), "create_position_ids_from_input_ids") and isinstance(getattr(m, "padding_idx", None), int)]  # fmt: skip
        start = starts[0] if starts else FIRST_POSITION.get(getattr(model.config, "model_type", None), 0)
        model._cpref_start = start
    return start


def _bind(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[dict[str, Any], bool]:
    """The forward's arguments by name, and whether it takes `position_ids`."""
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:
        raise CPInputError(f"{type(model).__name__}: the call does not match its forward: {err}") from None
    call: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            call[name] = value
        elif value:
            raise CPInputError(f"{type(model).__name__}: pass the forward's arguments by name under CP, got "
                               f"{len(value)} extra positional ones")  # fmt: skip
    takes = "position_ids" in sig.parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return call, takes


def _device(call: dict) -> torch.device:
    x = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _check_inputs(model: torch.nn.Module, call: dict, s: Sharding, rank: int, what: str) -> None:
    """Step 1: the tokens, what the model or its layers would read wrongly, and the loss arguments."""
    x = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise CPInputError(f"{what}: input_ids (1, T_l) or inputs_embeds (1, T_l, hidden) are needed, got {got}")
    if x.shape[0] != 1:
        raise CPInputError(f"{what}: cpref runs one packed sequence (batch size 1), got batch size {x.shape[0]}; pack "
                           "the batch with cpref.hf.shard_batch(batch, cp_size=P, rank=r)")  # fmt: skip
    if x.shape[1] != s.local_tokens:
        raise CPInputError(f"{what}: rank {rank} was given {x.shape[1]} tokens but the sharding gives every rank "
                           f"{s.local_tokens}; pass this rank's shard (cpref.hf.shard_batch(...)['tokens'])")  # fmt: skip
    images = IMAGE_RULES.get(getattr(model.config, "model_type", None)) is not None  # Gemma 3, PaliGemma: cpref.hf.masks
    for key in MULTIMODAL:
        if call.get(key) is not None and not (images and key == "pixel_values"):
            raise CPInputError(f"{what}: {key}= is not supported under CP: cpref.hf runs text models, and the images "
                               "of Gemma 3 and PaliGemma as pixel_values")  # fmt: skip
    for key, what_it_is in LAYER_ONLY.items():
        if call.get(key) is not None:
            raise CPInputError(f"{what}: {what_it_is} ({key}=) passed to the model would reach every layer, also those "
                               "whose own attention has none (a layer that has it gives its own, from the config: "
                               "attn_logit_softcapping, a sinks parameter); call the model without it")  # fmt: skip
    _check_is_causal(model, call.get("is_causal"), what)
    keep = call.get("logits_to_keep")
    if isinstance(keep, torch.Tensor) or (keep is not None and keep != 0):
        raise CPInputError(f"{what}: logits_to_keep={keep!r} keeps the last tokens of this rank's shard, not of the "
                           "sequence; call the model without it under CP")  # fmt: skip
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        given = call.pop(key, None)
        got = tuple(int(v) for v in (given.tolist() if isinstance(given, torch.Tensor) else given or ()))
        if given is not None and got not in (s.cu_seqlens, s.cu_seqlens_padded):
            raise CPInputError(f"{what}: {key}={list(got)[:8]} are not the batch's document boundaries "
                               f"{list(s.cu_seqlens)[:8]} (the sharding's); pass the batch through cpref.hf.shard_batch")  # fmt: skip
    for key in ("max_length_q", "max_length_k"):
        call.pop(key, None)  # derived from the boundaries
    check_labels(model, call, s, rank, what)


def _real(s: Sharding, rank: int) -> torch.Tensor:
    """Which of rank `rank`'s tokens are real (not the sharding's padding): bool `(T / P,)`."""
    return s.plan(("hf_real", rank), lambda: s.shard(s.pad(torch.ones(s.cu_seqlens[-1], dtype=torch.bool), value=False), rank))


def _positions(call: dict, s: Sharding, rank: int, start: int, takes: bool, device: torch.device, what: str) -> int:
    """Step 2: fill in or check `position_ids`; returns their start offset (-1 on a rank without real tokens)."""
    want = s.positions(rank)  # (T_l,)
    pos = call.get("position_ids")
    if pos is None:
        if not takes:
            raise CPInputError(f"{what}.forward takes no position_ids, so it numbers each shard from 0; it cannot run under CP")
        call["position_ids"] = (want + start).to(device)[None]  # (1, T_l)
        return start
    if not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.numel() != s.local_tokens or (
        pos.dim() == 2 and pos.shape[0] != 1) or pos.dim() > 2:  # fmt: skip
        got = f"{tuple(pos.shape)} {pos.dtype}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise CPInputError(f"{what}: position_ids must be this rank's {s.local_tokens} integer positions (1, T_l), got "
                           f"{got}; pass batch['position_ids'] of cpref.hf.shard_batch, or none")  # fmt: skip
    real = _real(s, rank).to(pos.device)
    gap = (pos.reshape(-1) - want.to(pos.device))[real]  # (real tokens,) the offset of every real token
    if gap.numel() == 0:
        return -1
    lo, hi = torch.stack([gap.min(), gap.max()]).tolist()
    if lo != hi or lo < 0:
        raise CPInputError(_wrong_positions(pos.reshape(-1).cpu(), s, rank, what))
    return lo


def _wrong_positions(pos: torch.Tensor, s: Sharding, rank: int, what: str) -> str:
    """Why `pos` are not rank `rank`'s positions (the error path only)."""
    want = s.positions(rank)
    first = int((pos != want).nonzero()[0, 0])
    if torch.equal(pos, torch.arange(pos.numel())):
        why = f"they count 0 .. {pos.numel() - 1} over the shard (transformers' numbering of a shard without CP)"
    else:
        other = [r for r in range(s.cp_size) if r != rank and torch.equal(pos, s.positions(r))]
        why = f"they are rank {other[0]}'s positions" if other else "they are not this rank's positions in its documents"
    return (f"{what}: position_ids of rank {rank} do not follow the batch's sharding ({s!r}): {why}; at shard token "
            f"{first} got {int(pos[first])}, expected {int(want[first])}. Pass batch['position_ids'] of "
            "cpref.hf.shard_batch (the sharding's positions(rank)), or omit them and cpref fills them in")  # fmt: skip


def _check_mask(call: dict, s: Sharding, rank: int, what: str) -> None:
    """Step 3: honour (drop) a padding mask that is the sharding's padding, else refuse."""
    mask = call.get("attention_mask")
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() > 2 or mask.numel() != s.local_tokens:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise CPInputError(f"{what}: attention_mask {got} is not a padding mask of this rank's {s.local_tokens} tokens "
                           "(1, T_l): a prepared or custom mask is not supported; cpref's masks are the sharding's "
                           "documents and padding, causal or not, with each layer's window")  # fmt: skip
    flat = mask.reshape(-1)
    padded = flat == 0
    if not (padded | (flat == 1)).all():
        raise CPInputError(f"{what}: attention_mask must hold 1 (token) and 0 (padding) only")
    wrong = padded & _real(s, rank).to(flat.device)
    if wrong.any():
        raise CPInputError(f"{what}: attention_mask marks {int(wrong.sum())} real tokens of rank {rank}'s shard as "
                           f"padding (the first at shard token {int(wrong.nonzero()[0, 0])}), but padding under CP is "
                           "the sharding's: pass the padded batch and its attention_mask to cpref.hf.shard_batch, "
                           "which makes them the sharding's padding, and call the model without attention_mask")  # fmt: skip
    call["attention_mask"] = None  # its padding is the sharding's: kept out of attention already


def _row(model: torch.nn.Module, call: dict, offset: int, masks: int) -> list[int]:
    """Step 4's row, in the order of `ROW`: what the ranks must pass alike."""
    use_cache = call.get("use_cache")
    use_cache = getattr(model.config, "use_cache", None) if use_cache is None else use_cache  # as the model takes it
    cache = call.get("cache") if call.get("cache") is not None else call.get("past_key_values")  # the old name too
    held = -1 if cache is None else int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else -2
    flags = (model.training, getattr(model, "is_activation_checkpointing", False), torch.is_grad_enabled())
    return [*(int(call.get(k) is not None) for k in LOSS_KEYS), -1 if use_cache is None else int(bool(use_cache)),
            *(int(bool(f)) for f in flags), held, masks, offset]  # fmt: skip


def _show(name: str, code: int) -> str:
    if name in LOSS_KEYS:
        return "given" if code else "none"
    if name == "use_cache":
        return repr((None, False, True)[code + 1])
    if name == "the attention masks":
        return "none" if code == 0 else f"digest {code:#x}"
    if name == "cached tokens":
        return {-1: "no cache", -2: "a cache"}.get(code, str(code))
    return str(code) if name == ROW[-1] else repr(bool(code))


def _agree(cp: CP, what: str, problem: CPInputError | None, row: list[int], device: torch.device) -> None:
    """Step 4: every rank raises alike (see the module docstring)."""
    comm = cp.comm
    if comm.size > 1:
        rows, who = exchange(comm, [int(problem is None), *row], device)
        failed = [label for label, r in zip(who, rows) if not r[0]]
        if failed and problem is None:
            named = "a rank" if who[0] == "lowest code" else ", ".join(failed)
            raise PeerInputError(f"{what}: the inputs of {named} of the CP group failed the model-level checks (that "
                                 f"rank's own error names the value and the fix); rank {comm.rank} raises too, so that "
                                 "no rank waits in a collective")  # fmt: skip
        if problem is None:
            lines = []
            for i, name in enumerate(ROW, start=1):
                shown = [(label, r[i]) for label, r in zip(who, rows) if name != ROW[-1] or r[i] >= 0]  # -1: no real token
                if len({code for _, code in shown}) > 1:
                    lines.append(f"{name}: " + "; ".join(f"{label}: {_show(name, code)}" for label, code in shown))
            if lines:
                raise CPInputError(f"{what}: the ranks of the CP group pass different arguments to the model, which "
                                   "would give wrong results or collectives that do not match:\n  " + "\n  ".join(lines)
                                   + "\npass the same loss arguments, use_cache and cache, training mode, activation "
                                   "checkpointing and autograd, and positions of the same numbering on every rank")  # fmt: skip
    if problem is not None:
        raise problem
