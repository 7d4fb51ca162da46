r"""The masks Hugging Face models build of their own, as `cpref.Mask`s over the whole batch: Gemma 3 and PaliGemma.

Most `transformers` models attend causally inside each document, with each layer's window, and
cpref's layers do that from the sharding alone. Three build another mask, per layer kind
(`full_attention`, `sliding_attention`), from the config and from `token_type_ids` (`transformers`
5.24, `masking_utils.py`, `models/gemma3`, `models/paligemma`); with `W` the config's
`sliding_window`, in each document, query `x` sees key `y` when:

| model | `full_attention` | `sliding_attention` |
| --- | --- | --- |
| Gemma 3 text, `use_bidirectional_attention=True` | always (bidirectional) | $|x - y| < W$ (the config stores `W = w // 2 + 1` of the `w` given) |
| Gemma 3 with `token_type_ids` (images: 1) | $y \le x$, or both in one image | $x - W < y$ and ($y \le x$, or both in one image) |
| PaliGemma with `token_type_ids` (prefix: 0) | $y \le x$, or both in the prefix | the same, windowed where $y \le x$ only (PaliGemma 2) |

An image is a run of consecutive tokens of type 1 (two images with no other token between them are
one run, as `transformers` counts them); PaliGemma's prefix is every token of type 0 of the
document. Each is written as slices ([`band`][cpref.hf.masks.band]: the rows' keys from `left`
before to `right` after, cut to a range) and their union is the layer kind's `cpref.Mask`
([`model_masks`][cpref.hf.masks.model_masks]), built from the **global** batch, the same on
every rank. Models with `use_bidirectional_attention` other than these (Gemma, Gemma 2 alone,
where `transformers`' eager attention is causal and its SDPA bidirectional) are refused when
built ([`cpref.hf.admit`][cpref.hf.admit]).

**Images under CP** ([`image_features`][cpref.hf.masks.image_features]). `transformers` runs the
vision tower on every image and writes image `i`'s `n` features, in order, over the image
tokens (`input_ids == image_token_id`) `i n .. (i + 1) n - 1` of the batch. A rank holds some of
those tokens: it runs the vision tower on the images that have a token on its shard (whole
images: their features are pooled over the image) and hands the model only its tokens'
features (`mm_encoder_outputs`), so `transformers` writes them over its tokens as it would.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch

from cpref.base.errors import CPInputError
from cpref.batch.mask import Mask
from cpref.batch.sharding import Sharding

__all__ = ["band", "rule", "model_masks", "prepare", "image_plan", "image_features", "resolve", "digest", "IMAGE_RULES"]

Slice = tuple[int, int, int, int, str]
IMAGE_RULES = {"gemma3": "images", "paligemma": "prefix"}  # composite model_type -> the rule its token_type_ids follow


def band(rows: tuple[int, int], keys: tuple[int, int], left: int | None, right: int | None) -> list[Slice]:
    """Slices in which row `x` of `rows` sees the keys `max(keys[0], x - left) .. min(keys[1] - 1, x + right)`.

    `None` reaches the end of `keys`. Rows split where the bounds stop being cut: cut on both sides a `full`
    slice, on the left only a `causal` one (the diagonal `x + right` is its bottom-right one), on the right only
    `inv_causal` (the diagonal `x - left` through its top-left corner), on neither `bi_causal`.

    Examples:
        >>> band((0, 6), (0, 6), 1, 1)  # a symmetric band: every row sees its neighbours and itself
        [(0, 2, 0, 3, 'causal'), (2, 4, 1, 5, 'bi_causal'), (4, 6, 3, 6, 'inv_causal')]
    """
    (r0, r1), (k0, k1) = rows, keys
    # the left bound is cut for x <= k0 + left (a first run of rows), the right one for x >= k1 - 1 - right (a last)
    cuts = {r0, r1}
    if left is not None:
        cuts.add(min(max(k0 + left + 1, r0), r1))
    if right is not None:
        cuts.add(min(max(k1 - 1 - right, r0), r1))
    edges, out = sorted(cuts), []
    for a, b in zip(edges, edges[1:]):
        lo_cut = left is None or a <= k0 + left
        hi_cut = right is None or a >= k1 - 1 - right
        lo, hi = (k0 if lo_cut else a - left), (k1 if hi_cut else b + right)  # the slice's key range
        kind = {(True, True): "full", (True, False): "causal", (False, True): "inv_causal"}.get((lo_cut, hi_cut), "bi_causal")
        out.append((a, b, lo, hi, kind))
    return out


def rule(config: Any) -> str | None:
    """Which of the module docstring's masks a model of `config` builds: `"bidirectional"`, `"images"`, `"prefix"`,
    or None (causal documents, each layer's window: cpref's layers do it without a mask)."""
    kind = IMAGE_RULES.get(getattr(config, "model_type", None))
    if kind is not None:
        return kind
    if getattr(config, "model_type", None) == "gemma3_text" and getattr(config, "use_bidirectional_attention", False):
        return "bidirectional"
    return None


def _runs(flags: torch.Tensor, cu: list[int]) -> list[tuple[int, int]]:
    """The runs `[a, b)` of True in `flags (T,)`, cut at the documents' boundaries `cu`."""
    edges = torch.diff(torch.nn.functional.pad(flags.to(torch.int8), (1, 1)))  # (T + 1,)
    starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
    out = []
    for a, b in zip(starts, ends):
        cut = [c for c in cu if a < c < b]
        out += list(zip([a, *cut], [*cut, b]))
    return out


def model_masks(config: Any, cu_seqlens: Any, token_type_ids: torch.Tensor | None = None) -> dict[str, Mask] | None:
    """The masks a model of `config` builds (the module docstring's table), one per layer kind, over a batch of
    documents `cu_seqlens` whose tokens have the types `token_type_ids (T,)` (the whole batch's, in stream order).

    Returns None where the model builds causal documents with each layer's window (`rule(config)` is None, or
    Gemma 3 without `token_type_ids`).

    Raises:
        CPInputError: PaliGemma without `token_type_ids`, or `token_type_ids` that are not `(T,)` integers.

    Examples:
        >>> from transformers import Gemma3TextConfig
        >>> config = Gemma3TextConfig(use_bidirectional_attention=True, sliding_window=4, num_hidden_layers=2,
        ...                           layer_types=["sliding_attention", "full_attention"])
        >>> masks = model_masks(config, [0, 4])  # sliding_window 4 -> 4 // 2 + 1 = 3: |x - y| < 3
        >>> masks["full_attention"].slices, masks["sliding_attention"].slices
        (((0, 4, 0, 4, 'full'),), ((0, 2, 0, 4, 'causal'), (2, 4, 0, 4, 'inv_causal')))
    """
    kind = rule(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if kind is None or (kind == "images" and token_type_ids is None):
        return None
    if kind == "prefix" and token_type_ids is None:
        raise CPInputError("PaliGemma under CP needs the batch's token_type_ids (0: the image and prompt prefix, 1: the "
                           "suffix): its mask is built from them; pass them in the batch to cpref.hf.shard_batch")  # fmt: skip
    docs = list(zip(cu, cu[1:]))
    kinds = sorted(set(getattr(text, "layer_types", None) or ["full_attention"]))
    window = getattr(text, "sliding_window", None)
    if kind == "bidirectional":
        half = None if window is None else int(window) - 1  # |x - y| < W
        out = {"full_attention": [(a, b, a, b, "full") for a, b in docs],
               "sliding_attention": [s for a, b in docs for s in band((a, b), (a, b), half, half)]}  # fmt: skip
        return {k: Mask.from_slices(out[k], cu[-1]) for k in kinds}
    types = _types(token_type_ids, cu[-1])
    left = None if window is None else int(window) - 1  # x - W < y: W keys up to the query, itself included
    causal = {"full_attention": [(a, b, a, b, "causal") for a, b in docs],
              "sliding_attention": [s for a, b in docs for s in band((a, b), (a, b), left, 0)]}  # fmt: skip
    extra: dict[str, list[Slice]] = {"full_attention": [], "sliding_attention": []}
    if kind == "images":  # each image sees itself whole; on sliding layers, the window still cuts what is before
        for s, e in _runs(types == 1, cu):
            a = next(d for d, b in docs if d <= s < b)
            extra["full_attention"].append((s, e, s, e, "full"))
            extra["sliding_attention"] += band((s, e), (a, e), left, None)
    else:  # the prefix (type 0) of each document sees itself whole, on every layer kind
        for a, b in docs:
            runs = _runs(types[a:b] == 0, [0, b - a])
            for s, e in runs:
                for ks, ke in runs:
                    for k in extra:
                        extra[k].append((a + s, a + e, a + ks, a + ke, "full"))
    return {k: Mask.from_slices(causal[k] + extra[k], cu[-1]) for k in kinds}


def _types(token_type_ids: Any, total: int) -> torch.Tensor:
    if not isinstance(token_type_ids, torch.Tensor) or token_type_ids.is_floating_point() or \
            tuple(token_type_ids.shape) != (total,):  # fmt: skip
        got = f"{tuple(token_type_ids.shape)} {token_type_ids.dtype}" if isinstance(token_type_ids, torch.Tensor) else type(token_type_ids).__name__
        raise CPInputError(f"token_type_ids must be the batch's {total} integer types (T,) in stream order, got {got}")
    return token_type_ids.cpu().long()


def tokens_per_image(config: Any) -> int:
    """The image tokens of one image: Gemma 3's `mm_tokens_per_image`, PaliGemma's text config `num_image_tokens`."""
    if getattr(config, "model_type", None) == "gemma3":
        return int(config.mm_tokens_per_image)
    return int(config.get_text_config().num_image_tokens)


def image_plan(config: Any, stream: torch.Tensor, s: Sharding, rank: int, n_images: int, what: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Which images rank `rank` needs and where its image tokens' features are: `(images, which, index)`, its
    image tokens `(n,)` in shard order being token `index[i]` of image `images[which[i]]`.

    `stream (T,)` are the batch's token ids (every rank's). Raises `CPInputError` where the batch's image tokens
    are not `n_images` images' worth (`transformers` refuses that too)."""
    n, image = tokens_per_image(config), int(config.image_token_id)
    where = (stream == image).nonzero().flatten()  # (N,) the batch's image tokens, in order
    if where.numel() != n_images * n:
        raise CPInputError(f"{what}: the batch holds {where.numel()} image tokens (id {image}) but pixel_values "
                           f"{n_images} images of {n} tokens each; pass one image per {n} image tokens")  # fmt: skip
    order = torch.full((stream.numel(),), -1, dtype=torch.long)
    order[where] = torch.arange(where.numel())  # (T,) each image token's place among the batch's
    mine = s.shard(s.pad(order, value=-1), rank)  # (T / P,)
    mine = mine[mine >= 0]  # (n_r,) this rank's image tokens, in shard order
    images, which = torch.unique(mine // n, return_inverse=True)
    return images.tolist(), which, mine % n


def image_features(model: torch.nn.Module, pixel_values: torch.Tensor, plan: tuple[list[int], torch.Tensor, torch.Tensor],
                   what: str) -> dict[str, Any]:  # fmt: skip
    """`mm_encoder_outputs` of this rank: the vision tower on the images it needs, the features of its tokens."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    images, which, index = plan
    config = model.config
    if not images:
        hidden = config.get_text_config().hidden_size
        return {"image": BaseModelOutputWithPooling(pooler_output=pixel_values.new_zeros(1, 0, hidden))}
    out = model.get_image_features(pixel_values[images], return_dict=True)
    feats = out.pooler_output  # (images, n, hidden)
    if feats.shape[1] != tokens_per_image(config):
        raise CPInputError(f"{what}: the vision tower gives {feats.shape[1]} features an image, the config "
                           f"{tokens_per_image(config)} image tokens")  # fmt: skip
    return {"image": BaseModelOutputWithPooling(pooler_output=feats[which, index][None])}  # (1, n_r, hidden)


def resolve(given: Mask | Mapping[str, Mask], kinds: list[str], what: str) -> dict[str, Mask]:
    """`CP(mask=)` as one mask per layer kind of the model: a `Mask` for models with full layers only."""
    if isinstance(given, Mask):
        other = sorted(set(kinds) - {"full_attention"})
        if other:
            raise CPInputError(f"{what}: CP(mask=) is one Mask but the model has {', '.join(other)} layers, whose "
                               "window the mask replaces; pass a dict of a Mask per layer kind, "
                               f"{{{', '.join(repr(k) for k in sorted(set(kinds)))}: ...}}")  # fmt: skip
        return {"full_attention": given}
    missing = sorted(set(kinds) - set(given))
    if missing:
        raise CPInputError(f"{what}: CP(mask=) has no mask for the layer kinds {missing}; pass one for every layer kind "
                           f"of the model ({sorted(set(kinds))})")  # fmt: skip
    return dict(given)


def digest(masks: Mapping[str, Mask] | None) -> int:
    """A 56-bit digest of one mask per layer kind (0: none), the same in every process: the ranks compare it."""
    if masks is None:
        return 0
    data = repr(sorted((kind, m.digest) for kind, m in masks.items())).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _shard_of(stream: torch.Tensor, s: Sharding, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s part of a stream `(T,)` of the batch's real tokens, and which of its rows are real."""
    real = s.shard(s.pad(torch.ones(stream.numel(), dtype=torch.bool), value=False), rank)  # (T / P,)
    return s.shard(s.pad(stream.cpu().long(), value=0), rank), real


def prepare(model: torch.nn.Module, call: dict, cp: Any, what: str) -> tuple[dict[str, Mask] | None, Any]:
    """The guard's masks and images of this forward, from this rank's inputs alone (before any communication):
    `(one Mask per layer kind or None, image_plan's plan or None)`."""
    s, rank, config = cp.sharding, cp.comm.rank, model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds, kind = list(getattr(text, "layer_types", None) or ["full_attention"]), rule(config)
    given, types, own = call.get("token_type_ids"), getattr(s, "token_types", None), None
    if kind == "bidirectional":
        own = model_masks(config, s.cu_seqlens)
    elif kind is not None and given is not None and types is not None:
        mine, real = _shard_of(types, s, rank)
        if not isinstance(given, torch.Tensor) or given.numel() != real.numel() or \
                not torch.equal(given.reshape(-1).cpu().long()[real], mine[real]):  # fmt: skip
            raise CPInputError(f"{what}: token_type_ids of rank {rank} are not its shard of the batch's (those "
                               "cpref.hf.shard_batch was given); pass batch['token_type_ids'][None] of shard_batch")  # fmt: skip
        own = model_masks(config, s.cu_seqlens, types)
    elif kind is not None and cp.mask is None and (given is not None or kind == "prefix"):
        raise CPInputError(f"{what}: its mask is built from the whole batch's token_type_ids, which this forward does "
                           "not have: pass the batch with its token_type_ids through cpref.hf.shard_batch (its sharding "
                           "keeps them) and token_type_ids=batch['token_type_ids'][None] to the model, or "
                           "cp=cpref.hf.CP(..., mask=cpref.hf.model_masks(model.config, cu_seqlens, token_type_ids))")  # fmt: skip
    masks = own
    if cp.mask is not None:
        masks = resolve(cp.mask, kinds, what)
        differ = sorted(k for k in own or {} if own[k] != masks.get(k))
        if differ:
            raise CPInputError(f"{what}: CP(mask=) differs from the mask the model builds from this batch on its "
                               f"{', '.join(differ)} layers; leave mask out (cpref builds the model's own), or build it "
                               "with cpref.hf.model_masks over this batch")  # fmt: skip
    plan = None
    if call.get("pixel_values") is not None:
        ids, stream = call.get("input_ids"), getattr(s, "tokens", None)
        if stream is None or not isinstance(ids, torch.Tensor):
            raise CPInputError(f"{what}: pixel_values under CP need the input_ids and the whole batch's token ids, to "
                               "find which images this rank's image tokens belong to: pass the batch through "
                               "cpref.hf.shard_batch and its tokens as input_ids")  # fmt: skip
        mine, real = _shard_of(stream, s, rank)
        if ids.numel() != real.numel() or not torch.equal(ids.reshape(-1).cpu().long()[real], mine[real]):
            raise CPInputError(f"{what}: input_ids of rank {rank} are not its shard of the batch cpref.hf.shard_batch "
                               "was given; pass batch['tokens'][None]")  # fmt: skip
        plan = image_plan(config, stream.cpu(), s, rank, int(call["pixel_values"].shape[0]), what)
    return masks, plan
