"""The public entry point: `cpref.attention`.

```python
out = cpref.attention(q, k, v, cu_seqlens, comm=comm, mode="all_gather", layout="zigzag",
                      cu_seqlens_padded=cu_seqlens_padded)
```

`q, k, v` are this rank's shards (from [`cpref.shard`][cpref.layout.shard] with the same
layout and the padded boundaries), `cu_seqlens` the global real document boundaries,
`cu_seqlens_padded` the padded ones if documents were padded, and `comm` the CP group's
collectives ([`cpref.comm.Collectives`][cpref.comm.Collectives]). The result is this rank's
output shard, differentiable (once) in `q`, `k` and `v` through an `autograd.Function` with an
explicit backward: autograd never runs through a collective.

## Validation before communication

Under `torch.autocast`, the inputs arrive in the autocast dtype (bf16 from the projections) and
attention still computes in its own precision: autocast is switched off for the mode's forward
(the backward runs outside autocast, where training loops call it).

Every input is validated **before any of the mode's communication**, by checks that depend
mostly on values every rank shares (the global boundaries, the shapes, the arguments), so a
bad call fails on every rank alike instead of leaving some ranks waiting in a collective. The
checks, in order:
the communicator, the mode and its options, the layout and flags, the kernel, the tensors
(dims, dtypes, heads, head dims), the scale, the boundaries (cached per batch, see
[`cpref.cache`][cpref.cache]), the shard size, the mode's own constraints, and the
backend's known limits. Then, on every call, the ranks compare their arguments with one
tiny host exchange ([`cpref.consistency`][cpref.consistency]). A rank whose own inputs fail
(its shard's length, say, which only it sees) still meets the others in that comparison,
marked invalid, before raising: they raise too, naming it, instead of waiting for it.

## Modes

`MODES` maps each mode name to a [`Mode`][cpref.api.Mode]: the function that runs it, the
collectives it uses and the options it accepts. A mode option given to another mode is an
error, never silently ignored.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

import torch

from cpref.cache import CACHE
from cpref.call import CPCall
from cpref.checks import as_bool, as_choice, as_scale, missing_members
from cpref.comm import Collectives, check_comm
from cpref.consistency import check_ranks_agree, report_invalid_inputs
from cpref.errors import CPInputError
from cpref.kernels import AttentionKernel, TorchKernel, check_heads
from cpref.layout import LAYOUTS
from cpref.modes.all_gather import run_all_gather
from cpref.modes.hierarchical import check_hierarchical, run_hierarchical
from cpref.modes.ring import run_ring
from cpref.modes.ulysses import check_ulysses, run_ulysses

__all__ = ["attention", "MODES", "Mode", "prepare"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Mode:
    """A CP algorithm as `cpref.attention` dispatches it.

    Attributes:
        run: `run(q, k, v, call, comm) -> out` for a validated `CPCall`.
        collectives: the collectives it calls (checked against the backend's limits).
        options: `{name: default}` of the keyword options it accepts.
        check: extra validation of a `CPCall` (e.g. head counts), before communication.
    """

    run: Callable[..., torch.Tensor]
    collectives: frozenset[str]
    options: tuple[tuple[str, Any], ...] = ()
    check: Callable[[CPCall], None] | None = None


MODES: dict[str, Mode] = {
    "all_gather": Mode(run_all_gather, frozenset({"all_gather", "reduce_scatter"}), (("save_gathered_kv", False),)),
    "p2p": Mode(run_ring, frozenset({"send_recv"})),
    "a2a": Mode(run_ulysses, frozenset({"all_to_all"}), check=check_ulysses),
    "a2a+p2p": Mode(run_hierarchical, frozenset({"all_to_all", "send_recv"}), (("a2a_size", None),), check_hierarchical),
}


def _check_options(mode: str, given: dict[str, Any]) -> dict[str, Any]:
    accepted = dict(MODES[mode].options)
    for name, value in given.items():
        if value is not None and name not in accepted:
            users = sorted(m for m, spec in MODES.items() if name in dict(spec.options))
            raise CPInputError(f"{name}={value!r} is only used by mode {' / '.join(users) or '(none built)'}, not mode={mode!r}")
    options = {name: (given.get(name) if given.get(name) is not None else default) for name, default in accepted.items()}
    if "save_gathered_kv" in options:
        options["save_gathered_kv"] = as_bool("save_gathered_kv", options["save_gathered_kv"])
    return options


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    check_heads(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FLOAT_DTYPES:
            raise CPInputError(f"{name} has dtype {t.dtype}; use one of {FLOAT_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise CPInputError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on {q.device}/{k.device}/{v.device}"
        )


def prepare(q, k, v, cu_seqlens, *, comm, mode, layout="zigzag", causal=True, softmax_scale=None,
            cu_seqlens_padded=None, kernel=None, **options) -> CPCall:  # fmt: skip
    """Validate one `attention` call without communicating; return it as a `CPCall`.

    Raises:
        ValueError: (`CPInputError`) naming the offending value and the fix.
    """
    # 1) who we are, what to run, how
    rank, P = check_comm(comm)
    mode = as_choice("mode", mode, sorted(MODES))
    options = _check_options(mode, options)
    layout, causal = as_choice("layout", layout, LAYOUTS), as_bool("causal", causal)
    kernel = TorchKernel() if kernel is None else kernel
    if missing_members(kernel, AttentionKernel):
        raise CPInputError(
            f"kernel must be an attention kernel instance (forward and backward, see cpref.kernels.AttentionKernel), "
            f"got {kernel!r:.60} (without {', '.join(missing_members(kernel, AttentionKernel))}); pass e.g. cpref.TorchKernel()"
        )
    # 2) the tensors and the scale
    _check_tensors(q, k, v)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else as_scale(softmax_scale, q.dtype)
    # 3) the batch: boundaries (validated once per batch, then cached), divisibility, shard size
    entry = CACHE.entry(cu_seqlens, cu_seqlens_padded)
    entry.bounds.check_divisible(layout, P)
    local = entry.bounds.total // P
    if not q.shape[0] == k.shape[0] == v.shape[0] == local:
        raise CPInputError(
            f"q/k/v hold {q.shape[0]}/{k.shape[0]}/{v.shape[0]} tokens but this rank's shard of {entry.bounds.total} "
            f"tokens over cp_size={P} has {local}; shard with "
            f"cpref.shard(x, cu_seqlens_padded or cu_seqlens, cp_size={P}, rank=comm.rank, layout={layout!r})"
        )
    heads = (q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    call = CPCall(entry, P, rank, layout, causal, scale, kernel, heads, q.dtype, q.device, MappingProxyType(options))
    # 4) the mode's own constraints, and what the backend cannot do
    spec = MODES[mode]
    if spec.check is not None:
        spec.check(call)
    missing = spec.collectives & frozenset(comm.unsupported_ops)
    if missing:
        raise CPInputError(
            f"mode={mode!r} needs {sorted(missing)}, which this communicator ({type(comm).__name__}, size {P}) "
            "does not support; choose another mode or CP size"
        )
    return call


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
    cu_seqlens_padded: torch.Tensor | list[int] | None = None,
    kernel: AttentionKernel | None = None,
    check_ranks: bool = True,
    a2a_size: int | None = None,
    save_gathered_kv: bool | None = None,
) -> torch.Tensor:
    """Context-parallel attention over a packed THD batch.

    Args:
        q: `(T / P, Hq, D)` this rank's query shard.
        k: `(T / P, Hkv, D)` this rank's key shard, `Hq % Hkv == 0`.
        v: `(T / P, Hkv, Dv)` this rank's value shard, `Dv <= D`.
        cu_seqlens: global real document boundaries with a leading 0. Without
            `cu_seqlens_padded`, every document must be a multiple of the layout's
            granularity (`P` contiguous, `2P` zigzag).
        comm: the CP group's collectives.
        mode: the CP algorithm; see `MODES`.
        layout: `"zigzag"` or `"contiguous"`, as used to shard `q, k, v`.
        causal: causal (default) or full attention inside each document.
        softmax_scale: logit scale, default `D ** -0.5`.
        cu_seqlens_padded: the padded boundaries that define the shards (each document padded
            at its end to the layout's granularity); padding is then seen by no query,
            padding queries give 0 and padding rows get zero gradients.
        kernel: the attention kernel, default [`TorchKernel`][cpref.kernels.TorchKernel].
        check_ranks: compare the arguments across ranks with one tiny host exchange on every
            call (see `cpref.consistency`); if every rank passes `False` on the first call of a
            communicator, its later calls skip it.
        a2a_size: all-to-all sub-group size of the hierarchical mode (only that mode).
        save_gathered_kv: `all_gather` only: keep the gathered K/V for the backward instead of
            gathering them again (faster backward, activation memory no longer falls with `P`).

    Returns:
        `(T / P, Hq, Dv)` this rank's output shard, in the layout of `q`.

    Raises:
        ValueError: on any invalid input, before any of the mode's communication, on every rank
            alike (a rank whose own shard fails first tells the others in the ranks' comparison).
    """
    check_ranks = as_bool("check_ranks", check_ranks)
    try:
        call = prepare(q, k, v, cu_seqlens, comm=comm, mode=mode, layout=layout, causal=causal,
                       softmax_scale=softmax_scale, cu_seqlens_padded=cu_seqlens_padded, kernel=kernel,
                       a2a_size=a2a_size, save_gathered_kv=save_gathered_kv)  # fmt: skip
    except CPInputError:
        if _usable(comm):  # the others may be entering the comparison: meet them there
            with contextlib.suppress(Exception):  # if that fails too, this rank's own error is still the one to see
                report_invalid_inputs(comm, q)
        raise
    check_ranks_agree(call, mode, comm, check_ranks)  # every call, unless the group agreed on check_ranks=False
    # attention computes in its own precision (float32 sums for bf16/fp16 inputs), autocast or not:
    # CPU and CUDA autocast would lower the kernel's float32 matmuls to bf16 in the forward only,
    # and the backward's recomputed probabilities would no longer match the saved lse
    with _no_autocast(q.device.type):
        return MODES[mode].run(q, k, v, call, comm)


def _usable(comm: Any) -> bool:
    """Whether `comm` passed its own validation, so that a failing rank can still reach the others."""
    try:
        check_comm(comm)
    except CPInputError:
        return False
    return True


def _no_autocast(device_type: str):
    """A context in which autocast is off for `device_type` (nothing to do where autocast does not exist)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
