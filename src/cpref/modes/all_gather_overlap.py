r"""All-gather overlap: the local keys' attention computed while the other ranks' keys travel.

The RFC's all-gather mode ([KV all-gather CP][cpref.modes.all_gather]) waits for the gathered
K/V before its one kernel call, and its backward waits for the reduce-scatter of dK/dV after
its one call: on real process groups nothing runs while they travel. Section 7 of the RFC
leaves the overlap open; cpref closes it with the split every flash-attention CP uses, the
partial results merged by their log-sum-exp ([Merging partial results][cpref.kernels.merge]).

## The split

Every key sequence of the plan is a document's causal prefix (or, without a causal mask, its
whole document) in natural order, and its last `q_len` keys are the query piece's own: the
**diagonal** block, held by this rank. Every key before the diagonal is seen by every query
of the sequence, so their order within the sequence does not matter. So, per sequence:

* the **local** keys, those of this rank's shard before the diagonal, then the diagonal: one
  sequence of the same bottom-right causal call, `(q_len, local + q_len)`;
* the **remote** keys, the others' rows, all before every query: one sequence of a call
  **without** a mask, `(q_len, remote)`.

With zigzag at $P = 2$ on a document of four chunks of $c$ tokens: rank 0's chunk 0 sees only
itself, locally; its chunk 3 sees chunk 0 and itself locally ($2c$ keys) and chunks 1 and 2
remotely ($2c$ keys). In the block metric (`q_len * kv_len`) the local call does $3 c^2$ of the
rank's $5 c^2$, the remote call $2 c^2$, and only the local call needs a mask.

## The schedule

{{ figure figures/overlap_schedule.png }}

--8<-- "src/cpref/modes/all_gather_overlap.py:forward"

The backward recomputes each call's share from the merged output and lse (the kernel
contract's backward with the row's full lse, as the ring does). It has two collectives to
hide, the all-gather of K/V again and the reduce-scatter of the remote keys' dK/dV, so the
local work is cut in two halves of equal work (`first`, `last`: the same keys, the queries
of the other half given none); the remote call sits between them:

--8<-- "src/cpref/modes/all_gather_overlap.py:backward"

With `save_gathered_kv=True` there is no gather in the backward: the remote call comes first,
and the whole local call hides the reduce-scatter.

**Calls and collectives.** Forward: the same two all-gathers, two kernel calls (one where a
rank reads no remote key: rank 0 of the contiguous layout). Backward: the same two
all-gathers and two reduce-scatters, three kernel calls (two with `save_gathered_kv`). Bytes
moved are the RFC path's, to the byte.

**Precision.** No call sees a whole row, so the backward cannot ask the kernel for `full_rows`:
it computes $\Delta = \mathrm{rowsum}(dO \circ O)$ from the output it is given, and the
Function keeps the merged output unrounded (float32) for it, as the ring does and for the same
reason (see the ring's Precision section): $T_l H_q D_v (f - b)$ more saved bytes for bf16
and fp16 inputs, none for float32. dK and dV are summed in float32 over the calls, the ranks'
remote shares reduce-scattered in float32, and each is rounded once at its owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpref.base.determinism import add_rows
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import AttentionKernel, Varlen, compute_dtype
from cpref.kernels.merge import merge_partial
from cpref.modes.all_gather_plan import AllGatherPlan
from cpref.modes.shared import padded_rows

__all__ = ["OverlapPlan", "build_overlap_plan", "overlap_forward", "overlap_backward"]


@dataclass(frozen=True)
class OverlapPlan:
    """One rank's split of its all-gather plan into the keys it holds and the keys it gathers.

    Attributes:
        local_index: `(sum local kv_len,)` rows of the local shard each local key sequence reads.
        local: the local call's sequences (the plan's causality): local keys before the diagonal, then the diagonal.
        first, last: the local call's sequences in two halves of equal work, over the same keys (the backward's).
        remote_index: `(sum remote kv_len,)` rows of the gathered buffer (what `all_gather` returns) each
            remote key sequence reads.
        remote: the remote call's sequences, without a mask.
        parts: `(first, last, remote)`: which of those calls have any work (a call without is not made).
    """

    local_index: torch.Tensor
    local: Varlen
    first: Varlen
    last: Varlen
    remote_index: torch.Tensor
    remote: Varlen
    parts: tuple[bool, bool, bool]


def build_overlap_plan(plan: AllGatherPlan, rank: int, local_tokens: int, causal: bool) -> OverlapPlan:
    """Split a selecting plan (no window) into its local and remote calls (module docstring).

    Raises:
        ValueError: for a plan with a window or (causal) explicit shifts, or a diagonal key not held here (no such plan
            is made by `cpref`: the split would be wrong).
    """
    seqs, rows = plan.seqs, plan.kv_rows.tolist()  # the host copy: no read back from the device
    if plan.window != (-1, -1) or (causal and not seqs.bottom_right):  # shifts mean nothing without a mask
        raise ValueError(f"all-gather overlap: needs a plan without a window or shifts, got window {plan.window}")
    pieces = plan.shared is not None  # rows index the shard, then the gathered rows; else the rank-major buffer
    lo = 0 if pieces else rank * local_tokens  # this rank's rows in the source buffer: [lo, lo + T_l)
    base = local_tokens if pieces else 0  # the gathered buffer's first row in the source buffer
    local_rows: list[int] = []
    remote_rows: list[int] = []
    lens: list[tuple[int, int, int]] = []  # (q_len, local kv_len, remote kv_len) per sequence
    for i in range(seqs.num_seqs):
        n_q, keys = seqs.cu_q[i + 1] - seqs.cu_q[i], rows[seqs.cu_kv[i]: seqs.cu_kv[i + 1]]
        tail = min(n_q, len(keys)) if causal else 0  # the diagonal block's keys
        head, diag = keys[: len(keys) - tail], keys[len(keys) - tail:]
        if any(not lo <= r < lo + local_tokens for r in diag):
            raise ValueError(f"all-gather overlap: sequence {i}'s diagonal keys are not all held by rank {rank}")
        mine = [r - lo for r in head if lo <= r < lo + local_tokens] + [r - lo for r in diag]
        theirs = [r - base for r in head if not lo <= r < lo + local_tokens]
        local_rows += mine
        remote_rows += theirs
        lens.append((n_q, len(mine), len(theirs)))
    first, last = _halves([(n_q, n_l) for n_q, n_l, _ in lens], causal)
    remote = Varlen.from_lengths([n_q for n_q, _, _ in lens], [n_r for _, _, n_r in lens])
    index = [torch.tensor(r, dtype=torch.int64, device=plan.kv_index.device) for r in (local_rows, remote_rows)]
    works = (_work(first, causal), _work(last, causal), _work(remote, False))
    local = Varlen.from_lengths([n_q for n_q, _, _ in lens], [n_l for _, n_l, _ in lens])
    return OverlapPlan(index[0], local, first, last, index[1], remote, tuple(w > 0 for w in works))


def _row_work(n_q: int, n_k: int, h: int, causal: bool) -> int:
    """Score entries of the first `h` query rows of a sequence `(n_q, n_k)`, bottom-right causal or not."""
    s = n_k - n_q  # query j sees s + j + 1 keys (causal)
    return h * s + h * (h + 1) // 2 if causal and n_k else h * n_k


def _work(seqs: Varlen, causal: bool) -> int:
    return sum(_row_work(b - a, y - x, b - a, causal) for a, b, x, y in zip(seqs.cu_q, seqs.cu_q[1:], seqs.cu_kv, seqs.cu_kv[1:]))


def _halves(lens: list[tuple[int, int]], causal: bool) -> tuple[Varlen, Varlen]:
    """Two calls over the same keys, splitting the query rows so that each does about half the work."""
    half = sum(_row_work(n_q, n_k, n_q, causal) for n_q, n_k in lens) / 2
    first: list[tuple[int, int]] = []
    last: list[tuple[int, int]] = []
    done = 0  # work given to `first` so far
    for n_q, n_k in lens:
        w = _row_work(n_q, n_k, n_q, causal)
        if done >= half or not n_k:  # all to `last` (a sequence without keys has no work to share)
            h = 0
        else:  # the row count closest to the half (all of it if it fits)
            h = min(range(n_q + 1), key=lambda x: abs(done + _row_work(n_q, n_k, x, causal) - half)) if done + w > half else n_q
        done += _row_work(n_q, n_k, h, causal)
        seen = n_k - n_q + h if causal and n_k else n_k  # the keys of the first h rows (a prefix of the sequence's)
        first += [(h, seen), (n_q - h, 0), (0, n_k - seen)]  # the rest of the rows see nothing, the rest of the keys
        last += [(h, 0), (n_q - h, n_k)]  # bottom-right: row h + j sees what it saw in the whole sequence
    return tuple(Varlen.from_lengths(*zip(*[x for x in calls if x != (0, 0)] or [(0, 0)])) for calls in (first, last))


def contribution(x: torch.Tensor, plan: AllGatherPlan) -> torch.Tensor:
    """What this rank all-gathers: its shard, or (`plan.shared`) the rows others read, zero-padded to `gathered_rows`."""
    return x if plan.shared is None else padded_rows(x, plan.shared, plan.gathered_rows)


# --8<-- [start:forward]
def overlap_forward(q, k, v, plan: AllGatherPlan, ov: OverlapPlan, comm: Collectives, kernel: AttentionKernel, *,
                    causal: bool, scale: float):  # fmt: skip
    """Forward with the gathers overlapped. Returns `(out, lse, (k_loc, v_loc, k_rem, v_rem))`, out unrounded."""
    acc = compute_dtype(q.dtype)
    # 1) post the all-gathers of K and V (the whole shards, or the rows others read)
    pending = [comm.all_gather_async(contribution(x, plan)) for x in (k, v)]
    # 2) while they travel: every query against the keys held here, bottom-right causal
    k_loc, v_loc = (x.index_select(0, ov.local_index) for x in (k, v))  # (sum local kv_len, Hkv, D | Dv)
    out, lse = kernel.forward(q, k_loc, v_loc, ov.local, causal=causal, scale=scale, out_dtype=acc)  # (T_l, Hq, Dv)
    # 3) wait; every query against the other ranks' keys it reads, all before it: no mask
    k_rem, v_rem = (p.wait().index_select(0, ov.remote_index) for p in pending)  # (sum remote kv_len, Hkv, D | Dv)
    if ov.parts[2]:
        out_r, lse_r = kernel.forward(q, k_rem, v_rem, ov.remote, causal=False, scale=scale, out_dtype=acc)
        # 4) merge by log-sum-exp, in float32
        merge_partial(out, lse, out_r, lse_r)
    return out, lse, (k_loc, v_loc, k_rem, v_rem)
# --8<-- [end:forward]


def _total(parts: list, like: torch.Tensor) -> torch.Tensor:
    """The sum of the tensors in `parts` (None: no share), in place into the first; zeros shaped like `like` if none."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return torch.zeros(like.shape, dtype=compute_dtype(like.dtype), device=like.device)
    for p in parts[1:]:
        parts[0].add_(p)
    return parts[0]


# --8<-- [start:backward]
def overlap_backward(dout, q, k, v, out, lse, plan: AllGatherPlan, ov: OverlapPlan, comm: Collectives,
                     kernel: AttentionKernel, *, causal: bool, scale: float, selected=None,
                     deterministic: bool = False):  # fmt: skip
    """Backward with the gathers and reduce-scatters overlapped; `selected`: the forward's `(k_loc, v_loc, k_rem,
    v_rem)` if kept (`save_gathered_kv`), else K and V are gathered again; `deterministic`: the row sums in occurrence
    layers (`cpref.base.determinism`). Returns `(dq, dk, dv)` for the local shards."""
    acc, t_l = compute_dtype(q.dtype), q.shape[0]
    grads = []  # (dq, dk_loc, dv_loc) of each call, float32 (the remote call's without dk_loc, dv_loc)

    def local(seqs: Varlen, has_work: bool) -> None:
        if has_work:
            grads.append(kernel.backward(dout, q, k_loc, v_loc, out, lse, seqs, causal=causal, scale=scale, grad_dtype=acc))

    if selected is None:
        # 1) post the all-gathers again; the first half of the local work while they travel
        pending = [comm.all_gather_async(contribution(x, plan)) for x in (k, v)]
        k_loc, v_loc = (x.index_select(0, ov.local_index) for x in (k, v))
        local(ov.first, ov.parts[0])
        k_rem, v_rem = (p.wait().index_select(0, ov.remote_index) for p in pending)
    else:
        k_loc, v_loc, k_rem, v_rem = selected
    # 2) the remote keys' share; their dK/dV summed per gathered row, and posted home (reduce-scatter, float32)
    rows = comm.size * (t_l if plan.shared is None else plan.gathered_rows)  # the gathered buffer's rows
    if ov.parts[2]:
        dq_r, dk_r, dv_r = kernel.backward(dout, q, k_rem, v_rem, out, lse, ov.remote, causal=False, scale=scale,
                                           grad_dtype=acc)  # fmt: skip
        grads.append((dq_r, None, None))
    else:
        dk_r, dv_r = (x.new_zeros((0, *x.shape[1:]), dtype=acc) for x in (k_loc, v_loc))
    home = [comm.reduce_scatter_async(add_rows(g.new_zeros((rows, *g.shape[1:])), ov.remote_index, g, deterministic=deterministic))
            for g in (dk_r, dv_r)]  # fmt: skip
    # 3) the rest of the local work while they travel
    if selected is None:
        local(ov.last, ov.parts[1])
    else:
        local(ov.local, ov.parts[0] or ov.parts[1])
    # 4) every call's shares summed in float32, the local keys' put back at their rows, the others' added on arrival
    dq, dk_loc, dv_loc = (_total([g[i] for g in grads], like) for i, like in enumerate((q, k_loc, v_loc)))
    result = []
    for g_loc, pending, x in ((dk_loc, home[0], k_loc), (dv_loc, home[1], v_loc)):
        g = add_rows(g_loc.new_zeros((t_l, *g_loc.shape[1:])), ov.local_index, g_loc, deterministic=deterministic)  # (T_l, Hkv, D | Dv)
        back = pending.wait()  # (T_l | m, Hkv, D | Dv): every rank's reads of this rank's rows
        g = g.add_(back) if plan.shared is None else g.index_add_(0, plan.shared, back[: len(plan.shared)])
        result.append(g.to(x.dtype))  # rounded once
    return dq.to(q.dtype), result[0], result[1]

# --8<-- [end:backward]
