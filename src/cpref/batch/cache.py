"""The batch cache: everything derived from `cu_seqlens`, computed once per step, not per layer.

Every transformer layer calls attention with the same boundaries; what is derived from them
(their validated host copy, each mode's per-rank metadata, the kernels' block lists) should
be computed once per training step. On an accelerator, reading `cu_seqlens` back to the
host also stalls the stream, so the cache is what makes every layer after the first free of
host-device synchronisation.

## Keys

A cache entry is one **batch**: a pair of boundary sources (`cu_seqlens`,
`cu_seqlens_padded`). A tensor source is keyed by its **identity and version**
(`tensor._version` moves on every in-place change through the tensor, so such an edit
invalidates the entry; the entry keeps a reference to the tensor, so a freed tensor's `id`
cannot be reused for a stale hit). A list or tuple of ints is keyed by value.

A tensor made under `torch.inference_mode()` (evaluation) has no version counter; it is keyed
by its identity alone. Edits that bypass the version counter (writing through `.data`, through
a NumPy array from `.numpy()`, or any in-place edit of an inference tensor) are caught for
**CPU tensors**: an entry keeps a copy of their contents and
compares it on every hit (a cheap host comparison). For **device tensors** such an edit is
undetectable without a device-to-host copy, which is what the cache exists to avoid: give
each batch a new tensor (or a list), never edit one behind the version counter.

## Entries

An entry holds the batch's [`Boundaries`][cpref.batch.seqlens.Boundaries] and the *plans* derived
from it, keyed by whatever they depend on (mode, `P`, rank, layout, causality, device): on
the simulated cluster, the `P` rank threads share one entry per batch, so the capacity
(8 batches, as the MindSpeed RFC specifies) does not shrink with `P`. Plans are immutable
(frozen dataclasses), since the rank threads share them. Nothing the ranks' comparison of
their arguments decides lives here ([`cpref.modes.consistency`][cpref.modes.consistency]): emptying the
cache on one rank changes no rank's communication.

The cache is thread-safe: lookups and builds happen under one re-entrant lock, so ranks that
race for the same batch build it once. No collective is ever run under the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, NamedTuple, TypeVar

import torch

from cpref.batch.seqlens import Boundaries

__all__ = ["BatchCache", "BatchEntry", "CacheInfo", "CACHE", "cache_info", "clear_cache"]

V = TypeVar("V")


class CacheInfo(NamedTuple):
    """Statistics of the batch cache.

    Attributes:
        hits: plan lookups served from the cache.
        misses: plan lookups that had to build the plan.
        size: batches held.
        capacity: the most batches held; the least recently used goes first.
    """

    hits: int
    misses: int
    size: int
    capacity: int


class BatchEntry:
    """One batch: its boundaries and the plans derived from them.

    Attributes:
        bounds: the validated boundaries.
    """

    def __init__(self, cache: "BatchCache", bounds: Boundaries, sources: tuple[Any, ...]) -> None:
        self.bounds = bounds
        self._cache = cache
        self._sources = sources  # keeps tensor ids alive: no reuse for a stale hit
        # contents of CPU tensor sources, compared on every hit (edits behind the version counter)
        self._snapshots = tuple(s.clone() if _is_host_tensor(s) else None for s in sources)
        self._plans: dict[Hashable, Any] = {}

    def plan(self, key: Hashable, build: Callable[[], V]) -> V:
        """The plan for `key`, built by `build()` on first use (under the cache's lock)."""
        with self._cache.lock:
            if key in self._plans:
                self._cache.hits += 1
                return self._plans[key]
            self._cache.misses += 1
            value = self._plans[key] = build()
            return value

    def _still_valid(self) -> bool:
        return all(snap is None or torch.equal(src, snap) for src, snap in zip(self._sources, self._snapshots))


def _is_host_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu"


def _source_key(source: Any) -> tuple:
    if isinstance(source, torch.Tensor):
        if source.is_inference():  # made under torch.inference_mode: it has no version counter
            return ("inference", id(source))
        return ("tensor", id(source), source._version)
    if source is None:
        return ("none",)
    try:
        values = tuple(source)  # validated when the entry is built; with their types, as 1.0 == 1 == True:
        key = ("value", values, tuple(map(type, values)))  # [0.0, 8.0] must not reuse [0, 8]'s validated entry
        hash(key)
        return key
    except TypeError:
        return ("object", id(source))  # not a flat sequence: Boundaries.parse names the problem


class BatchCache:
    """A thread-safe LRU of batches (see the module docstring).

    Args:
        capacity: the most batches kept.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lock = threading.RLock()
        self.entries: OrderedDict[tuple, BatchEntry] = OrderedDict()
        self.hits = self.misses = 0

    def entry(self, cu_seqlens: Any, cu_seqlens_padded: Any = None, *, ends_only_ok: bool = False,
              mask: Any = None) -> BatchEntry:  # fmt: skip
        """The entry of this batch (balanced by `mask`'s work where one is given), validating and building it on
        first use.

        Raises:
            CPInputError: if the boundaries are invalid (see `Boundaries.parse`), on every call.
        """
        key = (_source_key(cu_seqlens), _source_key(cu_seqlens_padded), ends_only_ok, mask)
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None and entry._still_valid():
                self.entries.move_to_end(key)
                return entry
            bounds = Boundaries.parse(cu_seqlens, cu_seqlens_padded, ends_only_ok=ends_only_ok, mask=mask)
            entry = self.entries[key] = BatchEntry(self, bounds, (cu_seqlens, cu_seqlens_padded))
            self.entries.move_to_end(key)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
            return entry

    def info(self) -> CacheInfo:
        """Hits, misses, current size and capacity."""
        with self.lock:
            return CacheInfo(self.hits, self.misses, len(self.entries), self.capacity)

    def clear(self) -> None:
        """Drop every entry and reset the statistics."""
        with self.lock:
            self.entries.clear()
            self.hits = self.misses = 0


CACHE = BatchCache(8)


def cache_info() -> CacheInfo:
    """Hits, misses, size and capacity of the batch cache (metadata of every mode)."""
    return CACHE.info()


def clear_cache() -> None:
    """Empty the batch cache (boundaries, metadata of every mode) and reset its statistics."""
    CACHE.clear()
