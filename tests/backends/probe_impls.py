"""Implementations with the mask bugs met in the field, for the mask probe (`sim.tools.verify.probe`).

Each is cpref's own CP attention (`tests.backends.verify_impls:cpref_over_group`, right in every mode) given the
wrong mask, so the probe's report names the bug and nothing else:

- `drops_window`: the window dropped, causal documents instead (a TE a2a path, PR #3527 review);
- `mask_replaced_by_causal`: takes `mask=` and runs causal documents instead (accelerate #4177);
- `documents_not_isolated`: causal over the whole packed stream, every document seeing the ones before it.

And `without_backward`, right but with no backward (as a peer built on FlexAttention on the CPU): the probe runs
forward only.
"""

from __future__ import annotations

import torch

import cpref
from tests.backends.verify_impls import cpref_over_group


def drops_window(q, k, v, sharding, *, process_group, window, **kwargs) -> torch.Tensor:
    """Wrong under a window: attends causal documents without it."""
    return cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)


def mask_replaced_by_causal(q, k, v, sharding, *, process_group, mask=None, **kwargs) -> torch.Tensor:
    """Wrong under a mask: takes `mask=` and attends causal documents (`is_causal=True`) instead."""
    return cpref_over_group(q, k, v, sharding, process_group=process_group, **{**kwargs, "causal": True})


def documents_not_isolated(q, k, v, sharding, *, process_group, mode, **kwargs) -> torch.Tensor:
    """Wrong on packed batches: causal over the whole stream of real tokens, one mask slice across every document."""
    T = int(sharding.cu_seqlens[-1])  # the real tokens
    stream = cpref.Mask.from_slices([(0, T, 0, T, "causal")], T)
    return cpref_over_group(q, k, v, sharding, process_group=process_group, mode=mode, mask=stream)


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("no backward")


def without_backward(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Right forward, and a backward that raises."""
    return _NoBackward.apply(cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs))
