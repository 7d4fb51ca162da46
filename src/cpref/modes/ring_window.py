r"""The ring under a sliding window: only the steps the window reaches, only the rows it sees.

With `window=(left, right)` the query at position $p$ sees the keys $[p - \ell, p + r]$ of its
document. The ring of [`cpref.modes.ring`][cpref.modes.ring] then wastes most of what it moves:
a block far from a rank's queries holds no key they see. This variant plans from the window.

**Calls.** At step $t$ rank $r$ holds the block of rank $s = (r - t) \bmod P$. For each of the
sender's chunks of a document, each local query chunk's real queries $[a, z)$ see the keys of
that chunk in $[a - \ell, z + r)$; the pairs with keys form one kernel call with explicit
shifts (query $a$ stands at key $a - \mathrm{lo}$, [the kernel contract][cpref.kernels.contract]).
A sender's two zigzag chunks of a document are not adjacent, so a query chunk whose window
reaches both needs two calls, merged by lse like two steps.

**Steps.** The ring runs $S$ steps, one past the last at which any rank's queries see a key of
the block it holds ($S$ is computed from the boundaries alone, so every rank agrees). With the
contiguous layout and a causal window no wider than a chunk, $S = 2$: each rank needs only its
left neighbour's block; with `window=(0, 0)`, $S = 1$ and nothing is sent at all.

**Rows.** A block passes ranks $s + 1, s + 2, \dots, s + S - 1$. After step $t$ it needs to carry
only $R_{t+1}$, the rows some later rank's calls read, so each shift sends the rows still needed
downstream ($R_1 \supseteq R_2 \supseteq \dots$). With the contiguous layout and a causal window of
$w \le c$ keys before each query, $R_1$ is the last $w$ real rows of each document's chunk: a halo
of $w$ rows per document instead of the whole block. The figure at the bottom of this page draws,
from a real run in both layouts, which keys each shift carries.

**Backward.** K/V take the same way again. The own block's dK/dV share (step 0) stays home; a
travelling float32 accumulator covers $R_1$, each later step adds its share at its rows, and
after step $S - 1$ one shift of $-(S - 1)$ brings it home, where it is added at $R_1$. A shift
moves one shape on every rank, so step $t$'s carries $m_t = \max_s |R_t(s)|$ rows of
$H_{kv} (D + D_v)$ elements (zeros past a block's own $R_t$). Per rank: forward
$\sum_{t=1}^{S-1} m_t$ rows in $b$ bytes, backward the same plus $(S - 1)\, m_1$ rows in $f$ bytes
(`cpref.costs.relay_costs`, asserted from the trace).
"""

from __future__ import annotations

import functools

import torch

from cpref.comm import Collectives
from cpref.kernels.contract import AttentionKernel, Varlen, compute_dtype
from cpref.kernels.merge import merge_partial
from cpref.layout import chunk_ids
from cpref.modes.ring_plan import Relay, RingCall, RingPlan, RingStep
from cpref.seqlens import Boundaries

__all__ = ["build_window_ring_plan", "window_ring_length", "relay_forward", "relay_backward"]


def _sequences(b: Boundaries, P: int, mult: int, rank: int, source: int, slot: int, layout: str,
               causal: bool, window: tuple[int, int]):  # fmt: skip
    """`(q_len, kv_len, shift, first key row)` of every sequence of the call over the sender's chunk `slot` of each
    document: each local query chunk's real queries `[a, z)` against the keys of that chunk within their window."""
    mine, theirs = chunk_ids(rank, P, layout), chunk_ids(source, P, layout)
    left, right = window[0], 0 if causal else window[1]
    out, offset = [], 0  # offset: the document's first row in every buffer
    for i in range(b.num_docs):
        c = b.padded_len(i) // mult
        jj = theirs[slot]
        k0, k1 = jj * c, jj * c + b.real_in(i, jj * c, (jj + 1) * c)  # the sender chunk's real key positions
        for j in mine:
            a = j * c
            z = a + b.real_in(i, a, a + c)  # real query positions [a, z)
            lo = k0 if left < 0 else max(k0, a - left)
            hi = k1 if right < 0 else min(k1, z + right)
            if z > a and hi > lo:
                out += [(z - a, hi - lo, a - lo, offset + slot * c + lo - k0), (c - (z - a), 0, 0, 0)]  # real, padding
            else:
                out.append((c, 0, 0, 0))  # the chunk sees nothing of this sender chunk
        offset += len(mine) * c
    return [seq for seq in out if seq[0]]


def _calls(b: Boundaries, P: int, mult: int, rank: int, source: int, layout: str, causal: bool,
           window: tuple[int, int]) -> list[tuple[Varlen, torch.Tensor]]:  # fmt: skip
    """`(seqs, rows)` of every call of one step: one per sender chunk slot some local query's window reaches;
    `rows` are the block's rows each call reads, in the original block's coordinates."""
    calls = []
    for slot in range(len(chunk_ids(source, P, layout))):
        seqs = _sequences(b, P, mult, rank, source, slot, layout, causal, window)
        if any(n_k for _, n_k, _, _ in seqs):
            rows = torch.cat([torch.arange(first, first + n_k) for _, n_k, _, first in seqs if n_k])  # (sum kv_len,)
            varlen = Varlen.from_lengths([n for n, *_ in seqs], [n_k for _, n_k, _, _ in seqs], [d for _, _, d, _ in seqs])
            calls.append((varlen, rows))
    return calls


def window_ring_length(b: Boundaries, P: int, layout: str, causal: bool, window: tuple[int, int]) -> int:
    """`S`: one past the last step at which any rank's queries see a key of the block it holds (at least 1)."""
    mult = b.check_divisible(layout, P)
    needed = [t for t in range(1, P) if any(_calls(b, P, mult, r, (r - t) % P, layout, causal, window) for r in range(P))]
    return 1 + max(needed, default=0)


def build_window_ring_plan(b: Boundaries, P: int, rank: int, layout: str, causal: bool, window: tuple[int, int],
                           device: torch.device) -> RingPlan:  # fmt: skip
    """The `S` steps of rank `rank` and the rows that travel (see the module docstring)."""
    mult = b.check_divisible(layout, P)
    S = window_ring_length(b, P, layout, causal, window)

    @functools.cache
    def reads(r: int, t: int) -> torch.Tensor:
        """The block rows rank `r`'s calls read at step `t` (original coordinates, sorted, unique)."""
        rows = [rows for _, rows in _calls(b, P, mult, r, (r - t) % P, layout, causal, window)]
        return torch.unique(torch.cat(rows)) if rows else torch.zeros(0, dtype=torch.int64)

    def carried(s: int, t: int) -> torch.Tensor:
        """`R_t` of the block of rank `s`: the rows ranks `s + t .. s + S - 1` read, original coordinates."""
        return torch.unique(torch.cat([reads((s + u) % P, u) for u in range(t, S)] + [torch.zeros(0, dtype=torch.int64)]))

    sizes = [0] + [max(len(carried(s, t)) for s in range(P)) for t in range(1, S)]  # a shift's rows, the same everywhere
    steps, send, acc_index = [], [], []
    for t in range(S):
        s = (rank - t) % P
        held = carried(s, t) if t else None  # None: the whole own block
        calls = []
        for seqs, rows in _calls(b, P, mult, rank, s, layout, causal, window):
            local = rows if held is None else torch.searchsorted(held, rows)  # positions in the block held now
            calls.append(RingCall(seqs, causal, local.to(device), window))
        steps.append(RingStep(s, tuple(calls)))
        if t + 1 < S:
            nxt = carried(s, t + 1)
            send.append((nxt if held is None else torch.searchsorted(held, nxt)).to(device))
        acc_index.append(None if held is None else torch.searchsorted(carried(s, 1), held).to(device))
    return RingPlan(tuple(steps), Relay(tuple(send), tuple(sizes), tuple(acc_index), carried(rank, 1).to(device)))


def _outgoing(kv: torch.Tensor, relay: Relay, t: int) -> torch.Tensor:
    """The rows `R_{t+1}` of the block held at step `t`, zero-padded to the shift's size: `(m_{t+1}, Hkv, D + Dv)`."""
    rows = relay.send[t]
    out = kv.new_zeros((relay.sizes[t + 1], *kv.shape[1:]))  # (m_{t+1}, Hkv, D + Dv)
    out[: len(rows)] = kv.index_select(0, rows)
    return out


def _block(kv: torch.Tensor, call: RingCall, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = kv.index_select(0, call.kv_index)  # (T', Hkv, D + Dv): the call's keys, in order
    return kv[..., :d], kv[..., d:]


# --8<-- [start:forward]
def relay_forward(q, k, v, plan: RingPlan, comm: Collectives, kernel: AttentionKernel, *, scale: float, out_dtype=None):
    """Forward of the windowed ring: `(out (T_l, Hq, Dv), lse (T_l, Hq))`, out in `out_dtype` (default: q's)."""
    acc, d, S, relay = compute_dtype(q.dtype), k.shape[-1], len(plan.steps), plan.relay
    out = lse = None
    kv = torch.cat([k, v], dim=-1)  # (T_l, Hkv, D + Dv): the own block, whole
    for t, step in enumerate(plan.steps):
        # 1) pass on only the rows later ranks read, before computing on this block
        pending = comm.send_recv_async(_outgoing(kv, relay, t)) if t + 1 < S else None  # (m_{t+1}, Hkv, D + Dv)
        # 2) every call of the step, merged by log-sum-exp in float32
        for call in step.calls:
            out_b, lse_b = kernel.forward(q, *_block(kv, call, d), call.seqs, causal=call.causal, window=call.window,
                                          scale=scale, out_dtype=acc)  # fmt: skip
            if out is None:
                out, lse = out_b, lse_b
            else:
                merge_partial(out, lse, out_b, lse_b)
        if pending is not None:
            kv = pending.wait()  # (m_{t+1}, Hkv, D + Dv): R_{t+1} of the block of rank r - t - 1, then zeros
    if out is None:  # no call at all: this rank holds only padding (out 0, lse -inf)
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    return out.to(out_dtype or q.dtype), lse
# --8<-- [end:forward]


# --8<-- [start:backward]
def relay_backward(dout, q, k, v, out, lse, plan: RingPlan, comm: Collectives, kernel: AttentionKernel, *, scale: float,
                   kv_grad_dtype=None):  # fmt: skip
    """Backward of the windowed ring: `(dq, dk, dv)`, dK/dV in `kv_grad_dtype` (default: their dtypes)."""
    acc, d, S, relay = compute_dtype(q.dtype), k.shape[-1], len(plan.steps), plan.relay
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (T_l, Hq, D), stays home
    kv = torch.cat([k, v], dim=-1)  # (T_l, Hkv, D + Dv)
    own = pending_acc = None  # dK/dV of the own block (home); the accumulator over R_1 in flight
    for t, step in enumerate(plan.steps):
        pending_kv = comm.send_recv_async(_outgoing(kv, relay, t)) if t + 1 < S else None
        # 1) this block's share, one call at a time, at the rows of the block held now
        share = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # (n_t, Hkv, D + Dv)
        for call in step.calls:
            dq_b, dk_b, dv_b = kernel.backward(dout, q, *_block(kv, call, d), out, lse, call.seqs, causal=call.causal,
                                               window=call.window, scale=scale, grad_dtype=acc)  # fmt: skip
            dq.add_(dq_b)
            share.index_add_(0, call.kv_index, torch.cat([dk_b, dv_b], dim=-1))
        # 2) the own block's share stays; later blocks' shares join the accumulator that travels with them
        if t == 0:
            own = share
        else:  # the accumulator over R_1 of this block: new at step 1, else from the previous rank
            fresh = torch.zeros((relay.sizes[1], *kv.shape[1:]), dtype=acc, device=kv.device)  # (m_1, Hkv, D + Dv)
            travel = fresh if t == 1 else pending_acc.wait()
            travel.index_add_(0, relay.acc_index[t], share[: len(relay.acc_index[t])])  # the rows past R_t are padding
            pending_acc = comm.send_recv_async(travel, 1 if t + 1 < S else (1 - S) % comm.size)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if S > 1:  # 3) the accumulator of the own block's rows R_1 comes home
        own.index_add_(0, relay.home_rows, pending_acc.wait()[: len(relay.home_rows)])
    return dq.to(q.dtype), own[..., :d].to(kv_grad_dtype or k.dtype), own[..., d:].to(kv_grad_dtype or v.dtype)
# --8<-- [end:backward]
