"""The public entry point: `cpref.attention`.

```python
out = cpref.attention(q, k, v, cu_seqlens, comm=comm, mode="all_gather", layout="zigzag")
```

`q, k, v` are this rank's shards (from [`cpref.shard`][cpref.layout.shard] with the same
layout), `cu_seqlens` the global padded document boundaries, and `comm` the CP group's
collectives ([`cpref.comm.Collectives`][cpref.comm.Collectives]). The result is this rank's
output shard, differentiable in `q`, `k` and `v` through an `autograd.Function` with an
explicit backward (autograd never runs through a collective).

Every input is validated **before any communication**, by checks that depend only on values
every rank shares (the global `cu_seqlens`, the shapes, the arguments), so a bad call fails on
every rank alike instead of leaving some ranks waiting in a collective.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from cpref.cache import IdentityLRU
from cpref.comm import Collectives
from cpref.errors import CPInputError
from cpref.kernels import AttentionKernel, TorchKernel
from cpref.layout import LAYOUTS, as_cu_list, check_divisible
from cpref.metadata import get_thd_load_balanced_cp_metadata
from cpref.modes.all_gather import AllGatherKVFunc

__all__ = ["attention", "MODES", "validate_inputs"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# validated host ints of recently used cu_seqlens (see cpref.cache)
_HOST_CU: IdentityLRU[list[int]] = IdentityLRU(8)


def _all_gather_mode(q, k, v, cu, comm, kernel, layout, causal, scale):
    meta = get_thd_load_balanced_cp_metadata(cu, comm.size, comm.rank, q.device, layout=layout, causal=causal)
    return AllGatherKVFunc.apply(q, k, v, meta, comm, kernel, causal, scale)


# mode name -> implementation(q, k, v, cu_seqlens, comm, kernel, layout, causal, scale)
MODES: dict[str, Callable[..., torch.Tensor]] = {"all_gather": _all_gather_mode}


def validate_inputs(q, k, v, cu_seqlens, *, cp_size: int, mode: str, layout: str, softmax_scale) -> list[int]:
    """Check everything `attention` needs, without communicating. Returns `cu_seqlens` as ints.

    Raises:
        ValueError: (`CPInputError`) naming the offending value and the fix.
    """
    if mode not in MODES:
        raise CPInputError(f"unknown mode {mode!r}; available: {sorted(MODES)}")
    if layout not in LAYOUTS:
        raise CPInputError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise CPInputError(f"{name} must be a THD tensor (tokens, heads, dim), got {shape}")
        if t.dtype not in FLOAT_DTYPES:
            raise CPInputError(f"{name} has dtype {t.dtype}; use one of {FLOAT_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise CPInputError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on {q.device}/{k.device}/{v.device}")
    (tq, hq, dq), (tk, hkv, dk), (tv, hv, dv) = q.shape, k.shape, v.shape
    if hv != hkv or hkv == 0 or hq % hkv:
        raise CPInputError(f"heads: q has {hq}, k {hkv}, v {hv}; need k and v alike and Hq % Hkv == 0")
    if dq != dk or dv > dk:
        raise CPInputError(f"head dims: q {dq}, k {dk}, v {dv}; need Dq == Dk >= Dv")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise CPInputError(f"softmax_scale must be None or a positive finite number, got {softmax_scale!r}")
    cu = _HOST_CU.get_or_build(cu_seqlens, (), lambda: as_cu_list(cu_seqlens))  # one host copy per step, not per layer
    check_divisible(cu, layout, cp_size)
    local = cu[-1] // cp_size
    if not tq == tk == tv == local:
        raise CPInputError(
            f"q/k/v hold {tq}/{tk}/{tv} tokens but this rank's shard of {cu[-1]} tokens over "
            f"cp_size={cp_size} has {local}; shard with cpref.shard(x, cu_seqlens, cp_size=..., rank=..., layout={layout!r})"
        )
    return cu


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | list[int],
    *,
    comm: Collectives,
    mode: str,
    layout: str = "zigzag",
    causal: bool = True,
    softmax_scale: float | None = None,
    a2a_size: int | None = None,
    kernel: AttentionKernel | None = None,
) -> torch.Tensor:
    """Context-parallel attention over a packed THD batch.

    Args:
        q: `(T / P, Hq, D)` this rank's query shard.
        k: `(T / P, Hkv, D)` this rank's key shard, `Hq % Hkv == 0`.
        v: `(T / P, Hkv, Dv)` this rank's value shard, `Dv <= D`.
        cu_seqlens: global document boundaries with a leading 0, every document a multiple
            of the layout's granularity (`P` contiguous, `2P` zigzag).
        comm: the CP group's collectives.
        mode: the CP algorithm; see `MODES` (`"all_gather"`).
        layout: `"zigzag"` or `"contiguous"`, as used to shard `q, k, v`.
        causal: causal (default) or full attention inside each document.
        softmax_scale: logit scale, default `D ** -0.5`.
        a2a_size: all-to-all sub-group size of the hierarchical mode (not used by other modes).
        kernel: the attention kernel, default [`TorchKernel`][cpref.kernels.TorchKernel].

    Returns:
        `(T / P, Hq, Dv)` this rank's output shard, in the layout of `q`.

    Raises:
        ValueError: on any invalid input, before any communication, on every rank alike.
    """
    cu = validate_inputs(q, k, v, cu_seqlens, cp_size=comm.size, mode=mode, layout=layout, softmax_scale=softmax_scale)
    if a2a_size is not None:
        raise CPInputError(f"a2a_size={a2a_size} is only used by the hierarchical a2a+p2p mode, not mode={mode!r}")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    kernel = TorchKernel() if kernel is None else kernel
    # Pass the caller's tensor on, so the metadata cache can key on its identity and version.
    cu_key = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else cu
    return MODES[mode](q, k, v, cu_key, comm, kernel, layout, bool(causal), scale)
