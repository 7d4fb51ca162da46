"""Implementations to put under `python -m sim verify --impl tests.backends.verify_impls:<name>`.

Each has cpref's signature with the process group in place of `comm`:
`fn(q, k, v, sharding, *, process_group, mode, causal, window, **options)`, `sharding` the batch's `cpref.Sharding`.

* `cpref_over_group`: a correct one (a `TorchComm` over the group, then `cpref.attention`);
* `biased_on_rank_1`: a deliberately wrong one (rank 1's output is off by 0.1);
* `off_within_tolerance_on_rank_1`: wrong by less than the fixed tolerance, but about ten times
  the kernel's own error: only the `vs P=1` column catches it;
* `drops_window`: wrong under a sliding window (it runs without the window it was given);
* `stream_ulysses` (`examples.stream_ulysses`): a correct peer, a DeepSpeed-style Ulysses over the
  stream layout, and `stream_ulysses_without_eod_reset`, the same attending across documents (causal over
  the whole stream, the bug of a packed batch run without its boundaries);
* `raises_on_rank_1`, `killed_mid_collective`, `mismatched_causal`: faults the harness must
  turn into a clear report instead of a hang.
"""

from __future__ import annotations

import os
import signal

import torch

import cpref
import examples.stream_ulysses
from cpref.backends import TorchComm

_COMMS: dict[int, TorchComm] = {}


def _comm(process_group) -> TorchComm:
    """One `TorchComm` per group, kept (cpref checks the ranks' arguments once per batch and communicator)."""
    if id(process_group) not in _COMMS:
        _COMMS[id(process_group)] = TorchComm(process_group)
    return _COMMS[id(process_group)]


def cpref_over_group(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Correct: cpref.attention over a TorchComm of the group."""
    return cpref.attention(q, k, v, sharding, comm=_comm(process_group), **kwargs)


def stream_ulysses(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Correct: the peer of `examples.stream_ulysses`."""
    return examples.stream_ulysses.attention(q, k, v, sharding, process_group=process_group, **kwargs)


def stream_ulysses_without_eod_reset(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Wrong on packed batches: the peer told the stream is one document (no EOD reset between documents)."""
    one = cpref.Sharding([0, sharding.total], cp_size=sharding.cp_size, layout="stream")
    return examples.stream_ulysses.attention(q, k, v, one, process_group=process_group, **kwargs)


def biased_on_rank_1(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Wrong: rank 1 adds 0.1 to its output; no gradient changes, so only rank 1's `out` may fail."""
    out = cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)
    return out + 0.1 if _comm(process_group).rank == 1 else out


# rank 1's output is scaled by 1 + this: 16 and 4 machine epsilons, inside rtol = 1e-5 (fp32) and 3.5e-2 (bf16,
# GQA), and about ten times the error of the kernel without CP
WITHIN_TOLERANCE = {torch.float32: 2.0**-19, torch.bfloat16: 2.0**-5}


def off_within_tolerance_on_rank_1(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Subtly wrong: rank 1's output is off by `WITHIN_TOLERANCE` relative; the gradients are untouched."""
    out = cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)
    if _comm(process_group).rank != 1:
        return out
    return out + (out * WITHIN_TOLERANCE[out.dtype]).detach()


def drops_window(q, k, v, sharding, *, process_group, window, **kwargs) -> torch.Tensor:
    """Wrong under a window: calls cpref.attention without it (plain causal or full attention)."""
    return cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)


def raises_on_rank_1(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Fault: rank 1 raises before any collective, rank 0 waits for it in the first one."""
    if _comm(process_group).rank == 1:
        raise ValueError("rank 1 rejects its input")
    return cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)


class _DiesInAllGather(TorchComm):
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:  # killed inside the collective that rank 0 is waiting in
            os.kill(os.getpid(), signal.SIGKILL)
        return super().all_gather(x)


def killed_mid_collective(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Fault: rank 1's process is killed (SIGKILL) inside cpref's first all-gather."""
    return cpref.attention(q, k, v, sharding, comm=_DiesInAllGather(process_group), **kwargs)


def mismatched_causal(q, k, v, sharding, *, process_group, causal, **kwargs) -> torch.Tensor:
    """Fault: rank 1 passes the other mask; cpref's rank check raises the same error on every rank."""
    comm = _comm(process_group)
    return cpref.attention(q, k, v, sharding, comm=comm, causal=causal != (comm.rank == 1), **kwargs)
