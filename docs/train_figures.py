"""The training pages' figures: loss curves of the same run at CP = 1 and CP = 4, drawn from real runs, and
what `cpref.hf.shard_batch` makes of a padded batch.

Both runs train the same small LLaMA-style model on the same packs of standard-library text
(`python -m sim train` on the simulated cluster, ring attention, zigzag); the lower panel is
their relative difference, which the test suite bounds by 1e-5 over 10 steps.
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

import cpref.hf
from cpref.train.training import TrainConfig
from docs import figures as base
from sim.tools.train import RunSpec, run_sim

STEPS, PACK = 30, 256


def parity() -> Figure:
    """`figures/parity.png`: loss per step at CP = 1 and CP = 4, and their relative difference."""
    runs = {}
    for label, cp, mode in (("CP = 1", 1, "all_gather"), ("CP = 4, ring (p2p), zigzag", 4, "p2p")):
        spec = RunSpec(model="llama", cp=cp, steps=STEPS, pack_tokens=PACK, train=TrainConfig(mode=mode, micro_batches=2))
        runs[label] = [s.loss for s in run_sim(spec)]
    fig, (top, bottom) = base.plt.subplots(2, 1, figsize=(base.WIDTH, 5.2), sharex=True, height_ratios=[3, 1.4],
                                           constrained_layout=True)  # fmt: skip
    (one, one_loss), (four, four_loss) = runs.items()
    top.plot(range(STEPS), one_loss, color="0.2", linewidth=3, label=one)
    top.plot(range(STEPS), four_loss, color=base.rank_color(1), linestyle="--", linewidth=1.8, label=four)
    top.set_ylabel("loss (nats per token)")
    top.legend(frameon=False)
    top.set_title(f"The same training run on 1 and on 4 ranks ({PACK}-token packs, 2 per step)", loc="left")
    rel = [abs(a - b) / a for a, b in zip(four_loss, one_loss)]
    bottom.semilogy(range(STEPS), [max(r, 1e-12) for r in rel], color=base.rank_color(1), marker="o", markersize=3)
    bottom.axhline(1e-5, color="0.5", linewidth=1)
    bottom.text(STEPS - 1, 7e-6, "1e-5: the tested bound", va="top", ha="right", color="0.35")
    bottom.set_ylabel("relative difference")
    bottom.set_xlabel("step")
    return fig


# The data-path figure: a padded batch of three documents (5, 3 and 7 tokens) in rows of 8, P = 2, zigzag.
HF_LENGTHS, HF_L, HF_P = [5, 3, 7], 8, 2
DOC_COLORS = ["#4c72b0", "#dd8452", "#55a868"]


def _cells(ax, y: float, docs: list[int], masked: list[bool], title: str) -> None:
    """One row of token cells: coloured by document (-1: padding, grey), a cross where no loss is taken."""
    for x, (d, off) in enumerate(zip(docs, masked)):
        face = "0.88" if d < 0 else DOC_COLORS[d]
        ax.add_patch(Rectangle((x, y), 0.92, 0.8, facecolor=face, edgecolor="0.3", linewidth=0.6,
                               hatch="///" if d < 0 else None))  # fmt: skip
        if off and d >= 0:
            ax.text(x + 0.46, y + 0.4, "x", ha="center", va="center", color="white", fontweight="bold")
    ax.text(-0.3, y + 0.4, title, ha="right", va="center")


def hf_batch() -> Figure:
    """`figures/hf_batch.png`: a padded batch, the packed and padded stream, and each rank's shard."""
    ids = torch.zeros(len(HF_LENGTHS), HF_L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(HF_LENGTHS):
        ids[row, :n] = 10 * (row + 1) + torch.arange(n)  # token 10 d + i: document d, position i
        mask[row, :n] = 1
    shards = [cpref.hf.shard_batch({"input_ids": ids, "attention_mask": mask}, cp_size=HF_P, rank=r) for r in range(HF_P)]
    sharding = shards[0]["sharding"]
    doc_of = lambda t: -1 if t == 0 else t // 10 - 1  # noqa: E731 (padding is token 0)
    fig, ax = base.plt.subplots(figsize=(base.WIDTH, 4.3), constrained_layout=True)
    y = 0.0
    for r in reversed(range(HF_P)):  # 3) every rank's shard: tokens, and where its labels take no loss
        sh = shards[r]
        _cells(ax, y, [doc_of(int(t)) for t in sh["tokens"]], (sh["loss_mask"] == 0).tolist(), f"rank {r}'s shard")
        y += 1.1
    y += 0.5
    stream = sharding.unshard([sh["tokens"] for sh in shards])  # 2) the packed stream, each document padded for zigzag
    owner = [0] * sharding.total
    for r in range(HF_P):
        for t in sharding.global_index(r).tolist():
            owner[t] = r
    _cells(ax, y, [doc_of(int(t)) for t in stream], [False] * sharding.total, "packed, padded")
    for t, r in enumerate(owner):
        ax.text(t + 0.46, y + 1.0, str(r), ha="center", va="center", color=base.rank_color(r), fontweight="bold")
    y += 1.9
    for row in reversed(range(len(HF_LENGTHS))):  # 1) the batch as a tokenizer pads it
        _cells(ax, y, [row if m else -1 for m in mask[row].tolist()], [False] * HF_L, f"row {row}")
        y += 1.0
    ax.set_xlim(-4.2, sharding.total + 0.2)
    ax.set_ylim(-0.2, y + 0.1)
    ax.axis("off")
    ax.set_title(f"A padded batch through cpref.hf.shard_batch (P = {HF_P}, zigzag): documents packed,\n"
                 f"each padded to a multiple of 2P: {list(sharding.cu_seqlens_padded)} (number: owner rank)", loc="left")
    handles = [Patch(facecolor=c, label=f"doc {d}") for d, c in enumerate(DOC_COLORS)]
    handles += [Patch(facecolor="0.88", hatch="///", label="padding"), Patch(facecolor="white", label="x: no loss")]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    return fig


FIGURES = {"figures/parity.png": parity, "figures/hf_batch.png": hf_batch}
