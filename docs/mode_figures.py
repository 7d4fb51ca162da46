"""Figures of the CP mode pages, drawn from what a real run on the simulated cluster did.

Each function runs the mode on the simulated cluster with a recording kernel and draws what
the kernel was actually given, identified by its contents: for every call, which rank's
keys it saw (the rows of the call's `k` are matched against every rank's K shard) and how
many scores it computed; for Ulysses, which (token, head) cells of `q` each rank held; for the
ring under a window, which keys each ring shift carried (the rows of every payload are matched
against the global K). The bytes come from the cluster's trace. A change in the code changes
the figure.
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

import cpref
from cpref.kernels.contract import NO_WINDOW
from docs import figures as base
from sim.cluster.harness import mode_trace, run_attention
from sim.cluster.simcluster import SimCluster
from sim.oracle import visibility_mask

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
        work = seqs.work(kwargs["causal"], kwargs.get("window", NO_WINDOW))
        self.calls.append({"sources": sources, "work": work, "q": q.detach().clone()})
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


class _RingRecorder:
    """A rank's kernel and collectives for the ring's frames: every kernel call's K/V block (by whose keys it saw)
    and, in the backward, its dK/dV share on that block's rows; every ring shift's payload, in order."""

    def __init__(self, comm, kv_shards: list[torch.Tensor]) -> None:
        self._comm, self._kernel, self.kv_shards = comm, cpref.TorchKernel(), kv_shards
        self.forward_calls, self.shares, self.sent, self.phase = [], {}, {"forward": [], "backward": []}, "forward"

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def send_recv_async(self, x: torch.Tensor, shift: int = 1):
        self.sent[self.phase].append((x.detach().clone(), shift))
        return self._comm.send_recv_async(x, shift)

    def _rows(self, k: torch.Tensor) -> tuple[int, list[int]]:
        """`(s, rows)`: the rank whose block holds these keys, and the rows of its block they are."""
        found = [(s, [int((shard[:, :, :D] == row).all(-1).all(-1).nonzero()[0]) for row in k])
                 for s, shard in enumerate(self.kv_shards) if all((shard[:, :, :D] == row).all(-1).all(-1).any() for row in k)]  # fmt: skip
        (only,) = found  # random keys: exactly one rank holds them
        return only

    def forward(self, q, k, v, seqs, **kwargs):
        self.forward_calls.append((self._rows(k)[0], seqs.work(kwargs["causal"])))
        return self._kernel.forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        dq, dk, dv = self._kernel.backward(dout, q, k, v, out, lse, seqs, **kwargs)
        s, rows = self._rows(k)
        share = self.shares.setdefault(s, torch.zeros_like(self.kv_shards[s]))  # (T_l, Hkv, D + Dv)
        share.index_add_(0, torch.tensor(rows), torch.cat([dk, dv], dim=-1).to(share.dtype))
        return dq, dk, dv


def _ring_run(layout: str = "zigzag"):
    """Forward + backward of `p2p` on P simulated ranks, recorded: `(recorders, forward bytes, backward bytes)`, the
    bytes of each ring shift as the cluster's trace counted them (the forward's K/V; the backward's K/V, dK/dV)."""
    T, g = CU[-1], torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(T, HQ if i in (0, 3) else HKV, D, generator=g, dtype=torch.float64) for i in range(4))
    batch = sharding(CU, P, layout)
    kv_shards = [torch.cat([batch.shard(k, r), batch.shard(v, r)], dim=-1) for r in range(P)]  # (T_l, Hkv, D + Dv)
    recorders, cluster = [None] * P, SimCluster(P, timeout=60.0)

    def rank_fn(comm):
        rec = recorders[comm.rank] = _RingRecorder(comm, kv_shards)
        local = [batch.shard(t, comm.rank).requires_grad_(True) for t in (q, k, v)]
        out = cpref.attention(*local, batch, comm=rec, mode="p2p", kernel=rec, check_ranks=False)
        comm.barrier()  # the forward's end, in the trace
        rec.phase = "backward"
        out.backward(batch.shard(dout, comm.rank))

    cluster.run(rank_fn)
    trace = mode_trace(cluster)
    cut = next(i for i, ev in enumerate(trace) if ev.op == "barrier")
    shifts = [sorted({ev.bytes_sent[0] for ev in part if ev.op == "send_recv"}) for part in (trace[:cut], trace[cut:])]
    return recorders, shifts[0], shifts[1]


def _identify(payload: torch.Tensor, recorders, kv_shards) -> tuple[str, int, list[int]]:
    """What a ring shift carried, from its contents: `("kv", s, [])` the K/V block of rank `s`, or `("dkv", s, ranks)`
    the dK/dV accumulator of block `s` holding the shares of `ranks` (in ring order from `s`), and no other's."""
    for s, shard in enumerate(kv_shards):
        if torch.equal(payload, shard):
            return "kv", s, []
    found = []
    for s in range(P):
        ranks = [(s + i) % P for i in range(P)]
        for n in range(1, P + 1):
            total = sum(recorders[r].shares[s] for r in ranks[:n])
            if torch.allclose(payload, total, rtol=1e-12, atol=1e-12):
                found.append(("dkv", s, ranks[:n]))
    (only,) = found  # zigzag: every rank adds a nonzero share to every block, so the sum names its ranks
    return only


def _chip(ax, x: float, y: float, w: float, h: float, color, text: str, filled: bool = True) -> None:
    """A labelled block of a frame: filled in `color` (white text), or outlined in it (dark text)."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color if filled else "white", edgecolor=color, linewidth=2))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", color="white" if filled else "0.1")


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], color, head: bool = True) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>" if head else "-", mutation_scale=14, color=color,
                                 linewidth=2, shrinkA=0, shrinkB=0))  # fmt: skip


def _shift_arrows(ax, sent: list[tuple[int, int, int]], y0: float, y1: float) -> None:
    """Each shift `(from rank, to rank, block owner)` as an arrow from the bottom of one frame's cell to the top of the
    next frame's, in the owner's colour; one that wraps round the ring leaves at the right and comes back at the left."""
    for src, dst, owner in sent:
        color, mid = rank_color(owner), (y0 + y1) / 2
        if dst > src:
            _arrow(ax, (src + 0.5, y0), (dst + 0.5, y1), color)
        else:  # the ring closes: out at the right edge, back in at the left
            _arrow(ax, (src + 0.5, y0), (P - 0.02, mid), color, head=False)
            _arrow(ax, (0.02, mid), (dst + 0.5, y1), color)


def _frames_axes(ax, labels: list[str], pitch: float, bottom: float, title: str) -> None:
    """The frames' axes: a column per rank, a row per frame (labelled), the last frame's cells `bottom` tall."""
    ax.set_xlim(0, P)
    ax.set_ylim((len(labels) - 1) * pitch + bottom + 0.05, -0.1)
    ax.set_xticks([r + 0.5 for r in range(P)], [f"rank {r}" for r in range(P)])
    ax.xaxis.tick_top()
    ax.set_yticks([i * pitch + 0.3 for i in range(len(labels))], labels)
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    ax.set_title(title, loc="left")


def ring_forward() -> Figure:
    """`figures/ring_forward.png`: the ring's forward step by step, from a real run: the block each rank computes on
    (identified from its kernel call's keys), the blocks its running output has merged, and the shifts between steps
    (identified from their payloads)."""
    recorders, (nbytes,), _ = _ring_run()
    kv_shards = recorders[0].kv_shards
    pitch, h, ho = 1.7, 0.5, 0.72
    fig, ax = plt.subplots(figsize=(WIDTH, 0.9 + 0.55 * pitch * P), constrained_layout=True)
    for r, rec in enumerate(recorders):
        sources = [s for s, _ in rec.forward_calls]  # zigzag: one call a step, on the block of rank r - t
        for t, s in enumerate(sources):
            assert s == (r - t) % P, f"rank {r}, step {t}: the block of rank {s}"
            y = t * pitch
            _chip(ax, r + 0.06, y, 0.24, h, rank_color(r), "Q")
            _chip(ax, r + 0.32, y, 0.62, h, rank_color(s), f"K/V r{s}")
            _slots(ax, r, y + h + 0.1, ho, rank_color(r), f"O, lse of Q{r}", sources[: t + 1])
    for t in range(P - 1):
        sent = []
        for r, rec in enumerate(recorders):
            payload, shift = rec.sent["forward"][t]
            kind, s, _ = _identify(payload, recorders, kv_shards)
            assert kind == "kv" and s == (r - t) % P, f"rank {r} sent {kind} of rank {s} after step {t}"
            sent.append((r, (r + shift) % P, s))
        _shift_arrows(ax, sent, t * pitch + h + 0.1 + ho + 0.06, (t + 1) * pitch - 0.04)
    _frames_axes(ax, [f"step {t}" for t in range(P)], pitch, h + 0.1 + ho,
                 f"forward: Q stays, each K/V block moves one rank on a step ({nbytes} B a shift),\n"
                 "and each step's partial result merges into the running O, lse by their lse")  # fmt: skip
    fig.suptitle(f"Ring attention, P = {P}, zigzag, cu_seqlens = {CU}: a real forward, step by step")
    return fig


def _slots(ax, r: int, y: float, h: float, edge, label: str, filled: list[int]) -> None:
    """Rank `r`'s running sum: outlined in `edge`, labelled, with a slot per rank, filled in the colour of each
    rank in `filled` (whose block's result, or whose share, it holds)."""
    ax.add_patch(Rectangle((r + 0.06, y), 0.88, h, facecolor="white", edgecolor=edge, linewidth=2))
    ax.text(r + 0.5, y + 0.2, label, ha="center", va="center", color="0.1")
    for i in range(P):
        ax.add_patch(Rectangle((r + 0.14 + 0.185 * i, y + 0.38), 0.16, h - 0.46, linewidth=1,
                               facecolor=rank_color(i) if i in filled else "white",
                               edgecolor=rank_color(i) if i in filled else "0.7"))  # fmt: skip


def ring_backward() -> Figure:
    """`figures/ring_backward.png`: the ring's backward step by step, from a real run: each dK/dV accumulator travels
    with its block, collecting every rank's share (identified from the payload's contents), then goes home."""
    recorders, _, sizes = _ring_run()
    kv_shards = recorders[0].kv_shards
    kv_sent, acc_sent = [], []  # per rank, in order: the K/V blocks it sent; (block, ranks whose shares, shift)
    for rec in recorders:
        ids = [(_identify(x, recorders, kv_shards), shift) for x, shift in rec.sent["backward"]]
        kv_sent.append([s for (kind, s, _), _ in ids if kind == "kv"])
        acc_sent.append([(s, ranks, shift) for (kind, s, ranks), shift in ids if kind == "dkv"])
    pitch, h, hd = 1.9, 0.5, 0.72
    fig, ax = plt.subplots(figsize=(WIDTH, 0.6 + 0.5 * pitch * (P + 1)), constrained_layout=True)
    for t in range(P):
        y, moves = t * pitch, []
        for r in range(P):
            s, ranks, shift = acc_sent[r][t]  # the accumulator rank r passes on after step t: of the block it held
            assert s == (r - t) % P and ranks[-1] == r, f"rank {r}, step {t}: passed on block {s}'s, from {ranks}"
            assert t == P - 1 or kv_sent[r][t] == s, f"rank {r}, step {t}: sent K/V of {kv_sent[r][t]}, held {s}"
            _chip(ax, r + 0.06, y, 0.24, h, rank_color(r), "Q")
            _chip(ax, r + 0.32, y, 0.62, h, rank_color(s), f"K/V r{s}")
            _slots(ax, r, y + h + 0.1, hd, rank_color(s), f"dK/dV r{s}", ranks)
            moves.append((r, (r + shift) % P, s))
        _shift_arrows(ax, moves, y + h + 0.1 + hd + 0.06, (t + 1) * pitch - 0.04)
    for r in range(P):  # home: what the last shift brought
        (s, ranks, shift), src = next((a[P - 1], q) for q, a in enumerate(acc_sent) if (q + a[P - 1][2]) % P == r)
        assert s == r and sorted(ranks) == list(range(P)), f"rank {r} got back block {s}'s, with the shares of {ranks}"
        _slots(ax, r, P * pitch, hd, rank_color(s), f"dK/dV r{s}", ranks)
    kv_bytes, acc_bytes = sizes[0], sizes[-1]
    _frames_axes(ax, [f"step {t}" for t in range(P)] + ["home"], pitch, hd,
                 "backward: each dK/dV accumulator travels with its block, gathering every\nrank's share, "
                 f"and one more shift brings it home (K/V {kv_bytes} B, dK/dV {acc_bytes} B a shift)")  # fmt: skip
    fig.suptitle(f"Ring attention, P = {P}, zigzag, cu_seqlens = {CU}: a real backward, step by step")
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


# The window figure's batch: two documents of 32 tokens, chunks of 8 (contiguous) and 4 (zigzag) at P = 4;
# a causal window of 4 keys (3 before each query): a zigzag chunk, half a contiguous one.
WINDOW_CU, WINDOW = [0, 32, 64], (3, 0)
DROPPED = (0.88, 0.88, 0.88)  # grey: what only the ring without a window computes or sends


class RecordingComm:
    """A rank's collectives that keep a copy of what each ring shift sent, and its shift; the rest is forwarded."""

    def __init__(self, comm) -> None:
        self._comm, self.sent = comm, []

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def send_recv_async(self, x: torch.Tensor, shift: int = 1):
        self.sent.append((x.detach().clone(), shift))
        return self._comm.send_recv_async(x, shift)


def _travel(window: tuple[int, int], layout: str, chunk: int | None = None) -> tuple[torch.Tensor, list[int], int, list[int]]:
    """A forward of `p2p` under `window` (`NO_WINDOW`: the plain ring; `chunk`: chunked attention) with recording
    comms and kernels:
    `(grid (P - 1, T), rows, bytes, work)`. `grid[d - 1, y]` is the rank whose key `y` reached the rank `d` after
    it (-1: key `y` did not travel `d` ranks), `rows` the rows of each shift's payload (padding included),
    `bytes` one rank's forward traffic (from the trace), `work[r]` the scores rank `r`'s kernel calls computed."""
    T, g = WINDOW_CU[-1], torch.Generator().manual_seed(0)
    q = torch.randn(T, HQ, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(T, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    batch, cluster = sharding(WINDOW_CU, P, layout), SimCluster(P, timeout=60.0)
    kernels = [RecordingKernel([batch.shard(k, r) for r in range(P)]) for _ in range(P)]

    def rank_fn(comm):
        recording = RecordingComm(comm)
        cpref.attention(*(batch.shard(x, comm.rank) for x in (q, k, v)), batch, comm=recording, mode="p2p",
                        kernel=kernels[comm.rank], window=window, chunk=chunk, check_ranks=False)  # fmt: skip
        return recording.sent

    sent, owner = cluster.run(rank_fn), torch.tensor(base.owner_of_tokens(WINDOW_CU, P, layout))
    grid = torch.full((P - 1, T), -1)
    for r in range(P):
        for payload, shift in sent[r]:
            holds = (payload[:, None, :, :D] == k[None]).all(-1).all(-1)  # (m, T): payload row i is key y
            keys = holds.nonzero()[:, 1]  # (n,): zero rows, padding up to the shift's size, are no key
            if not len(keys):
                continue
            (source,) = owner[keys].unique().tolist()  # a shift carries one rank's keys (the ring: not the sender's)
            grid[(r + shift - source) % P - 1, keys] = source  # they arrive at rank r + shift
    nbytes = sum(ev.bytes_sent[0] for ev in mode_trace(cluster) if ev.op == "send_recv")
    return grid, [len(payload) for payload, _ in sent[0]], nbytes, [sum(c["work"] for c in kern.calls) for kern in kernels]


def _window_mask_panel(ax, layout: str, work: list[int], window=WINDOW, chunk: int | None = None) -> None:
    """The causal mask under the window or the chunks (`sim.oracle`), each visible score in its query's rank's
    colour, grey the scores they drop; checked against the scores the run's kernel calls computed."""
    cu = torch.tensor(WINDOW_CU)
    seen, causal = visibility_mask(cu, window=window, chunk=chunk), visibility_mask(cu)  # (T, T) each
    owner = torch.tensor(base.owner_of_tokens(WINDOW_CU, P, layout))  # (T,)
    counted = [int(seen[owner == r].sum()) for r in range(P)]
    assert counted == work, f"{layout}: the mask's scores per rank {counted} != the kernel calls' {work}"
    image = torch.ones(*seen.shape, 3)  # (T, T, 3): white where nothing is seen
    image[causal & ~seen] = torch.tensor(DROPPED)
    image[seen] = torch.tensor([rank_color(int(r)) for r in owner])[:, None].expand_as(image)[seen]  # (n, 3)
    ax.imshow(image.numpy(), interpolation="nearest", extent=(0, cu[-1], cu[-1], 0))
    for b in WINDOW_CU[1:-1]:  # document boundaries
        ax.axhline(b, color="black", linewidth=1.2)
        ax.axvline(b, color="black", linewidth=1.2)
    ax.set_xticks(WINDOW_CU)
    ax.set_yticks(WINDOW_CU)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("key token")
    ax.set_title(f"{layout}: {', '.join(map(str, work))} scores", loc="left")


def _travel_panel(ax, layout: str, grid: torch.Tensor, plain: torch.Tensor) -> None:
    """One row per distance `d`: the keys that reached the rank `d` after their owner, in the owner's colour;
    grey the keys the ring without a window moves there too (every block, to every rank)."""
    image = torch.ones(*grid.shape, 3)  # (P - 1, T, 3)
    image[plain >= 0] = torch.tensor(DROPPED)
    for r in range(P):
        image[grid == r] = torch.tensor(rank_color(r))
    ax.imshow(image.numpy(), interpolation="nearest", aspect="auto", extent=(0, grid.shape[1], P, 1))
    for r in range(P):
        for _, start, _ in sharding(WINDOW_CU, P, layout).local_chunks(r):
            ax.axvline(start, color="0.3", linewidth=0.6)  # chunk edges
    for t in range(2, P):
        ax.axhline(t, color="white", linewidth=3)
    for b in WINDOW_CU[1:-1]:
        ax.axvline(b, color="black", linewidth=1.2)
    ax.set_yticks([t + 0.5 for t in range(1, P)], [f"{t} rank{'s' * (t > 1)} on" for t in range(1, P)])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("key token")


def _ring_figure(window: tuple[int, int], chunk: int | None, what: str, title: str) -> Figure:
    """Who computes the scores a mask leaves (`window`, `chunk`) and which keys the ring moves, against the plain
    ring (`what`: the mask's name in the legend and captions)."""
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH, 6.4), sharex="col", constrained_layout=True,
                             gridspec_kw={"height_ratios": [3.2, 1.0]})  # fmt: skip
    for col, layout in enumerate(("zigzag", "contiguous")):
        grid, rows, nbytes, work = _travel(window, layout, chunk)
        plain, plain_rows, plain_bytes, _ = _travel(NO_WINDOW, layout)
        _window_mask_panel(axes[0, col], layout, work, window, chunk)
        _travel_panel(axes[1, col], layout, grid, plain)
        axes[1, col].set_title(f"sent: {' + '.join(map(str, rows))} rows, {nbytes} B\n"
                               f"no {what}: {sum(plain_rows)} rows, {plain_bytes} B", loc="left")  # fmt: skip
    axes[0, 0].set_ylabel("query token")
    handles = [Patch(color=rank_color(r), label=f"rank {r}") for r in range(P)]
    handles.append(Patch(color=DROPPED, label=f"without the {what} only"))
    fig.legend(handles=handles, loc="outside lower center", ncols=3, frameon=False)
    fig.suptitle(f"Ring, causal, {title}, cu_seqlens = {WINDOW_CU}, P = {P}:\n"
                 "above, who computes each score; below, the keys sent d ranks on")  # fmt: skip
    return fig


def window_ring() -> Figure:
    """`figures/window_ring.png`: who computes the scores a causal window leaves, and which keys the ring moves."""
    return _ring_figure(WINDOW, None, "window", f"window = {WINDOW} ({WINDOW[0] + 1} keys)")


CHUNK = 10  # chunked attention's C for the figure: chunks [0, 10), [10, 20), [20, 30), [30, 32) of each document


def chunked_ring() -> Figure:
    """`figures/chunked_ring.png`: who computes the scores chunked attention leaves, and which keys the ring moves."""
    return _ring_figure(NO_WINDOW, CHUNK, "chunks", f"chunk = {CHUNK} positions")


def _bytes_per_rank(mode: str, batch: cpref.Sharding, **options) -> list[int]:
    """Forward + backward of `mode` on the simulated cluster: the bytes each rank sent, from the trace."""
    T, Pb = batch.total, batch.cp_size
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(T, HQ, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(T, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    _, cluster = run_attention(q, k, v, dout, batch, mode=mode, check_ranks=False, **options)
    events = mode_trace(cluster)
    return [sum(ev.bytes_sent[ev.group.index(r)] for ev in events if r in ev.group) for r in range(Pb)]


def split_traffic() -> Figure:
    """`figures/split_traffic.png`: own and shared rows per rank under balanced, and what the split modes send."""
    from cpref.modes.ulysses_split import split_rows

    lengths = base._long_tail()
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    batches = {layout: cpref.Sharding.eod_padded(cu, cp_size=P, layout=layout) for layout in ("zigzag", "balanced")}
    bal = batches["balanced"]
    splits = [split_rows(bal.bounds, P, r, "balanced", torch.device("cpu"), group=P, causal=True, window=(-1, -1)) for r in range(P)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH, 5.4), constrained_layout=True)
    own = [len(s.own) for s in splits]
    shared = [len(s.shared) for s in splits]
    top.barh(range(P), own, color=[rank_color(r) for r in range(P)], label="own rows: stay home, all heads")
    top.barh(range(P), shared, left=own, color="0.55", label="shared rows: exchanged")
    top.barh(range(P), [splits[0].rows - c for c in shared], left=[o + c for o, c in zip(own, shared)], color="none",
             edgecolor="0.3", hatch="///", label=f"zeros up to m = {splits[0].rows}, exchanged too")  # fmt: skip
    top.set_yticks(range(P), [f"rank {r}" for r in range(P)])
    top.invert_yaxis()
    top.set_xlabel(f"rows of the rank's shard (T_l = {bal.local_tokens})")
    top.legend(frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=2)
    top.set_title(f"balanced, {len(lengths)} documents (lognormal), P = {P}: each rank's rows", loc="left")
    runs = [("a2a", {}), ("a2a+p2p", {"a2a_size": 2})]
    width = 0.2
    for i, (mode, options) in enumerate(runs):
        for j, layout in enumerate(batches):
            sent = _bytes_per_rank(mode, batches[layout], **options)
            x = [r + (2 * i + j - 1.5) * width for r in range(P)]
            bottom.bar(x, [b / 1e3 for b in sent], width, color=rank_color(4 + i), hatch="" if j else "//",
                       edgecolor="0.2", label=f"{mode}, {layout}" + (" (split)" if j else " (every row)"))  # fmt: skip
    bottom.set_xticks(range(P), [f"rank {r}" for r in range(P)])
    bottom.set_ylabel("kB sent, fwd + bwd")
    bottom.legend(frameon=False, ncols=2, loc="upper left")
    bottom.set_ylim(0, bottom.get_ylim()[1] * 1.45)
    bottom.spines[["top", "right"]].set_visible(False)
    bottom.set_title("bytes each rank sends (from the trace)", loc="left")
    return fig


def split_balance() -> Figure:
    """`figures/split_balance.png`: each rank's work in the split Ulysses on the packed mix, the documents that span
    ranks alone against the balance's choice (`cpref.modes.ulysses_split.split_loads`, which the tests hold to the
    kernels' calls exactly)."""
    from cpref.batch.balanced import TOLERANCE
    from cpref.modes.ulysses_split import exchanged_docs, split_loads

    cu = [0, *torch.tensor([244, 2244, 5964, 7932]).cumsum(0).tolist()]
    fig, ax = plt.subplots(figsize=(WIDTH, 3.4), constrained_layout=True)
    x, ticks, labels = 0.0, [], []
    for layout, n in [(layout, n) for layout in ("balanced", "stream") for n in (2, 4)]:
        b = cpref.Sharding.eod_padded(cu, cp_size=n, layout=layout).bounds
        start = x
        for j, balance in enumerate((False, True)):
            docs = exchanged_docs(b, n, layout, n, True, NO_WINDOW, balance)
            load = split_loads(b, n, layout, n, True, NO_WINDOW, docs)
            ax.bar([x + r * 0.18 for r in range(n)], [w * n / sum(load) for w in load], 0.16,
                   color=[rank_color(r) for r in range(n)], hatch="//" if j else "", edgecolor="0.25")  # fmt: skip
            x += n * 0.18 + 0.15
        ticks.append((start + x - 0.33) / 2)
        labels.append(f"{layout}, P = {n}")
        x += 0.4
    ax.axhline(1 + TOLERANCE, color="0.3", lw=0.8, ls="--")
    ax.text(x - 0.4, 1 + TOLERANCE + 0.02, "mean + 2%", ha="right", va="bottom", color="0.3")
    ax.set_xticks(ticks, labels)
    ax.set_ylabel("rank's work / mean")
    ax.set_ylim(0, 1.75)
    ax.legend(handles=[Patch(facecolor="white", edgecolor="0.25", label="the spanning documents exchanged"),
                       Patch(facecolor="white", edgecolor="0.25", hatch="//", label="with the balance's")],
              frameon=False, loc="upper left")  # fmt: skip
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title("a2a on the packed mix [244, 2244, 5964, 7932]: each rank's work", loc="left")
    return fig


class _ScheduleLog:
    """A rank's collectives and kernel that log, in order, each post and wait and each kernel call with its work."""

    def __init__(self, comm, log: list) -> None:
        self._comm, self._log, self._kernel = comm, log, cpref.TorchKernel()

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def _posted(self, op: str, handle):
        self._log.append(("post", op))
        log = self._log

        class Handle:
            def wait(self):
                log.append(("wait", op))
                return handle.wait()

        return Handle()

    def all_gather_async(self, x):
        return self._posted("all-gather", self._comm.all_gather_async(x))

    def reduce_scatter_async(self, x):
        return self._posted("reduce-scatter", self._comm.reduce_scatter_async(x))

    def forward(self, q, k, v, seqs, **kwargs):
        self._log.append(("kernel", "local" if kwargs["causal"] else "remote", seqs.work(kwargs["causal"])))
        return self._kernel.forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        self._log.append(("kernel", "local" if kwargs["causal"] else "remote", seqs.work(kwargs["causal"])))
        return self._kernel.backward(dout, q, k, v, out, lse, seqs, **kwargs)


def _backward_starts(ax, x: float) -> None:
    """A schedule's mark where the backward begins."""
    ax.axvline(x, color="0.3", linestyle=":", linewidth=1)
    ax.text(x + 4, 2.25, "backward", color="0.3", va="center")


def _schedule_axes(ax, r: int, x: float) -> None:
    """A schedule's rows (collectives in flight above the kernel calls) for rank `r`, over `x` score entries."""
    ax.set_ylim(2.5, 0)
    ax.set_yticks([0.5, 1.5], ["in flight", "kernel"])
    ax.set_title(f"rank {r}", loc="left")
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.set_xlim(0, x)


def overlap_schedule() -> Figure:
    """`figures/overlap_schedule.png`: the all-gather overlap's schedule on each rank, from a real run."""
    batch, T = sharding(CU, 2, "zigzag"), CU[-1]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(T, HQ if i in (0, 3) else HKV, D, generator=g, dtype=torch.float64) for i in range(4))
    logs: list[list] = [[], []]

    def rank_fn(comm):
        log = logs[comm.rank]
        logged = _ScheduleLog(comm, log)
        local = [batch.shard(t, comm.rank).requires_grad_(True) for t in (q, k, v)]
        out = cpref.attention(*local, batch, comm=logged, mode="all_gather", kernel=logged, overlap=True, check_ranks=False)
        log.append(("phase", "backward"))
        out.backward(batch.shard(dout, comm.rank))

    SimCluster(2).run(rank_fn)
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH, 4.8), constrained_layout=True, sharex=True)
    colors = {"local": rank_color(0), "remote": rank_color(1)}
    for r, (ax, log) in enumerate(zip(axes, logs)):
        x, flight = 0.0, {}  # x: score entries computed so far; op -> [posted at, posted, waited] of collectives in flight
        for kind, *what in log:
            if kind == "kernel":
                role, work = what
                ax.add_patch(Rectangle((x, 1.1), work, 0.8, facecolor=colors[role], edgecolor="white", linewidth=1.5))
                ax.text(x + work / 2, 1.5, str(work), ha="center", va="center", color="white")
                x += work
            elif kind == "post":
                flight.setdefault(what[0], [x, 0, 0])[1] += 1
            elif kind == "wait":
                entry = flight[what[0]]
                entry[2] += 1
                if entry[2] == entry[1]:  # the last of those posted together: draw them as one bar
                    start, n, _ = flight.pop(what[0])
                    ax.add_patch(Rectangle((start, 0.1), x - start, 0.8, facecolor="0.8", edgecolor="white"))
                    ax.text(start + 4, 0.5, f"{n} x {what[0]}", va="center", color="0.1")
            elif kind == "phase":
                _backward_starts(ax, x)
        _schedule_axes(ax, r, x)
    axes[-1].set_xlabel("score entries computed (per head), in call order")
    fig.legend(handles=[Patch(color=colors["local"], label="keys held here (causal)"),
                        Patch(color=colors["remote"], label="gathered keys (no mask)"),
                        Patch(color="0.75", label="collective,\nfrom post to wait")], ncols=3, frameon=False,
               loc="outside lower center")  # fmt: skip
    fig.suptitle(f"all_gather, overlap=True, P = 2, zigzag, cu_seqlens = {CU}")
    return fig


class _PostLog:
    """A communicator and kernel that log, in call order, each all-to-all's post and wait (by post number) and each
    kernel call's heads and scores: what `pipeline_schedule` draws."""

    def __init__(self, comm, log: list) -> None:
        self._comm, self._log, self._kernel, self._posts = comm, log, cpref.TorchKernel(), 0

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def split(self, groups):
        """The sub-groups log into the same list (the hierarchy's a2a groups post there)."""
        return _PostLog(self._comm.split(groups), self._log)

    def all_to_all_async(self, x):
        handle, number, log = self._comm.all_to_all_async(x), self._posts, self._log
        self._posts += 1
        log.append(("post", number))

        class Handle:
            def wait(self):
                log.append(("wait", number))
                return handle.wait()

        return Handle()

    def forward(self, q, k, v, seqs, **kwargs):
        self._log.append(("kernel", q.shape[1] * seqs.work(kwargs["causal"])))
        return self._kernel.forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        self._log.append(("kernel", q.shape[1] * seqs.work(kwargs["causal"])))
        return self._kernel.backward(dout, q, k, v, out, lse, seqs, **kwargs)


def pipeline_schedule() -> Figure:
    """`figures/ulysses_pipeline.png`: Ulysses in head groups on each rank, from a real run."""
    return _head_groups_schedule("a2a", 2, {}, "all heads of the call")


def hierarchical_pipeline() -> Figure:
    """`figures/hierarchical_pipeline.png`: a2a+p2p in head groups (a2a groups of 2, a ring of 2 per head group)."""
    return _head_groups_schedule("a2a+p2p", 4, {"a2a_size": 2}, "each ring step's call")


def _head_groups_schedule(mode: str, P: int, options: dict, calls_are: str) -> Figure:
    """Each rank's kernel calls and the all-to-alls they hid, from a real run of `mode` with head_groups=2."""
    groups, hq, hkv = 2, 8, 4
    batch, T = sharding(CU, P, "zigzag"), CU[-1]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(T, hq if i in (0, 3) else hkv, D, generator=g, dtype=torch.float64) for i in range(4))
    logs: list[list] = [[] for _ in range(P)]

    def rank_fn(comm):
        log = logs[comm.rank]
        logged = _PostLog(comm, log)
        local = [batch.shard(t, comm.rank).requires_grad_(True) for t in (q, k, v)]
        out = cpref.attention(*local, batch, comm=logged, mode=mode, kernel=logged, head_groups=groups,
                              check_ranks=False, **options)  # fmt: skip
        log.append(("phase", "backward"))
        out.backward(batch.shard(dout, comm.rank))

    SimCluster(P).run(rank_fn)
    fig, axes = plt.subplots(P, 1, figsize=(WIDTH, 2.4 * P), constrained_layout=True, sharex=True)
    for r, (ax, log) in enumerate(zip(axes, logs)):
        x, group, previous, posted, spans = 0.0, -1, None, {}, {}  # spans: (posted at, waited at) -> how many
        for kind, what in log:
            if kind == "kernel":
                group += previous != "kernel"  # a group's calls run together, after its inputs' waits
                color = rank_color(group % groups)
                ax.add_patch(Rectangle((x, 1.1), what, 0.8, facecolor=color, edgecolor="white", linewidth=1.5))
                ax.text(x + what / 2, 1.5, f"group {group % groups}", ha="center", va="center", color="white")
                x += what
            elif kind == "post":
                posted[what] = x
            elif kind == "wait":
                span = (posted.pop(what), x)
                spans[span] = spans.get(span, 0) + 1
            else:
                _backward_starts(ax, x)
                group = -1
            previous = kind
        ends: list[float] = []  # lanes of the in-flight row, each free from its end on
        for (start, end), n in sorted(spans.items()):
            if end <= start:
                continue  # waited for at once: nothing hid it
            lane = next((i for i, e in enumerate(ends) if e <= start), len(ends))
            ends[lane:lane + 1] = [end]
            ax.add_patch(Rectangle((start, 0.1 + 0.4 * lane), end - start, 0.35, facecolor="0.8", edgecolor="white"))
            ax.text(start + 4, 0.28 + 0.4 * lane, f"{n} x all-to-all", va="center", color="0.1")
        _schedule_axes(ax, r, x)
    axes[-1].set_xlabel(f"score entries computed ({calls_are}), in call order")
    fig.legend(handles=[Patch(color=rank_color(0), label="head group 0"), Patch(color=rank_color(1), label="head group 1"),
                        Patch(color="0.75", label="all-to-alls hidden by the calls,\nfrom post to wait")], ncols=3,
               frameon=False, loc="outside lower center")  # fmt: skip
    given = "".join(f", {name} = {value}" for name, value in options.items())
    fig.suptitle(f"{mode}, head_groups={groups}, P = {P}{given}, Hq = {hq}, Hkv = {hkv},\nzigzag, cu_seqlens = {CU}")
    return fig


FIGURES = {
    "figures/ulysses_pipeline.png": pipeline_schedule,
    "figures/hierarchical_pipeline.png": hierarchical_pipeline,
    "figures/overlap_schedule.png": overlap_schedule,
    "figures/split_traffic.png": split_traffic,
    "figures/split_balance.png": split_balance,
    "figures/ring_schedule.png": ring_schedule,
    "figures/ring_forward.png": ring_forward,
    "figures/ring_backward.png": ring_backward,
    "figures/window_ring.png": window_ring,
    "figures/chunked_ring.png": chunked_ring,
    "figures/hierarchical_schedule.png": hierarchical_schedule,
    "figures/ulysses_exchange.png": ulysses_exchange,
}
