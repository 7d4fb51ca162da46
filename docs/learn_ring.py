"""The ring page's figures: its steps, forward and backward, from one real run, as frames and as an animation.

One run of `p2p` on the simulated cluster (`docs/learn_runs.py`) with every kernel call and ring
shift recorded. The forward's steps are read from the kernel calls (whose keys each call saw).
The backward's shifts are identified by their contents: a payload equal to some rank's K/V
shard is that block travelling; any other is a dK/dV accumulator, recognised by matching it
against the partial sums of every rank's share of every block's gradient (computed apart, with
the FP64 oracle): so the frames show which ranks' shares an accumulator held when it moved,
as the run moved it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from docs import figures as base
from docs.learn_runs import Run, example, ops_text, run, split_trace
from sim import oracle

plt, WIDTH, rank_color = base.plt, base.WIDTH, base.rank_color



@dataclass(frozen=True)
class Step:
    """What rank `rank` did at ring step `t` of one pass."""

    rank: int
    t: int
    block: int  # whose K/V block it held
    scores: frozenset  # the (query, key) scores its kernel calls computed
    shares: int = 0  # backward: how many ranks' shares the block's dK/dV accumulator held when it moved on


def _shares(r: Run) -> dict[tuple[int, int], torch.Tensor]:
    """`(block s, m)` -> the dK/dV of rank s's keys summed over the shares of ranks s, s + 1, .., s + m (mod P),
    in the shard's row order, as `(T_l, Hkv, D + Dv)`: what the accumulator holds after m + 1 ranks."""
    P, T = r.P, r.sharding.total
    owner = torch.tensor(r.owner())
    share = []
    for rank in range(P):  # rank's queries' share of every key's gradient
        dout = r.dout * (owner == rank)[:, None, None]  # (T, Hq, Dv): only its queries
        _, _, _, dk, dv = oracle.forward_backward(r.q, r.k, r.v, torch.tensor([0, T]), dout)
        share.append(torch.cat([dk, dv], dim=-1))  # (T, Hkv, D + Dv)
    sums = {}
    for s in range(P):
        total = torch.zeros_like(r.sharding.shard(share[0], s))
        for m in range(P):
            total = total + r.sharding.shard(share[(s + m) % P], s)
            sums[(s, m)] = total
    return sums


def steps(r: Run) -> tuple[list[Step], list[Step]]:
    """`(forward, backward)`: every rank's steps, read from its kernel calls and its shifts' payloads."""
    P, owner = r.P, r.owner()
    forward, d = [], r.k.shape[-1]
    for rank in range(P):
        by_block: dict[int, set] = {}
        for call in r.calls(rank, "forward"):
            (block,) = {owner[t] for t in call.k_tokens}  # a call sees one rank's block
            by_block.setdefault(block, set()).update(r.scores(call))
        sent = [x for phase, x, _ in r.comms[rank].shifts if phase == "forward"]  # the block held at step t
        for t in range(P):  # a step whose block no query here sees makes no call: skipped, the block still held
            block = (rank - t) % P
            assert t == P - 1 or torch.equal(sent[t][..., :d], r.sharding.shard(r.k, block)), "step t holds rank r - t's block"
            forward.append(Step(rank, t, block, frozenset(by_block.pop(block, ()))))
        assert not by_block, "every call's block is the one its step holds"
    sums = _shares(r)
    # which ranks' shares are not zero (contiguous: only ranks at or after the block's see its keys)
    nonzero = {b: [bool(sums[(b, m)].ne(sums[(b, m - 1)] if m else 0).any()) for m in range(P)] for b in range(P)}
    k_shards = [r.sharding.shard(r.k, s) for s in range(P)]
    backward = []
    for rank in range(P):
        scores = {}
        for call in r.calls(rank, "backward"):
            (block,) = {owner[t] for t in call.k_tokens}
            scores.setdefault(block, set()).update(r.scores(call))
        moved = [x for phase, x, _ in r.comms[rank].shifts if phase == "backward"]
        accumulators = [x for x in moved if not any(torch.equal(x[..., :d], ks) for ks in k_shards)]
        for t, x in enumerate(accumulators):  # at step t, the block of rank r - t, holding the shares of t + 1 ranks
            block = (rank - t) % P
            assert torch.allclose(x, sums[(block, t)], atol=1e-10, rtol=0), "step t's accumulator: t + 1 shares"
            backward.append(Step(rank, t, block, frozenset(scores.get(block, ())), nonzero[block][: t + 1].count(True)))
    return forward, backward


@functools.cache
def ring_run() -> tuple[Run, list[Step], list[Step]]:
    """The one run both figures draw: `p2p` forward and backward, and its steps."""
    g = example("ring")  # the page's example: its sizes, its layout (contiguous, as its by-hand code)
    r = run("p2p", [0, g["T"]], g["P"], "contiguous", (g["H"], g["H"], g["D"], g["D"]))
    return (r, *steps(r))


def _cell(ax: Axes, t: float, rank: int, color, text: str, faint: bool = False) -> None:
    ax.add_patch(Rectangle((t + 0.04, rank + 0.06), 0.92, 0.88, facecolor=color, alpha=0.35 if faint else 1.0,
                           edgecolor="none"))  # fmt: skip
    ax.text(t + 0.5, rank + 0.5, text, ha="center", va="center", color="0.1" if faint else "white")


def _grid(ax: Axes, P: int, columns: list[str], title: str) -> None:
    for rank in range(P - 1):  # a block moves on to the next rank at every step (the last rank's to rank 0)
        for t in range(len(columns) - 2):
            ax.add_patch(FancyArrowPatch((t + 0.9, rank + 0.75), (t + 1.1, rank + 1.25), arrowstyle="-|>",
                                         mutation_scale=10, color="0.35", zorder=3))  # fmt: skip
    ax.set_xlim(0, len(columns))
    ax.set_ylim(P, 0)
    ax.set_xticks([c + 0.5 for c in range(len(columns))], columns)
    ax.xaxis.tick_top()
    ax.set_yticks([r + 0.5 for r in range(P)], [f"rank {r}" for r in range(P)])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, loc="left")


def ring_frames() -> Figure:
    """`figures/learn/ring_frames.png`: every rank at every step of a real ring forward and backward."""
    r, forward, backward = ring_run()
    P = r.P
    fwd, bwd = split_trace(r.trace)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH, 7.6), constrained_layout=True)
    for s in forward:
        text = f"K/V of r{s.block}\n" + (f"{len(s.scores)} scores" if s.scores else "skipped")
        _cell(top, s.t, s.rank, rank_color(s.block), text, faint=not s.scores)
    for rank in range(P):
        merged = sum(x.rank == rank and bool(x.scores) for x in forward)
        _cell(top, P, rank, rank_color(rank), f"out: {merged} block{'s' * (merged > 1)}\nmerged", faint=True)
    _grid(top, P, [f"step {t}" for t in range(P)] + ["result"],
          f"forward: {ops_text(fwd)} of K/V (the bytes: the example below, in bf16)")  # fmt: skip
    for s in backward:
        _cell(bottom, s.t, s.rank, rank_color(s.block), f"K/V of r{s.block}\ndK/dV: {s.shares} rank{'s' * (s.shares > 1)}",
              faint=not s.scores)  # fmt: skip
    for s in backward:
        if s.t == P - 1:  # the last step's accumulators go home: one more shift
            home = (s.rank + 1) % P
            assert s.block == home and s.shares == P - home, "contiguous: the ranks from the block's own on see its keys"
            _cell(bottom, P, home, rank_color(home), f"dK/dV of r{home}\n{s.shares} rank{'s' * (s.shares > 1)}", faint=True)
    n_acc = sum(s.rank == 0 for s in backward)  # the accumulators rank 0 sent, identified by content
    n_kv = sum(phase == "backward" for phase, _, _ in r.comms[0].shifts) - n_acc
    _grid(bottom, P, [f"step {t}" for t in range(P)] + ["home"],
          f"backward: {ops_text(bwd)}: {n_kv} of K/V, {n_acc} of dK/dV accumulators (the last one home)")  # fmt: skip
    fig.suptitle(f"p2p, P = {P}, one document of {r.sharding.total} tokens (contiguous), float64: each rank at each step\n"
                 "(colour: whose block; faint: a step whose keys no query of the rank sees, skipped)")
    return fig


CORNERS = [(0.0, 1.0), (1.0, 1.0), (1.0, 0.0), (0.0, 0.0)]  # rank r's place in the ring diagram: clockwise


def _ring_panel(ax: Axes, held: dict[int, tuple[int, str]]) -> None:
    """The ranks on a ring, each with the block it holds (`held[rank] = (block, text)`), arrows to the next."""
    P = len(CORNERS)
    for i in range(P):
        ax.add_patch(FancyArrowPatch(CORNERS[i], CORNERS[(i + 1) % P], arrowstyle="-|>", mutation_scale=14,
                                     shrinkA=34, shrinkB=34, color="0.45", linewidth=1.5))  # fmt: skip
    for rank, (x, y) in enumerate(CORNERS):
        block, text = held[rank]
        ax.add_patch(Rectangle((x - 0.3, y - 0.17), 0.6, 0.34, facecolor=rank_color(block), edgecolor="none"))
        ax.text(x, y, text, ha="center", va="center", color="white")
        ax.text(x, y + (0.22 if y > 0.5 else -0.22), f"rank {rank}", ha="center", va="bottom" if y > 0.5 else "top")
    ax.set_xlim(-0.4, 1.4)
    ax.set_ylim(-0.45, 1.45)
    ax.set_aspect("equal")
    ax.axis("off")


def _mask_panel(ax: Axes, r: Run, done: set, now: set, title: str) -> None:
    """The causal mask: scores computed at earlier steps faint, this step's full, each in its key's block colour."""
    T, owner = r.sharding.total, r.owner()
    image = torch.ones(T, T, 3)
    for x in range(T):
        for y in range(x + 1):
            image[x, y] = torch.tensor([0.93] * 3)  # visible, not yet computed
    for cells, alpha in ((done, 0.3), (now, 1.0)):
        for x, y in cells:
            image[x, y] = 1 - alpha * (1 - torch.tensor(rank_color(owner[y])))
    ax.imshow(image.numpy(), interpolation="nearest", extent=(0, T, T, 0))
    for x in range(T):  # a strip left of the mask: the rank holding each query
        ax.add_patch(Rectangle((-2.2, x), 1.4, 1, facecolor=rank_color(owner[x]), edgecolor="none", clip_on=False))
    ax.set_xlim(0, T)
    ax.set_xticks(range(0, T + 1, 8))
    ax.set_yticks(range(0, T + 1, 8))
    ax.set_xlabel("key token")
    ax.set_ylabel("query token (strip: its rank)")
    ax.tick_params(axis="y", pad=16)
    ax.set_title(title, loc="left")


def ring_animation() -> list[Figure]:
    """`figures/learn/ring.gif`: the run of `ring_frames`, one frame per step: the ring and the scores computed."""
    r, forward, backward = ring_run()
    P, frames = r.P, []
    passes = [("forward", forward, lambda s: f"K/V r{s.block}" + ("" if s.scores else "\nskipped")),
              ("backward", backward, lambda s: f"K/V r{s.block}\ndK/dV: {s.shares}")]  # fmt: skip
    for name, pass_steps, label in passes:
        done: set = set()
        for t in range(P):
            at = {s.rank: s for s in pass_steps if s.t == t}
            now = set().union(*(s.scores for s in at.values()))
            fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 3.7), constrained_layout=True, width_ratios=[1, 1])
            _ring_panel(left, {rank: (s.block, label(s)) for rank, s in at.items()})
            fig.suptitle(f"forward, step {t}: every rank attends its queries to the K/V block it holds (or skips\n"
                         "a block its queries do not see), merges the result by lse, passes the block on" if name == "forward" else
                         f"backward, step {t}: every rank adds its share of the block's dK/dV to the accumulator\n"
                         "that travels with the block (dK/dV: n ranks' shares), then passes both on")  # fmt: skip
            _mask_panel(right, r, done, now, "scores: this step (full), earlier (faint)")
            done |= now
            frames.append(fig)
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 3.7), constrained_layout=True, width_ratios=[1, 1])
    _ring_panel(left, {rank: (rank, f"dK/dV r{rank}\n{P - rank} rank{'s' * (rank < P - 1)}") for rank in range(P)})
    fig.suptitle("backward, home: one more shift brings each accumulator, with the shares of every\n"
                 "rank whose queries saw its keys, to the keys' rank: dK and dV are complete")
    _mask_panel(right, r, done, set(), "every score computed once per pass")
    frames.append(fig)
    return frames
