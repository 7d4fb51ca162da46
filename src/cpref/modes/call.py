"""One validated `cpref.attention` call: what every CP mode receives besides q, k, v and comm.

`cpref.api` checks every argument before any communication and packs the result into a
frozen [`CPCall`][cpref.modes.call.CPCall]; a mode reads its fields and asks the batch cache for
its per-rank plan (`call.plan(key, build)`), so no mode re-validates or re-parses anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, TypeVar

import torch

from cpref.batch.cache import BatchEntry
from cpref.batch.mask import Mask
from cpref.batch.seqlens import Boundaries
from cpref.batch.sharding import Sharding
from cpref.kernels.contract import AttentionKernel

__all__ = ["CPCall", "records_backward"]

V = TypeVar("V")


@dataclass(frozen=True)
class CPCall:
    """Everything validated about one call (see `cpref.api.attention` for the meaning).

    Attributes:
        sharding: how the batch is sharded (boundaries, `P`, layout; see `cpref.Sharding`).
        rank: this rank.
        causal: causal attention inside each document.
        window: `(left, right)` sliding window, validated (`right = 0` under causal; `(-1, -1)`: none).
        scale: the softmax scale.
        kernel: the attention kernel.
        heads: `(Hq, Hkv, D, Dv)` of this rank's shards.
        dtype: the dtype of q, k and v.
        device: their device.
        options: the mode's own options (e.g. `a2a_size`), validated.
        deterministic: the backward bit for bit repeatable (`cpref.base.determinism`); the kernel declares it can.
        softcap: logit soft-capping's `c` (None: none); `kernel` is then the kernel with every call capped
            (`cpref.kernels.contract.SoftCapped`).
        chunk: chunked attention's `C`: a query sees only the keys of its own chunk of `C` positions (None: none).
        sinks: `(Hq,)` learnable sink logits, added once to every row's softmax (None: none).
        mask: which keys each query sees, as slices (`cpref.batch.mask`), in place of `causal`, `window` and
            `chunk` (None: those).
        backward: whether the call records a backward on this rank ([`records_backward`][cpref.modes.call.records_backward]
            of q, k, v and the sinks); the ranks compare it, as a rank without one would leave the others waiting in
            the backward's collectives.
    """

    sharding: Sharding
    rank: int
    causal: bool
    window: tuple[int, int]
    scale: float
    kernel: AttentionKernel
    heads: tuple[int, int, int, int]
    dtype: torch.dtype
    device: torch.device
    options: Mapping[str, Any] = field(default_factory=dict)
    deterministic: bool = False
    softcap: float | None = None
    chunk: int | None = None
    sinks: torch.Tensor | None = None
    backward: bool = False
    mask: Mask | None = None

    @property
    def variants(self) -> frozenset[str]:
        """The attention variants of the call: `"softcap"`, `"chunk"`, `"sinks"`, `"mask"`."""
        given = {"softcap": self.softcap, "chunk": self.chunk, "sinks": self.sinks, "mask": self.mask}
        return frozenset(name for name, value in given.items() if value is not None)

    @property
    def P(self) -> int:
        """CP size."""
        return self.sharding.cp_size

    @property
    def layout(self) -> str:
        """`"zigzag"`, `"contiguous"`, `"stream"` or `"balanced"`."""
        return self.sharding.layout

    @property
    def entry(self) -> BatchEntry:
        """The batch's entry in the cache (boundaries and plans)."""
        return self.sharding.entry

    @property
    def bounds(self) -> Boundaries:
        """The batch's real and padded boundaries."""
        return self.entry.bounds

    @property
    def local_tokens(self) -> int:
        """`T / P`: tokens of every rank's shard."""
        return self.sharding.local_tokens

    def plan(self, key: Hashable, build: Callable[[], V]) -> V:
        """The cached plan `key` of this batch (built once by `build()`)."""
        return self.entry.plan(key, build)


def records_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on `tensors` records a backward, as `torch.autograd.Function` decides it: grad mode is on
    (not under `torch.no_grad()` or `torch.inference_mode()`) and one of them requires grad (`None`, sinks not
    given, is skipped).

    Examples:
        >>> x = torch.ones(2, requires_grad=True)
        >>> records_backward(x, torch.ones(2), None)
        True
        >>> with torch.no_grad():
        ...     records_backward(x)
        False
    """
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
