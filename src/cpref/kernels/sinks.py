r"""Learnable sinks: one more logit per head in every row's softmax, added once.

A sink (GPT-OSS) is a logit $s_h$ per query head that joins every row's softmax denominator and
carries no value:

$$ o_{xh} = \frac{\sum_y e^{S_{hxy}} v_y}{e^{s_h} + \sum_y e^{S_{hxy}}}, \qquad
   \mathrm{lse}'_{xh} = \log\Big(e^{s_h} + \sum_y e^{S_{hxy}}\Big) = \mathrm{logaddexp}(\mathrm{lse}_{xh}, s_h). $$

**Forward, once per row.** Given a row's `(out, lse)` without the sink, over *all* its keys or over
any part of them, [`add_sinks`][cpref.kernels.sinks.add_sinks] makes it the sinked result of that
part: $\mathrm{lse}' = \mathrm{logaddexp}(\mathrm{lse}, s)$ and $o' = o\, e^{\mathrm{lse} -
\mathrm{lse}'} = o\, \sigma(\mathrm{lse} - s)$. Merging partial results by lse
([`cpref.kernels.merge`][cpref.kernels.merge]) sums their denominators, so the sink must enter
exactly one partial of each row: a mode adds it to the call that holds every row of the rank
(the ring's step 0, all-gather's call, each Ulysses call for its heads), never to a second one.
A row that sees no key gets $\mathrm{lse}' = s$ and $o' = 0$.

**Backward.** With the row's final $(o', \mathrm{lse}')$ every kernel call's ordinary backward is
already right: its probabilities $e^{S - \mathrm{lse}'}$ are the sinked ones, and the sink's
column has no value, so nothing else changes for dQ, dK, dV. The sink's own gradient is

$$ \frac{\partial L}{\partial s_h} = -\sum_x e^{s_h - \mathrm{lse}'_{xh}}\, \Delta_{xh}, \qquad
   \Delta_{xh} = \sum_d dO_{xhd}\, o'_{xhd} , $$

([`sinks_grad`][cpref.kernels.sinks.sinks_grad]), each rank summing over the rows it holds, for the
heads it computes. The sinks are a parameter replicated on every rank, as the model's weights are:
a rank's gradient is its rows' share, and the sum over the CP group (what DP x CP training sums)
counts every row once.
"""

from __future__ import annotations

import torch

__all__ = ["add_sinks", "sinks_grad", "head_slice", "on_all_heads"]


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out', lse')`: rows `(out (T, H, Dv), lse (T, H))` with the sinks `(H,)` added to their softmax, in the dtypes
    of `out` and `lse` (call it on the compute-dtype results, before any rounding).

    Examples:
        >>> import torch
        >>> lse = torch.tensor([[0.0], [float("-inf")]], dtype=torch.float64)  # a row that sees keys, one that does not
        >>> out, lse = add_sinks(torch.ones(2, 1, 3, dtype=torch.float64), lse, torch.tensor([0.0]))
        >>> out[:, 0, 0].tolist(), lse[:, 0].tolist()  # half the mass goes to the sink; the keyless row: 0 and s
        ([0.5, 0.0], [0.6931471805599453, 0.0])
    """
    s = sinks.to(lse.dtype)[None, :]  # (1, H)
    # lse' = logaddexp(lse, s)
    lse_sinked = torch.logaddexp(lse, s)  # (T, H)
    # o' = o e^(lse - lse'): 0 where lse = -inf (a row that sees no key)
    out_sinked = out * torch.exp(lse - lse_sinked).unsqueeze(-1).to(out.dtype)  # (T, H, Dv)
    return out_sinked, lse_sinked


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`dL/ds (H,)` from the rows' final `out (T, H, Dv)` and `lse (T, H)` (the sink added) and `dout`, summed in
    float32 (float64 for float64 inputs), in the sinks' dtype.
    """
    cdt = torch.float64 if lse.dtype == torch.float64 else torch.float32
    # Delta_x = sum_d dO_xd o'_xd; p_sink = e^(s - lse')
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)  # (T, H)
    p_sink = torch.exp(sinks.to(cdt)[None, :] - lse.to(cdt))  # (T, H)
    return -(p_sink * delta).sum(0).to(sinks.dtype)  # (H,)


def head_slice(sinks: torch.Tensor | None, j: int, a: int) -> torch.Tensor | None:
    """The sinks of the query heads rank `j` of an all-to-all over `a` ranks computes: heads `[j H/a, (j + 1) H/a)`
    (Ulysses' head split, `cpref.modes.exchange.a2a_gather`); None stays None.

    Examples:
        >>> head_slice(torch.arange(8.0), 1, 4).tolist()
        [2.0, 3.0]
    """
    if sinks is None:
        return None
    n = sinks.shape[0] // a
    return sinks[j * n : (j + 1) * n]


def on_all_heads(grad: torch.Tensor, j: int, a: int) -> torch.Tensor:
    """A head slice's gradient `(H/a,)` (`head_slice`) in the sinks' shape `(H,)`, zero on the other heads: what
    this rank contributes, so that the sum over the ranks counts every head once.

    Examples:
        >>> on_all_heads(torch.tensor([1.0, 2.0]), 1, 4).tolist()
        [0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    """
    n = grad.shape[0]
    out = grad.new_zeros(n * a)
    out[j * n : (j + 1) * n] = grad
    return out
