r"""Merging partial attention results by their log-sum-exp: how ring attention adds up blocks.

A query row's softmax runs over all its keys, but a ring step sees only one block of them.
The step's kernel call returns the block's output $O_b$ and log-sum-exp $\mathrm{lse}_b$; the
row's output over the keys seen so far, $(O, \mathrm{lse})$, and the block's combine exactly:

$$ \mathrm{lse}' = \log\left(e^{\mathrm{lse}} + e^{\mathrm{lse}_b}\right), \qquad
   O' = \frac{e^{\mathrm{lse}} O + e^{\mathrm{lse}_b} O_b}{e^{\mathrm{lse}} + e^{\mathrm{lse}_b}} . $$

Written naively the exponentials overflow. The stable form divides through by
$e^{\mathrm{lse}} + e^{\mathrm{lse}_b}$: the weight of the block is $\sigma(\mathrm{lse}_b - \mathrm{lse})$, and

$$ O' = O - \sigma(\mathrm{lse}_b - \mathrm{lse})\,(O - O_b), \qquad
   \mathrm{lse}' = \mathrm{lse} - \log\sigma(\mathrm{lse} - \mathrm{lse}_b) , $$

with $\sigma$ the logistic function: no exponential of a large number is ever formed.

**Rows that have seen no key** carry $\mathrm{lse} = -\infty$ and $O = 0$; a block in which a row
sees no key has $\mathrm{lse}_b = -\infty$. The formulas then meet $\infty - \infty$, so these cases
are taken explicitly: a block with $\mathrm{lse}_b = -\infty$ changes nothing, and a row with
$\mathrm{lse} = -\infty$ takes the block as it is. No NaN ever appears.

The running $(O, \mathrm{lse})$ are float32 (float64 for float64 inputs) from the first block to
the last; the output is cast to the input dtype once, at the end, by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["merge_partial"]


# --8<-- [start:merge]
def merge_partial(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge the block `(out_b (T, H, Dv), lse_b (T, H))` into the running `(out, lse)`, in place."""
    seen, seen_b = lse > float("-inf"), lse_b > float("-inf")  # (T, H)
    # w = sigmoid(lse_b - lse): 1 where only the block has keys, 0 where the block has none
    w = torch.sigmoid(lse_b - lse).where(seen & seen_b, seen_b.to(lse.dtype))  # (T, H)
    # O <- O - w (O - O_b)
    out.sub_(w.unsqueeze(-1) * (out - out_b))  # (T, H, Dv)
    # lse <- lse - logsigmoid(lse - lse_b)
    merged = lse - F.logsigmoid(lse - lse_b)  # (T, H)
    lse.copy_(merged.where(seen & seen_b, torch.where(seen_b, lse_b, lse)))
# --8<-- [end:merge]
