r"""Merging partial attention results by their log-sum-exp: how ring attention adds up blocks.

The one merge of cpref, below the modes: the ring and the hierarchical ring level add up their
steps with it, the fused CPU kernel its split rows, and the NPU check its two kernel calls.

A query row's softmax runs over all its keys, but a ring step sees only one block of them.
The step's kernel call returns the block's output $O_b$ and log-sum-exp $\mathrm{lse}_b$; the
row's output over the keys seen so far, $(O, \mathrm{lse})$, and the block's combine exactly:

$$ \mathrm{lse}' = \log\left(e^{\mathrm{lse}} + e^{\mathrm{lse}_b}\right), \qquad
   O' = \frac{e^{\mathrm{lse}} O + e^{\mathrm{lse}_b} O_b}{e^{\mathrm{lse}} + e^{\mathrm{lse}_b}} . $$

Written naively the exponentials overflow. The stable form divides through by
$e^{\mathrm{lse}} + e^{\mathrm{lse}_b}$ and takes the larger lse out of the logarithm:
with $\sigma$ the logistic function and $m = \max(\mathrm{lse}, \mathrm{lse}_b)$,

$$ O' = \sigma(\mathrm{lse} - \mathrm{lse}_b)\, O + \sigma(\mathrm{lse}_b - \mathrm{lse})\, O_b, \qquad
   \mathrm{lse}' = m + \log\left(1 + e^{-|\mathrm{lse} - \mathrm{lse}_b|}\right) , $$

and no exponential of a large number is ever formed.

**Exact where one block dominates.** Both weights come from the *difference* of the two lse,
and $\mathrm{lse}'$ is the larger one plus a term in $[0, \log 2]$: when one block outweighs the
other by more than the dtype resolves, $O'$ and $\mathrm{lse}'$ are that block's, bit for bit.
The ring's backward needs exactly that: it recomputes probabilities as
$e^{S - \mathrm{lse}}$ from the merged lse, so an error $\delta$ in $\mathrm{lse}$ is a
relative error $\delta$ in every probability of the row. The equivalent form
$\mathrm{lse}' = \mathrm{lse} - \log\sigma(\mathrm{lse} - \mathrm{lse}_b)$ is no such thing: for a
dominating block it computes $\mathrm{lse} + (\mathrm{lse}_b - \mathrm{lse})$, two roundings at the
magnitude of $|\mathrm{lse}| + |\mathrm{lse}_b|$, which at float32 logits of $10^6$ are steps of
0.125 (see the ring's Precision section for what that did to dV).

**Rows that have seen no key** carry $\mathrm{lse} = -\infty$ and $O = 0$; a block in which a row
sees no key has $\mathrm{lse}_b = -\infty$. The difference then meets $\infty - \infty$, so these
weights are taken explicitly: a block with $\mathrm{lse}_b = -\infty$ changes nothing, and a row
with $\mathrm{lse} = -\infty$ takes the block as it is. No NaN ever appears.

The running $(O, \mathrm{lse})$ are float32 (float64 for float64 inputs) from the first block to
the last, as the kernel contract's lse is; the output is cast to the input dtype once, at the
end, by the caller.
"""

from __future__ import annotations

import torch

__all__ = ["merge_partial"]


# --8<-- [start:merge]
def merge_partial(
    out: torch.Tensor, lse: torch.Tensor,
    out_b: torch.Tensor, lse_b: torch.Tensor,
) -> None:
    """Merge the block `(out_b (T, H, Dv), lse_b (T, H))` into the running
    `(out, lse)`, in place.
    """
    seen, seen_b = lse > float("-inf"), lse_b > float("-inf")  # (T, H)
    both = seen & seen_b
    # lse - lse_b where both sides have keys
    gap = (lse - lse_b).where(both, 0.0)  # (T, H)
    # w = sigmoid(lse - lse_b), w_b = sigmoid(lse_b - lse); 1 and 0 where only
    # one side has keys
    w = torch.sigmoid(gap).where(both, seen.to(lse.dtype))  # (T, H)
    w_b = torch.sigmoid(-gap).where(both, seen_b.to(lse.dtype))  # (T, H)
    # O <- w O + w_b O_b
    out.mul_(w.unsqueeze(-1)).add_(w_b.unsqueeze(-1) * out_b)  # (T, H, Dv)
    # lse <- max(lse, lse_b) + log1p(e^-|lse - lse_b|),
    # -inf where neither side has keys
    lse.copy_(torch.logaddexp(lse, lse_b))
# --8<-- [end:merge]
