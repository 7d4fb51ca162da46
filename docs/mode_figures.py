"""Figures of the CP mode pages, drawn from what a real run on the simulated cluster did.

Each function runs the mode on the simulated cluster with a recording kernel and draws what
the kernel was actually given, identified by its contents: for every call, which rank's
keys it saw (the rows of the call's `k` are matched against every rank's K shard) and how
many scores it computed; for Ulysses, which (token, head) cells of `q` each rank held. The
bytes come from the cluster's trace. A change in the code changes the figure.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

import cpref
from sim.harness import mode_trace, run_attention


def _load_figures():
    spec = importlib.util.spec_from_file_location("cpref_docs_figures_base", Path(__file__).with_name("figures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


base = _load_figures()
plt, WIDTH, rank_color, sharding = base.plt, base.WIDTH, base.rank_color, base.sharding

CU = [0, 16, 48]  # two documents of 16 and 32 tokens; multiples of 2P = 8 at P = 4
P, HQ, HKV, D = 4, 4, 2, 4


class RecordingKernel:
    """A TorchKernel that records, per forward call, whose keys it saw and the scores it computed."""

    def __init__(self, k_shards: list[torch.Tensor]) -> None:
        self.inner, self.k_shards, self.calls = cpref.TorchKernel(), k_shards, []

    def forward(self, q, k, v, seqs, **kwargs):
        # a row of k is one token's key for some heads: find the rank whose shard holds that key vector
        sources = {s for s, shard in enumerate(self.k_shards) for row in k if bool((shard == row[0]).all(-1).any())}
        self.calls.append({"sources": sources, "work": seqs.work(kwargs["causal"]), "q": q.detach().clone()})
        return self.inner.forward(q, k, v, seqs, **kwargs)

    def backward(self, *args, **kwargs):
        return self.inner.backward(*args, **kwargs)


def _run(mode: str, layout: str, **extra):
    """Forward of `mode` on P simulated ranks with recording kernels: `(kernels, cluster, q)`."""
    T = CU[-1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, HQ, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(T, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    batch = sharding(CU, P, layout)
    k_shards = [batch.shard(k, r) for r in range(P)]
    kernels = [RecordingKernel(k_shards) for _ in range(P)]
    _, cluster = run_attention(q, k, v, None, batch, mode=mode, kernels=kernels, check_ranks=False, **extra)
    return kernels, cluster, q


def _ring_panel(ax, kernels, layout: str, title: str) -> None:
    """Ranks x ring steps: whose block each rank worked on, and how many scores; blank if skipped."""
    for r, kern in enumerate(kernels):
        by_step = {}
        for call in kern.calls:
            (source,) = call["sources"]
            by_step[(r - source) % P] = (source, call["work"])
        for t in range(P):
            if t in by_step:
                source, work = by_step[t]
                ax.add_patch(Rectangle((t, r), 1, 1, facecolor=rank_color(source), edgecolor="white", linewidth=2))
                ax.text(t + 0.5, r + 0.5, f"K/V of r{source}\n{work} scores", ha="center", va="center", color="white")
            else:
                ax.add_patch(Rectangle((t, r), 1, 1, facecolor="0.92", edgecolor="white", linewidth=2, hatch="//"))
                ax.text(t + 0.5, r + 0.5, "skipped", ha="center", va="center", color="0.35")
    ax.set_xlim(0, P)
    ax.set_ylim(P, 0)
    ax.set_xticks([t + 0.5 for t in range(P)], [f"step {t}" for t in range(P)])
    ax.set_yticks([r + 0.5 for r in range(P)], [f"rank {r}" for r in range(P)])
    ax.tick_params(length=0)
    ax.set_title(title, loc="left")


def ring_schedule() -> Figure:
    """`figures/ring_schedule.png`: the ring's steps, zigzag against contiguous, causal."""
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH, 7.4), constrained_layout=True)
    for ax, layout in zip(axes, ("zigzag", "contiguous")):
        kernels, cluster, _ = _run("p2p", layout)
        shifts = [ev for ev in mode_trace(cluster) if ev.op == "send_recv"]
        _ring_panel(ax, kernels, layout, f"{layout}: {len(shifts)} shifts of {shifts[0].bytes_sent[0]} bytes per rank")
    fig.suptitle(f"Ring attention, P = {P}, cu_seqlens = {CU}: the block each rank computes on")
    return fig


def hierarchical_schedule() -> Figure:
    """`figures/hierarchical_schedule.png`: a2a groups of 2, a ring of 2 across them (zigzag, causal)."""
    kernels, cluster, _ = _run("a2a+p2p", "zigzag", a2a_size=2)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6), constrained_layout=True)
    a, p = 2, P // 2
    for r, kern in enumerate(kernels):
        for t, call in enumerate(kern.calls):
            groups = sorted({s // a for s in call["sources"]})
            label = "K/V of group " + ", ".join(f"g{x}" for x in groups)
            ax.add_patch(Rectangle((t, r), 1, 1, facecolor=rank_color(4 + groups[0]), edgecolor="white", linewidth=2))
            ax.text(t + 0.5, r + 0.5, f"{label}\n{call['work']} scores", ha="center", va="center", color="white")
    ax.set_xlim(0, p)
    ax.set_ylim(P, 0)
    ax.set_xticks([t + 0.5 for t in range(p)], [f"ring step {t}" for t in range(p)])
    ax.set_yticks([r + 0.5 for r in range(P)], [f"rank {r} (a2a group {r // a})" for r in range(P)])
    ax.tick_params(length=0)
    ops = sorted({ev.op for ev in mode_trace(cluster)} - {"split"})
    ax.set_title(f"a2a+p2p, a2a_size = {a}: collectives {', '.join(ops)}", loc="left")
    return fig


def ulysses_exchange() -> Figure:
    """`figures/ulysses_exchange.png`: who holds which (token, head) before and after the all-to-all."""
    kernels, _, q = _run("a2a", "zigzag")
    T = CU[-1]
    before, batch = torch.full((HQ, T), -1), sharding(CU, P, "zigzag")
    for r in range(P):
        before[:, batch.global_index(r)] = r
    after = torch.full((HQ, T), -1)
    for r, kern in enumerate(kernels):
        held = kern.calls[0]["q"]  # (T, Hq/P, D): what the rank's kernel call was given
        for h in range(HQ):
            if any(torch.equal(held[:, j], q[:, h]) for j in range(held.shape[1])):
                after[h] = r
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH, 4.6), constrained_layout=True)
    for ax, grid, title in ((axes[0], before, "before: every rank holds T/P tokens (zigzag) of all heads"),
                            (axes[1], after, "after the all-to-all: every rank holds all T tokens of H/P heads")):  # fmt: skip
        colors = torch.tensor([rank_color(int(x)) for x in grid.flatten()]).reshape(HQ, T, 3)
        ax.imshow(colors.numpy(), aspect="auto", interpolation="nearest")
        ax.set_yticks(range(HQ), [f"head {h}" for h in range(HQ)])
        ax.set_xticks([c - 0.5 for c in CU], [str(c) for c in CU])
        ax.set_xlabel("token (document boundaries marked)")
        ax.set_title(title, loc="left")
    fig.legend(handles=[Patch(color=rank_color(r), label=f"rank {r}") for r in range(P)], loc="outside lower center",
               ncols=P, frameon=False)  # fmt: skip
    return fig


FIGURES = {
    "figures/ring_schedule.png": ring_schedule,
    "figures/hierarchical_schedule.png": hierarchical_schedule,
    "figures/ulysses_exchange.png": ulysses_exchange,
}
