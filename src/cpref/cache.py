"""A small LRU for values derived from `cu_seqlens`, keyed the way the MindSpeed RFC asks.

Every transformer layer calls attention with the same `cu_seqlens`; whatever is derived from
it (host ints, metadata, indices) should be computed once per step, not once per layer,
and on an accelerator a host copy of the tensor would also stall the stream every layer.

A tensor key is its **identity and version**: `tensor._version` moves on every in-place
change, so editing `cu_seqlens` in place invalidates its entries. An entry keeps a reference
to its tensor, so a freed tensor's `id` cannot be reused for a stale hit. A list or tuple of
ints is keyed by value. The lock makes the cache safe for the simulated cluster, whose ranks
are threads of one process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, NamedTuple, Sequence, TypeVar

import torch

__all__ = ["IdentityLRU", "CacheInfo"]

V = TypeVar("V")


class CacheInfo(NamedTuple):
    """Statistics of a cache."""

    hits: int
    misses: int
    size: int
    capacity: int


class IdentityLRU(Generic[V]):
    """Thread-safe LRU of values derived from a tensor (by identity + version) or a sequence (by value).

    Args:
        capacity: the most entries kept; the least recently used goes first.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[tuple, tuple[Any, V]] = OrderedDict()
        self.hits = self.misses = 0
        self.lock = threading.Lock()

    def get_or_build(self, source: torch.Tensor | Sequence[int], extra: tuple[Hashable, ...], build: Callable[[], V]) -> V:
        """The cached value for `(source, extra)`, or `build()`'s, stored for next time."""
        if isinstance(source, torch.Tensor):
            owner: Any = source
            key: tuple = ("tensor", id(source), source._version, *extra)
        else:
            owner, key = None, ("value", tuple(int(x) for x in source), *extra)
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None and entry[0] is owner:
                self.entries.move_to_end(key)
                self.hits += 1
                return entry[1]
            self.misses += 1
        value = build()  # outside the lock: a miss on one rank does not stall the others
        with self.lock:
            self.entries[key] = (owner, value)
            self.entries.move_to_end(key)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
        return value

    def info(self) -> CacheInfo:
        """Hits, misses, current size and capacity."""
        with self.lock:
            return CacheInfo(self.hits, self.misses, len(self.entries), self.capacity)

    def clear(self) -> None:
        """Drop every entry and reset the statistics."""
        with self.lock:
            self.entries.clear()
            self.hits = self.misses = 0
