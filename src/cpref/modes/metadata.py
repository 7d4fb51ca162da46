"""The MindSpeed RFC's metadata API for KV all-gather CP, over cpref's plan and batch cache.

The RFC names two entry points, and cpref keeps them with its spelling:
[`get_thd_load_balanced_cp_metadata`][cpref.modes.metadata.get_thd_load_balanced_cp_metadata] returns
one rank's load-balanced THD metadata (a read-only mapping with the RFC's keys) from the
document boundaries, and [`clear_cp_metadata_cache`][cpref.modes.metadata.clear_cp_metadata_cache]
empties its LRU cache. What the metadata is, and how it is computed, is the all-gather plan's
page: [Load-balanced metadata][cpref.modes.all_gather_plan]. The cache is cpref's batch cache
([`cpref.batch.cache`][cpref.batch.cache]): capacity 8 batches, keyed by each boundary tensor's identity
and version, and the arguments are validated on every call, cached or not.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from cpref.base.checks import as_bool, as_choice, as_int
from cpref.base.errors import CPInputError
from cpref.batch.cache import CACHE, CacheInfo, cache_info, clear_cache
from cpref.batch.seqlens import CHUNKED_LAYOUTS, LAYOUTS
from cpref.modes.all_gather_plan import build_all_gather_plan

__all__ = [
    "get_thd_load_balanced_cp_metadata",
    "clear_cp_metadata_cache",
    "cache_info",
    "CacheInfo",
    "CACHE_CAPACITY",
    "as_device",
]

CACHE_CAPACITY = CACHE.capacity


def as_device(device: Any) -> torch.device:
    """`device` as a `torch.device` (default CPU), or a clear error."""
    if device is None:
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CPInputError(f"device {device!r} is not a torch device ({exc}); pass e.g. 'cpu' or 'cuda:0'") from None


def get_thd_load_balanced_cp_metadata(
    cu_seqlens: torch.Tensor | Sequence[int],
    cp_size: int,
    rank: int,
    device: torch.device | str | None = None,
    *,
    layout: str = "zigzag",
    causal: bool = True,
    cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
) -> Mapping[str, Any]:
    """Metadata of one rank for KV all-gather CP on a packed THD batch (cached).

    Args:
        cu_seqlens: document boundaries, with a leading 0 (`[0, 8, 24]`) or in MindSpeed's
            ends-only form (`[8, 24]`); a tensor or a sequence of ints. The real boundaries
            when `cu_seqlens_padded` is given, else the padded ones.
        cp_size: the CP group size `P >= 1`.
        rank: this rank, in `[0, P)`.
        device: where `kv_index` and the `cu_seqlens_*` tensors live (default CPU).
        layout: `"zigzag"` (the RFC's symmetric split) or `"contiguous"`.
        causal: causal prefixes (default) or whole documents.
        cu_seqlens_padded: the padded boundaries that define the shards, if there is padding.

    Returns:
        A read-only mapping over the cached plan. Keys on [the plan's page][cpref.modes.all_gather_plan].

    Raises:
        AssertionError: (as `CPInputError`, also a `ValueError`) for invalid boundaries, a
            document length not divisible by the layout's multiple, `cp_size < 1` or a rank
            outside `[0, cp_size)`; checked on every call, cached or not.

    Examples:
        >>> meta = get_thd_load_balanced_cp_metadata([0, 8], cp_size=2, rank=0)
        >>> meta["actual_seq_qlen"], meta["actual_seq_kvlen"], meta["kv_index"].tolist()
        ([2, 4], [2, 10], [0, 1, 0, 1, 4, 5, 6, 7, 2, 3])
    """
    P = as_int("cp_size", cp_size, lo=1)
    rank = as_int("rank", rank, lo=0, hi=P)
    layout, causal, device = as_choice("layout", layout, LAYOUTS), as_bool("causal", causal), as_device(device)
    if layout not in CHUNKED_LAYOUTS:
        raise CPInputError(f"layout {layout!r}: the RFC's metadata indexes per-document chunks, layout 'zigzag' or "
                           f"'contiguous'; for {layout!r} call cpref.attention(..., mode='all_gather') with a "
                           f"cpref.Sharding(..., layout={layout!r})")  # fmt: skip
    entry = CACHE.entry(cu_seqlens, cu_seqlens_padded, ends_only_ok=True)
    key = ("all_gather", P, rank, layout, causal, str(device))  # the mode's key: one plan for both (P > 1)
    plan = entry.plan(key, lambda: build_all_gather_plan(entry.bounds, P, rank, layout, causal, device))
    return plan.as_mapping(P)


def clear_cp_metadata_cache() -> None:
    """Empty the batch cache (metadata of every mode, validated boundaries) and reset its statistics."""
    clear_cache()
