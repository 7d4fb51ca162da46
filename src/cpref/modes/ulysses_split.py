r"""Ulysses for the stream and balanced layouts: exchange only the documents that span ranks.

[Ulysses][cpref.modes.ulysses] trades the sequence split for a head split so that every rank
sees whole documents. With the layouts that keep documents whole ([`cpref.batch.layout`][cpref.batch.layout]:
`balanced`, and every document of `stream` that does not straddle a rank boundary), a rank
already holds whole documents for all heads: exchanging them moves bytes for nothing. This
variant splits each rank's rows in two:

* **own** rows: the documents whose real tokens all sit on this rank (and any padding of a
  document that does not span ranks): one kernel call, all heads, no communication;
* **shared** rows: the documents whose real tokens span ranks. Every rank pads its shared rows
  to the most any rank has, $m$ (from the boundaries alone, so every rank agrees), and those
  $(m, H, X)$ take Ulysses' exchange: all-to-all to $(P m, H / P, X)$, a permutation into
  document order (the padding slots last), one kernel call over the shared documents, and
  back.

Every local row is one or the other (a document's padding goes with it), so the two outputs,
written into their rows, fill the result: nothing is zeroed first. The backward mirrors it: the own rows' gradients
come from one backward call, the shared rows' through the same exchanges (dK/dV of replicated
key/value heads in float32, as in Ulysses). Per rank the traffic is Ulysses' on $m$ rows
instead of $T_l$ (`cpref.modes.costs.exchange_costs` with `gathered_rows` $= m$); a batch whose
documents all sit on one rank each, with work as even as the balance below asks, moves nothing.

## Balance

{{ figure figures/split_balance.png }}

A layout balances work as the sequence modes see it: a document's share of causal work goes
with its tokens ([`cpref.batch.balanced`][cpref.batch.balanced]). Ulysses does not: every rank attends
$1 / P$ of the heads of **every** shared document, whatever share of its tokens it holds. Per
rank, in score entries per head,

$$ L_r = O_r + \frac{S}{P}, $$

$O_r$ the work of the documents it keeps, $S$ that of the exchanged ones (`split_loads`). So a
`balanced` plan can leave Ulysses uneven: on the packed mix `[244, 2244, 5964, 7932]` at
$P = 2$ the rank that keeps the 2244-token document works 5% above the mean (10% more than
the other), and under `stream`, which keeps most documents whole wherever they fall, one rank
works 56% above it.
Exchanging a document of work $w$ that rank $r$ keeps takes $(P - 1) w / P$ off it and adds
$w / P$ to every other rank, so the split trades a few more exchanged rows for balance
(`exchanged_docs`, from the boundaries alone, so every rank agrees):

1. Exchange the documents whose real tokens sit on more than one rank.
2. While the most loaded rank is above the mean by more than `cpref.batch.balanced.TOLERANCE` (2%),
   exchange the document it keeps that lowers the loads' sum of squares most. Over the $k$
   ranks that share the exchange, the change is $\Delta(w) = w\,(k (k - 1) w - 2E)$ in units
   of $1 / k$, with $E = (k - 1) L_r - \sum_{t \ne r} L_t$: a parabola, least at
   $w = E / (k (k - 1))$, so a bisection over the rank's documents sorted by work finds it.
   On a tie the heavier one is taken; of equal work, the one with the fewest tokens.
3. Stop when no document lowers it.

The hierarchy ([for stream and balanced][cpref.modes.hierarchical_split]) uses the same rule
inside its a2a groups ($k = a$): there an exchanged document spreads over its group only. `balance=False` (an option of both modes) keeps step 1
alone: the fewest rows exchanged, where moving data costs more than the uneven work.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Any

import torch

from cpref.batch.balanced import TOLERANCE
from cpref.batch.layout import chunk_work, local_chunks
from cpref.batch.seqlens import Boundaries
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import Varlen, compute_dtype
from cpref.kernels.sinks import add_sinks, head_slice, on_all_heads, sinks_grad
from cpref.modes.call import CPCall
from cpref.modes.exchange import A2APlan, a2a_gather, a2a_scatter, kv_grad_dtype, replicate, scatter_grads
from cpref.modes.shared import document_sequences, head_split, no_double_backward, padded_rows
from cpref.modes.ulysses_pipeline import pipelined_backward, pipelined_forward

BALANCE_DOC = (f"over stream and balanced, also exchange documents held whole while a rank's work is above the mean "
               f"by more than {TOLERANCE:.0%} (`cpref.modes.ulysses_split`, Balance); False: only the documents that "
               f"span ranks")  # fmt: skip

__all__ = ["BALANCE_DOC", "SplitPlan", "SplitUlyssesFunc", "RowSplit", "build_split_plan", "split_plan", "split_rows", "gathered_order",
           "exchanged_docs", "split_loads"]


@dataclass(frozen=True)
class SplitPlan:
    """One rank's split (module docstring).

    Attributes:
        own: `(n_own,)` local rows of the documents held here whole, in local order.
        own_seqs: the own call's sequences over those rows (whole documents, padding as rows with no keys).
        shared: `(c,)` local rows of the documents that span ranks, in local order.
        rows: `m`, the shared rows every rank exchanges (its own `c`, then zeros).
        exchange: the exchange of the `P m` gathered rows and the call over them (`attend`).
    """

    own: torch.Tensor
    own_seqs: Varlen
    shared: torch.Tensor
    rows: int
    exchange: A2APlan


@dataclass(frozen=True)
class RowSplit:
    """One rank's rows split into own and shared (the module docstring), the part the split modes share.

    Attributes:
        own, own_seqs, shared, rows: as in `SplitPlan`.
        ids: per rank, the global stream positions of its shared rows, in its local order.
        docs: the documents whose real tokens span ranks, in order.
    """

    own: torch.Tensor
    own_seqs: Varlen
    shared: torch.Tensor
    rows: int
    ids: tuple[torch.Tensor, ...]
    docs: tuple[int, ...]


def split_loads(b: Boundaries, P: int, layout: str, group: int, causal: bool, window, exchanged) -> list[int]:
    """Each rank's attention work, in score entries per head times `group`, when the documents `exchanged` take
    the exchange: `group` times the work of the documents it keeps, plus the exchanged pieces' work of its group
    (the `group` ranks that share it, each attending `1 / group` of the heads: `P` for Ulysses, the a2a group
    for the hierarchy)."""
    held = _holdings(b, P, layout, causal, window)
    return [group * sum(w for doc, w in held[r].items() if doc not in exchanged)
            + sum(w for t in _group_of(r, group) for doc, w in held[t].items() if doc in exchanged) for r in range(P)]  # fmt: skip


def exchanged_docs(b: Boundaries, P: int, layout: str, group: int, causal: bool, window, balance: bool = True) -> set[int]:
    """The documents that take the exchange (module docstring, "Balance"): those whose real tokens sit on more than
    one rank; then, one at a time while the most loaded rank (`split_loads`) is above the mean by more than
    `TOLERANCE`, the document it keeps whose exchange lowers the loads' sum of squares most (`_best_move`),
    until none lowers it; with `balance=False`, only the first."""
    held = _holdings(b, P, layout, causal, window)
    exchanged = {doc for r in range(P) for doc in held[r] if any(doc in held[t] for t in range(P) if t != r)}
    if not balance:
        return exchanged
    load = split_loads(b, P, layout, group, causal, window, exchanged)
    kept = [sorted((w, b.real_len(doc), doc) for doc, w in held[r].items() if doc not in exchanged) for r in range(P)]
    while max(load) * P > (1 + TOLERANCE) * sum(load):
        r = load.index(max(load))
        g = _group_of(r, group)
        i = _best_move(kept[r], load, r, g)
        if i is None:
            break
        w, _, doc = kept[r].pop(i)
        load = [x + w * ((t in g) - group * (t == r)) for t, x in enumerate(load)]  # its work spread over the group
        exchanged.add(doc)
    return exchanged


def _best_move(kept: list[tuple[int, int, int]], load: list[int], r: int, g: range) -> int | None:
    r"""The index in `kept` (rank r's documents `(work, tokens, doc)`, sorted) of the one to exchange, or None.

    Exchanging work $w$ takes $(k - 1) w$ off $L_r$ and adds $w$ to each of its $k - 1$ group mates, so the
    loads' sum of squares changes by $\Delta(w) = w\,(k (k - 1) w - 2E)$, $E = (k - 1) L_r - \sum_{mates} L_t$:
    convex in $w$, least at $w = E / (k (k - 1))$. The document is the one beside that point with the lower
    $\Delta$ (the heavier on a tie; of equal work, the fewest tokens, then the lowest index), if $\Delta < 0$.
    """
    k = len(g)
    E = (k - 1) * load[r] - sum(load[t] for t in g if t != r)
    if not kept or k == 1:  # alone in its group: an exchange moves nothing
        return None
    cross = bisect.bisect_left(kept, E / (k * (k - 1)), key=lambda c: c[0])
    near = [i for i in (cross, cross - 1) if 0 <= i < len(kept)]
    i = min(near, key=lambda i: kept[i][0] * (k * (k - 1) * kept[i][0] - 2 * E))
    if kept[i][0] * (k * (k - 1) * kept[i][0] - 2 * E) >= 0:
        return None
    return bisect.bisect_left(kept, kept[i][0], key=lambda c: c[0])  # of its work, the first: fewest tokens


@functools.lru_cache(maxsize=16)
def _holdings(b: Boundaries, P: int, layout: str, causal: bool, window) -> tuple[dict[int, int], ...]:
    """Per rank, `{doc: work}` of the documents whose real tokens it holds: its pieces' queries' exact work. Cached
    per batch and mask (`exchanged_docs` and `split_loads` ask for it in turn, every a2a group size alike): read it,
    never change it."""
    held: list[dict[int, int]] = [{} for _ in range(P)]
    for r in range(P):
        for doc, s, e in local_chunks(b, cp_size=P, rank=r, layout=layout):
            if b.real_in(doc, s - b.padded[doc], e - b.padded[doc]):
                held[r][doc] = held[r].get(doc, 0) + chunk_work(b, doc, s, e, causal=causal, exact=True, window=window)
    return tuple(held)


def _group_of(r: int, group: int) -> range:
    """The ranks of rank `r`'s group of `group` consecutive ranks."""
    return range(r // group * group, (r // group + 1) * group)


def split_rows(b: Boundaries, P: int, rank: int, layout: str, device, *, group: int, causal: bool, window,
               balance: bool = True, chunk: int | None = None) -> RowSplit:  # fmt: skip
    """Rank `rank`'s own and shared rows (no caching); `group`, `causal`, `window`, `balance`: as in `exchanged_docs`;
    `chunk`: the own documents' sequences cut at their chunks (`cpref.modes.visible`)."""
    shared_docs = exchanged_docs(b, P, layout, group, causal, window, balance)
    shared_ids, own_rows, own_lens = [], [], []  # per rank: global ids of its shared rows
    for r in range(P):
        ids, row = [], 0
        for doc, s, e in local_chunks(b, cp_size=P, rank=r, layout=layout):
            if doc in shared_docs:
                ids.append(torch.arange(s, e))
            elif r == rank:  # an own piece: its real part sees itself, its padding nothing
                n_real = b.real_in(doc, s - b.padded[doc], e - b.padded[doc])
                own_rows.append(torch.arange(row, row + e - s))
                own_lens += document_sequences(n_real, e - s - n_real, chunk)
            row += e - s
        shared_ids.append(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64))
    index = torch.zeros(b.total, dtype=torch.int64)
    index[torch.cat([torch.arange(s, e) for doc, s, e in local_chunks(b, cp_size=P, rank=rank, layout=layout)])] = \
        torch.arange(b.total // P)  # global token -> local row of this rank
    own = torch.cat(own_rows) if own_rows else torch.zeros(0, dtype=torch.int64)
    return RowSplit(own.to(device), _varlen(own_lens), index[shared_ids[rank]].to(device),
                    max(len(x) for x in shared_ids), tuple(shared_ids), tuple(sorted(shared_docs)))  # fmt: skip


def gathered_order(ids: list[torch.Tensor], m: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(perm, received)` of a rank-major buffer of each rank's shared rows `ids[j]` padded to `m` with slots:
    `received` the global position of each row (-1: a slot), `perm` its rows in stream order, the slots last."""
    received = torch.cat([torch.cat([x, torch.full((m - len(x),), -1)]) for x in ids])  # (len(ids) m,)
    return torch.argsort(torch.where(received >= 0, received, total + torch.arange(len(received)))), received


def build_split_plan(b: Boundaries, P: int, rank: int, layout: str, hq: int, hkv: int, causal: bool, window,
                     device, balance: bool = True, chunk: int | None = None) -> SplitPlan:  # fmt: skip
    """Rank `rank`'s split plan (no caching)."""
    rows = split_rows(b, P, rank, layout, device, group=P, causal=causal, window=window, balance=balance, chunk=chunk)
    m = rows.rows
    # the gathered buffer: rank-major, each rank's shared rows then padding slots; wanted: document order, slots last
    order, received = gathered_order(list(rows.ids), m, b.total)
    perm = order if not torch.equal(order, torch.arange(len(order))) else None
    lens = []
    for doc in rows.docs:
        lens += document_sequences(b.real_len(doc), b.padded_len(doc) - b.real_len(doc), chunk)
    lens += document_sequences(0, P * m - int((received >= 0).sum()))  # the padding slots, as padding
    exchange = A2APlan(perm.to(device) if perm is not None else None,
                       torch.argsort(perm).to(device) if perm is not None else None,
                       head_split(hq, hkv, P), _varlen(lens), window)  # fmt: skip
    return SplitPlan(rows.own, rows.own_seqs, rows.shared, m, exchange)


def _varlen(lens: list[tuple[int, int]]) -> Varlen:
    """The sequences `(q_len, kv_len)` (`Varlen([0], [0])` when there are none)."""
    return Varlen.from_lengths(*zip(*lens)) if lens else Varlen([0], [0])


def split_plan(call: CPCall) -> SplitPlan:
    """The cached split plan of this rank."""
    balance = call.options["balance"]
    key = ("a2a split", call.P, call.rank, call.layout, call.heads[:2], call.causal, call.window, balance, str(call.device),
           call.chunk)  # fmt: skip
    return call.plan(key, lambda: build_split_plan(call.bounds, call.P, call.rank, call.layout, call.heads[0],
                                                   call.heads[1], call.causal, call.window, call.device, balance,
                                                   call.chunk))  # fmt: skip


class SplitUlyssesFunc(torch.autograd.Function):
    """Autograd Function: own rows attended here with all heads; shared rows through Ulysses' exchange (in `groups`
    head groups, the own rows' call after their posts, when `groups > 1`: `cpref.modes.ulysses_pipeline`)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, plan: SplitPlan, comm: Collectives, kernel, causal: bool, scale: float, groups: int = 1,
                sinks=None):  # fmt: skip
        """The own rows' call with all heads; the shared rows' exchange, call and exchange back; one output. Every
        call sees whole rows: the sinks enter each (all heads for the own rows, this rank's for the shared)."""
        ex, m, window = plan.exchange, plan.rows, plan.exchange.window
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))  # (T_l, Hq, Dv): every row own or shared
        own = [x.index_select(0, plan.own) for x in (q, k, v)]  # (n_own, H, X) each
        saved = [None, None]
        acc = None if sinks is None else compute_dtype(q.dtype)

        def own_rows() -> None:  # 1) the documents held here: all heads, no communication
            if len(plan.own):
                saved[:] = kernel.forward(*own, plan.own_seqs, causal=causal, window=window, scale=scale, out_dtype=acc)
                if sinks is not None:
                    saved[:] = add_sinks(*saved, sinks)
                    saved[0] = saved[0].to(q.dtype)
                out.index_copy_(0, plan.own, saved[0])

        if m and groups > 1:  # 2) the shared documents in head groups, the own rows' call while the first travel
            shared, gathered = pipelined_forward(*(padded_rows(x, plan.shared, m) for x in (q, k, v)), ex, comm, kernel,
                                                 groups, causal=causal, scale=scale, meanwhile=own_rows)  # fmt: skip
            out.index_copy_(0, plan.shared, shared[: len(plan.shared)])
            saved += gathered
        else:
            own_rows()
        if m and groups == 1:  # 2) the shared documents: Ulysses over the m rows every rank exchanges
            qg = a2a_gather(padded_rows(q, plan.shared, m), ex, comm)  # (P m, Hq/P, D)
            kg = a2a_gather(replicate(padded_rows(k, plan.shared, m), ex.replicas), ex, comm)  # (P m, Hkv'/P, D)
            vg = a2a_gather(replicate(padded_rows(v, plan.shared, m), ex.replicas), ex, comm)  # (P m, Hkv'/P, Dv)
            out_g, lse_g = kernel.forward(qg, kg, vg, ex.attend, causal=causal, window=window, scale=scale, out_dtype=acc)
            if sinks is not None:
                out_g, lse_g = add_sinks(out_g, lse_g, head_slice(sinks, comm.rank, comm.size))
                out_g = out_g.to(q.dtype)
            out.index_copy_(0, plan.shared, a2a_scatter(out_g, ex, comm)[: len(plan.shared)])
            saved += [qg, kg, vg, out_g, lse_g]
        ctx.save_for_backward(*own, sinks, *saved)
        ctx.plan, ctx.comm, ctx.kernel, ctx.causal, ctx.scale, ctx.dtypes = plan, comm, kernel, causal, scale, (k.dtype, v.dtype)
        ctx.shapes, ctx.groups = (q.shape, k.shape, v.shape), groups
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        """The own rows' backward call; the shared rows' through the exchanges; the gradients at their rows."""
        no_double_backward()
        plan, comm, kernel, m = ctx.plan, ctx.comm, ctx.kernel, ctx.plan.rows
        ex, window = plan.exchange, plan.exchange.window
        q_o, k_o, v_o, sinks, out_o, lse_o, *gathered = ctx.saved_tensors
        dq, dk, dv = (dout.new_empty(shape, dtype=t.dtype) for shape, t in zip(ctx.shapes, (q_o, k_o, v_o)))
        dsinks = None if sinks is None else torch.zeros_like(sinks)  # (Hq,): the own rows' and this rank's heads'

        def own_rows() -> None:  # 1) the own rows: one backward call
            if len(plan.own):
                dout_o = dout.index_select(0, plan.own).contiguous()
                grads = kernel.backward(dout_o, q_o, k_o, v_o, out_o, lse_o,
                                        plan.own_seqs, causal=ctx.causal, window=window, scale=ctx.scale,
                                        full_rows=True)  # fmt: skip
                if sinks is not None:
                    dsinks.add_(sinks_grad(dout_o, out_o, lse_o, sinks))
                for g, own_grad in zip((dq, dk, dv), grads):
                    g.index_copy_(0, plan.own, own_grad.to(g.dtype))

        if m and ctx.groups > 1:  # 2) the shared rows in head groups, the own rows' call while the first travel
            grads = pipelined_backward(padded_rows(dout, plan.shared, m), gathered, ex, comm, kernel, ctx.groups,
                                       causal=ctx.causal, scale=ctx.scale, meanwhile=own_rows)  # fmt: skip
            for g, shared_grad in zip((dq, dk, dv), grads):
                g.index_copy_(0, plan.shared, shared_grad[: len(plan.shared)].to(g.dtype))
        else:
            own_rows()
        if m and ctx.groups == 1:  # 2) the shared rows: the exchanges around one backward call
            qg, kg, vg, out_g, lse_g = gathered
            dout_g = a2a_gather(padded_rows(dout, plan.shared, m), ex, comm)  # (P m, Hq/P, Dv)
            grads = list(kernel.backward(dout_g, qg, kg, vg, out_g, lse_g, ex.attend, causal=ctx.causal, window=window,
                                         scale=ctx.scale, full_rows=True, grad_dtype=kv_grad_dtype(ex, kg.dtype)))  # fmt: skip
            grads[0] = grads[0].to(qg.dtype)
            if sinks is not None:
                dsinks.add_(on_all_heads(sinks_grad(dout_g, out_g, lse_g, head_slice(sinks, comm.rank, comm.size)),
                                         comm.rank, comm.size))  # fmt: skip
            for g, shared_grad in zip((dq, dk, dv), scatter_grads(grads, ex, comm, ctx.dtypes)):
                g.index_copy_(0, plan.shared, shared_grad[: len(plan.shared)].to(g.dtype))
        return dq, dk, dv, None, None, None, None, None, None, dsinks
