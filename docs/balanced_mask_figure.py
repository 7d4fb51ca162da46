"""The figure of [The balanced layout given a mask](balanced-mask.md): who holds what, and each rank's mask work."""

from __future__ import annotations

import random

import torch
from matplotlib.figure import Figure

import cpref
from docs.figures import WIDTH, _long_tail, _owner_bar, plt, rank_color

LAYOUTS = (("zigzag", "zigzag", False), ("balanced (causal)", "balanced", False),
           ("balanced given the mask", "balanced", True))  # fmt: skip


def balanced_mask() -> Figure:
    """`figures/balanced_mask.png`: a long-tailed pack under a prefix-LM mask (prompts of a random share of each
    document) at P = 4, in zigzag, the causal balanced layout and balanced given the mask: the owner of every token
    and each rank's work under the mask, counted from the mask (`sharding.attention_work(r, mask=mask)`)."""
    lengths, P, rng = _long_tail(), 4, random.Random(0)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    mask = cpref.Mask.prefix_lm(cu, [rng.randint(0, n) for n in lengths])
    fig, axes = plt.subplots(4, 1, figsize=(WIDTH, 7.2), constrained_layout=True,
                             gridspec_kw={"height_ratios": [1, 1, 1, 2.4]})  # fmt: skip
    work = {}
    for ax, (label, layout, by_mask) in zip(axes, LAYOUTS):
        batch = cpref.Sharding.eod_padded(cu, cp_size=P, layout=layout, mask=mask if by_mask else None)
        _owner_bar(ax, batch, f"{label}: {batch.total} tokens, {batch.total - cu[-1]} of them padding (hatched)")
        work[label] = [batch.attention_work(r, mask=mask) for r in range(P)]
    axes[2].set_xlabel("token of the padded stream (black lines: documents)")
    width = 0.27
    for k, ((label, w), hatch) in enumerate(zip(work.items(), ("//", "..", ""))):
        axes[3].bar([r + (k - 1) * width for r in range(P)], w, width, color=[rank_color(r) for r in range(P)],
                    hatch=hatch, edgecolor="0.2", label=f"{label}: {max(w) / (sum(w) / P):.3f}")  # fmt: skip
    axes[3].set_xticks(range(P), [f"rank {r}" for r in range(P)])
    axes[3].set_ylabel("visible pairs per head")
    axes[3].set_ylim(0, 2.1 * max(max(w) for w in work.values()))
    axes[3].legend(frameon=False, loc="upper left", ncols=1, title="busiest rank's work over the mean")
    axes[3].spines[["top", "right"]].set_visible(False)
    fig.suptitle(f"a prefix-LM over {len(lengths)} documents of {min(lengths)} to {max(lengths)} tokens, P = {P}")
    return fig


FIGURES = {"figures/balanced_mask.png": balanced_mask}
