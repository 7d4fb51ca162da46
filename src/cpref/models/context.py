"""`CPContext`: everything `cpref.attention` needs besides q, k and v, passed to every forward.

A model's parameters are the same at every CP size; what changes with the CP setting (the
group, the batch's sharding, the mode) changes every step or between runs.
So the model keeps none of it: the caller builds a `CPContext` for each batch and passes it
to `model(tokens, position_ids, cp)`, and every attention layer calls
[`cp.attention(q, k, v, window=...)`][cpref.models.context.CPContext.attention] (the window
is the layer's, from the model's config). Two models with
different CP settings, or one model under two settings, then share a process without
interfering: nothing about CP is stored where the other could see it.

```python
# given: comm, P, packed, cu_seqlens, model; packed: a training batch (tokens, labels), model: a CausalLM
from cpref.models import CPContext
batch = cpref.get_batch_on_this_cp_rank(packed, cu_seqlens, cp_size=P, rank=comm.rank, layout="zigzag")
cp = CPContext(comm=comm, sharding=batch["sharding"], mode="a2a+p2p", options={"a2a_size": 2})
logits = model(batch["tokens"], batch["position_ids"], cp)  # (T_l, V)
```

For the next batch, `dataclasses.replace(cp, sharding=next_batch["sharding"])`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

from cpref.api import MODES, attention, check_sharding
from cpref.base.checks import as_bool, as_choice
from cpref.base.errors import CPInputError
from cpref.batch.mask import Mask, check_mask
from cpref.batch.seqlens import CuSeqlens
from cpref.batch.sharding import Sharding
from cpref.comm.protocol import Collectives, SingleRank, check_comm
from cpref.kernels import AttentionKernel
from cpref.kernels.contract import NO_WINDOW

__all__ = ["CPContext", "OPTIONS"]

# The keyword options of cpref.attention a context may carry: every mode's own, check_ranks and deterministic.
OPTIONS = tuple(sorted({option.name for spec in MODES.values() for option in spec.options} | {"check_ranks", "deterministic"}))


@dataclass(frozen=True, kw_only=True, eq=False)
class CPContext:
    """The CP setting of one batch on one rank, as every attention layer of a model needs it.

    Attributes:
        comm: the CP group's collectives (`sim.SimCluster(P).run(fn)` hands one to `fn`;
            `cpref.SingleRank()` for CP = 1).
        sharding: how the batch is sharded ([`cpref.Sharding`][cpref.batch.sharding.Sharding]: its
            boundaries, real and padded, its CP size, which must be `comm.size`, and layout).
        mode: the CP algorithm, a key of `cpref.MODES`.
        causal: causal attention inside each document (what a decoder-only model needs).
        options: further keyword arguments of `cpref.attention` (names in `OPTIONS`), e.g.
            `{"a2a_size": 2}` for mode `"a2a+p2p"`; read-only once built.
        kernel: the attention kernel, default `cpref.kernels.default_kernel` of the tensors' device
            (`CudaKernel` on CUDA, `TorchKernel` elsewhere).
        mask: the batch's attention mask, a `cpref.Mask` every layer computes in place of causal documents
            (a model whose layers have windows refuses it by name: a mask replaces the window), or None.

    Raises:
        CPInputError: for an unknown mode or option, a `comm` that is not a `cpref.Collectives`,
            or a sharding that is not a `cpref.Sharding` over `comm.size` ranks, before any
            communication.
    """

    comm: Collectives
    sharding: Sharding
    mode: str
    causal: bool = True
    options: Mapping[str, Any] = field(default_factory=dict)
    kernel: AttentionKernel | None = None
    mask: Mask | None = None

    def __post_init__(self) -> None:
        _, size = check_comm(self.comm, "for CP = 1 use CPContext.single(cu_seqlens)")
        check_sharding(self.sharding, size)
        as_choice("mode", self.mode, sorted(MODES))
        as_bool("causal", self.causal)
        if not isinstance(self.options, Mapping):
            got = type(self.options).__name__
            raise CPInputError(f"options must be a dict of cpref.attention keyword options, got {got}")
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise CPInputError(
                f"options {unknown} are not keyword options of cpref.attention a model may set; "
                f"choose among {list(OPTIONS)} (the softmax scale is the model's: head_dim ** -0.5)"
            )
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        check_mask(self.mask, self.sharding.cu_seqlens[-1], causal=self.causal, window=NO_WINDOW, chunk=None)

    @classmethod
    def single(
        cls,
        cu_seqlens: CuSeqlens,
        cu_seqlens_padded: CuSeqlens | None = None,
        *,
        causal: bool = True,
        kernel: AttentionKernel | None = None,
    ) -> "CPContext":
        """CP = 1: `cpref.SingleRank()`, mode `"all_gather"`, no communication at all.

        Without CP the one rank holds every document whole and in order (any length, no padding
        needed), so `cu_seqlens` is all it takes; `cu_seqlens_padded` only if the batch is padded.
        """
        sharding = Sharding(cu_seqlens, cp_size=1, cu_seqlens_padded=cu_seqlens_padded)
        return cls(comm=SingleRank(), sharding=sharding, mode="all_gather", causal=causal, kernel=kernel)

    @property
    def cp_size(self) -> int:
        """`P`, the size of the CP group."""
        return self.comm.size

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: tuple[int, int] = NO_WINDOW
    ) -> torch.Tensor:
        """`cpref.attention` on this rank's shards: `(T_l, Hq, D), (T_l, Hkv, D), (T_l, Hkv, Dv) -> (T_l, Hq, Dv)`.

        `window` is the calling layer's (`cpref.attention`'s `(left, right)`; default none): it
        belongs to the model's config, not to the CP setting, so layers of one model may differ.
        """
        return attention(q, k, v, self.sharding, comm=self.comm, mode=self.mode, causal=self.causal,
                         window=window, kernel=self.kernel, mask=self.mask, **self.options)  # fmt: skip
