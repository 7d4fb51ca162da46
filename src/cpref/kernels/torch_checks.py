"""Host-side checks of a `TorchKernel` call, shared by its explicit and fast paths."""

from __future__ import annotations

import torch

from cpref.base.errors import CPInputError
from cpref.kernels.contract import Varlen, check_heads

__all__ = ["check_inputs"]


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Varlen) -> None:
    """Validate dtypes, shapes and lengths against `seqs`, on the host (no device read)."""
    check_heads(q, k, v)
    if not isinstance(seqs, Varlen):
        raise CPInputError(f"seqs must be a cpref.kernels.Varlen (host lengths), got {type(seqs).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise CPInputError(f"TorchKernel: {name} has dtype {t.dtype}; attention needs a floating dtype")
    if not (q.dtype == k.dtype == v.dtype):
        raise CPInputError(f"TorchKernel: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if seqs.total_q != q.shape[0] or seqs.total_kv != k.shape[0]:
        raise CPInputError(
            f"TorchKernel: seqs cover {seqs.total_q} queries and {seqs.total_kv} keys, "
            f"but q has {q.shape[0]} rows and k {k.shape[0]}"
        )
