r"""What an implementation moves and computes, counted on each rank as it runs: the bytes and the balance.

A wrong mask or a lost balance costs a run without changing its numbers (PyTorch's per-document head-tail
balancer put whole documents on one rank; a ring that sends every block twice is exact and slow). So
`python -m sim verify` counts, on every rank, while the implementation runs its forward and backward:

- **bytes**: every `torch.distributed` collective the process calls, seen where every one of them passes, the
  dispatcher (`c10d::` ops for `dist.all_gather_into_tensor`, `all_to_all_single`, `send`/`recv`,
  `batch_isend_irecv`, ...; `_c10d_functional::` ops for the functional collectives PyTorch's own ring rotates
  with), priced per rank by the simulated cluster's cost model ([`traffic`][sim.cluster.trace.traffic]: an
  all-gather of $n$ bytes sends $(P - 1)\,n$, an all-to-all of $N$ bytes $\frac{P-1}{P} N$, a send $n$);
- **work**: the score entries of the forward's attention calls, query-key pairs times query heads, where the
  implementation attends through PyTorch's SDPA: `F.scaled_dot_product_attention` (any backend, seen as a
  function), or its fused ops called directly (CPU flash, CUDA flash, efficient, cuDNN: what PyTorch's ring
  calls); for cpref, the kernel's calls (`Varlen.work`, exact). An implementation that attends otherwise (its
  own matmuls) has no work counted.

The report ([`traffic_table`][sim.tools.verify.wire.traffic_table]) prints both beside cpref's own mode run on
the same batch, and the balance, the largest work of a CP group's ranks over their mean: every rank waits for
the slowest, so a balance of 1.5 is a step 50 % longer than the work needs. Above
`BALANCE_LIMIT` (1.10) it is flagged; `--balance` fails the run there.

Example:
    >>> t = Tally()
    >>> t.collective("all_gather", size=4, nbytes=1024)  # 3 peers x 1 KiB
    >>> t.sent, dict(t.calls)
    (3072, {'all_gather': 1})
    >>> causal_pairs(4, 4), causal_pairs(2, 4)  # top-left: query i sees keys 0..i
    (10, 3)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from sim.cluster.trace import traffic

__all__ = ["Tally", "Wire", "WorkKernel", "BALANCE_LIMIT", "causal_pairs", "balance", "traffic_table"]

BALANCE_LIMIT = 1.10  # max/mean work over a CP group's ranks above which a layout is called unbalanced

# the fused attention ops of PyTorch, forward only: their work is counted
SDPA_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention")  # fmt: skip
QUIET = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_", "recv_", "recv_any_source_",
         "irecv", "check_for_nan")  # collectives that send nothing (a receive is counted at its sender)  # fmt: skip


def causal_pairs(rows: int, keys: int) -> int:
    """Query-key pairs of a top-left causal block (`is_causal=True` of SDPA: query `i` sees keys `0..i`)."""
    full = min(rows, keys)  # rows that see a triangle, then rows that see every key
    return full * (full + 1) // 2 + (rows - full) * keys


@dataclass
class Tally:
    """What one rank moved and computed.

    Attributes:
        sent: bytes the rank sent, by the cost model of `sim.cluster.trace`.
        calls: `{collective: calls}` by the cost model's names (`all_gather`, `send_recv`, ...).
        work: score entries of the forward's attention calls (pairs x query heads).
        attended: whether any attention call was seen (else `work` was not measured).
        uncounted: `{op: calls}` of collectives whose bytes the model does not price (broadcast, reduce).
    """

    sent: int = 0
    calls: Counter = field(default_factory=Counter)
    work: int = 0
    attended: bool = False
    uncounted: Counter = field(default_factory=Counter)

    def collective(self, op: str, size: int, nbytes: int) -> None:
        """Count one call of `op` (a cost-model name) over `size` ranks of `nbytes` of this rank's input."""
        self.sent += traffic(op, size, nbytes) if size > 0 and nbytes else 0
        self.calls[op] += 1

    def attention(self, entries: int) -> None:
        """Count one attention call of `entries` score entries."""
        self.work, self.attended = self.work + entries, True


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _group(pg: Any) -> tuple[int, int]:
    """`(size, rank)` of a process group as a `c10d::` op carries it, or as a functional one names it."""
    if isinstance(pg, str):
        pg = dist.distributed_c10d._resolve_process_group(pg)
    elif not isinstance(pg, dist.ProcessGroup):
        pg = dist.ProcessGroup.unbox(pg)
    return pg.size(), pg.rank()


def _rows_sent(total: int, splits: Sequence[int], size: int, rank: int) -> int:
    """Rows of an all-to-all's input that leave the rank: every split but its own (equal splits without any)."""
    splits = list(splits) or [total // size] * size
    return total - splits[rank]


class _Functions(TorchFunctionMode):
    """Sees `F.scaled_dot_product_attention` itself, whichever backend it then runs (the math one decomposes into
    matmuls the dispatcher shows as such), and counts its work; the fused op it may call is then not counted again."""

    def __init__(self, wire: Wire) -> None:
        super().__init__()
        self.wire = wire

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.wire.inside:
            return func(*args, **kwargs)
        self.wire._attention(dict(zip(SDPA_ARGS, args), **kwargs))
        self.wire.inside = True
        try:
            return func(*args, **kwargs)
        finally:
            self.wire.inside = False


SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class Wire(TorchDispatchMode):
    """Counts into `tally` the collectives and (with `attention`) the fused attention calls every op of this thread
    makes while active (`with Wire(tally): ...`, around the forward and around the backward). cpref's runs count
    their work at the kernel instead (`WorkKernel`): its CPU kernel runs the flash op on blocks it masks itself."""

    def __init__(self, tally: Tally, attention: bool = True) -> None:
        super().__init__()
        self.tally, self.sdpa, self.inside = tally, attention, False
        self._functions = _Functions(self) if attention else None

    def __enter__(self):
        if self._functions is not None:
            self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._functions is not None:
            self._functions.__exit__(*exc)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        attends = self.sdpa and name in SDPA_OPS and not self.inside
        if name.startswith(("c10d::", "_c10d_functional::")) or attends:
            given = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
            if attends:
                self._attention(given)
            else:
                self._collective(name.partition("::")[2], given)
        return func(*args, **kwargs)

    def _attention(self, a: dict[str, Any]) -> None:
        q, k = a["query"], a["key"]  # (..., L, E), (..., S, E)
        rows, keys, heads = q.shape[-2], k.shape[-2], q.numel() // max(q.shape[-1] * q.shape[-2], 1)
        mask = a.get("attn_mask", a.get("attn_bias"))
        if mask is not None:  # boolean: True attends; additive: a finite bias attends
            seen = mask if mask.dtype == torch.bool else torch.isfinite(mask)
            entries = int(seen.expand(*q.shape[:-2], rows, keys).sum())
        else:
            entries = heads * (causal_pairs(rows, keys) if a.get("is_causal", False) else rows * keys)
        self.tally.attention(entries)

    def _collective(self, op: str, a: dict[str, Any]) -> None:
        t = self.tally
        if op in QUIET:
            return
        if op == "_allgather_base_":
            t.collective("all_gather", a["output_tensor"].numel() // max(a["input_tensor"].numel(), 1),
                         _nbytes(a["input_tensor"]))  # fmt: skip
        elif op == "allgather_":  # output_tensors[input][rank]
            t.collective("all_gather", len(a["output_tensors"][0]), _nbytes(a["input_tensors"]))
        elif op == "allgather_coalesced_":  # output_lists[rank][input]
            t.collective("all_gather", len(a["output_lists"]), _nbytes(a["input_list"]))
        elif op == "allgather_into_tensor_coalesced_":  # one call of several pairs
            o, i = a["outputs"][0], a["inputs"][0]
            t.collective("all_gather", o.numel() // max(i.numel(), 1), _nbytes(a["inputs"]))
        elif op in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"):
            t.collective("all_gather", a["group_size"], _nbytes(a.get("input", a.get("inputs"))))
        elif op == "_reduce_scatter_base_":
            t.collective("reduce_scatter", a["input_tensor"].numel() // max(a["output_tensor"].numel(), 1),
                         _nbytes(a["input_tensor"]))  # fmt: skip
        elif op == "reduce_scatter_":
            t.collective("reduce_scatter", len(a["input_tensors"][0]), _nbytes(a["input_tensors"]))
        elif op == "reduce_scatter_tensor_coalesced_":
            o, i = a["outputs"][0], a["inputs"][0]
            t.collective("reduce_scatter", i.numel() // max(o.numel(), 1), _nbytes(a["inputs"]))
        elif op in ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"):
            t.collective("reduce_scatter", a["group_size"], _nbytes(a.get("input", a.get("inputs"))))
        elif op in ("alltoall_base_", "all_to_all_single"):
            x = a.get("input")
            size, rank = _group(a.get("process_group", a.get("group_name")))
            row = _nbytes(x) // max(x.shape[0], 1) if x.dim() else 0
            t.sent += _rows_sent(x.shape[0] if x.dim() else 0, a["input_split_sizes"], size, rank) * row
            t.calls["all_to_all"] += 1
        elif op == "alltoall_":
            size, rank = _group(a["process_group"])
            t.sent += sum(_nbytes(x) for j, x in enumerate(a["input_tensors"]) if j != rank)
            t.calls["all_to_all"] += 1
        elif op in ("send", "isend"):
            t.sent += _nbytes(a.get("tensors", a.get("tensor")))
            t.calls["send_recv"] += 1
        elif op == "batch_p2p_ops":
            sends = [x for kind, x in zip(a["op_list"], a["tensors"]) if "send" in kind]
            t.sent += _nbytes(sends)
            t.calls["send_recv"] += len(sends)
        elif op.startswith(("allreduce", "all_reduce")):
            size, _ = _group(a.get("process_group", a.get("group_name")))
            t.collective("all_reduce", size, _nbytes(a.get("tensors", a.get("input", a.get("inputs")))))
        elif op in ("scatter_", "gather_"):  # rooted: every chunk goes straight to (from) the root
            size, rank = _group(a["process_group"])
            chunks = a["input_tensors"]  # scatter: [[one per rank]] on the root; gather: [this rank's]
            if op == "scatter_":
                t.sent += sum(_nbytes(x) for j, x in enumerate(chunks[0]) if j != rank) if rank == a["root_rank"] else 0
            else:
                t.sent += 0 if rank == a["root_rank"] else _nbytes(chunks)
            t.calls[op.rstrip("_")] += 1
        else:  # broadcast, reduce (a tree or a ring, the backend's choice): seen, not priced
            t.uncounted[op] += 1


class WorkKernel:
    """A cpref attention kernel that counts into `tally` the exact score entries of its forward calls
    (`seqs.work(causal, window)` per query head, times the call's query heads), then calls `inner`."""

    def __init__(self, inner: Any, tally: Tally) -> None:
        self.inner, self.tally = inner, tally

    def __getattr__(self, name: str) -> Any:  # the contract's other attributes: the wrapped kernel's
        return getattr(self.inner, name)

    def forward(self, q, k, v, seqs, **kwargs):
        """Count, then the wrapped kernel's forward."""
        self.tally.attention(seqs.work(kwargs["causal"], kwargs.get("window", (-1, -1))) * q.shape[1])
        return self.inner.forward(q, k, v, seqs, **kwargs)

    def backward(self, *args, **kwargs):
        """The wrapped kernel's backward."""
        return self.inner.backward(*args, **kwargs)


def balance(tallies: Sequence[Tally]) -> float | None:
    """The largest work of `tallies` (a CP group's ranks) over their mean; None where none attended."""
    if not any(t.attended for t in tallies):
        return None
    works = [t.work for t in tallies]
    mean = sum(works) / len(works)
    return max(works) / mean if mean else 1.0


def _mib(nbytes: int) -> str:
    return (
        f"{nbytes / 2**20:.3g} MiB"
        if nbytes >= 2**20
        else f"{nbytes / 2**10:.3g} KiB"
        if nbytes >= 2**10
        else f"{nbytes} B"
    )


def _sent(tallies: Sequence[Tally]) -> str:
    """Bytes sent per rank: one figure where every rank sent as much, else the least and the most."""
    low, high = min(t.sent for t in tallies), max(t.sent for t in tallies)
    return _mib(low) if low == high else f"{_mib(low)}..{_mib(high)}"


def _calls(tallies: Sequence[Tally]) -> str:
    """The collectives of the rank that called most, by name: `all_gather 4, send_recv 2`."""
    busiest = max(tallies, key=lambda t: sum(t.calls.values()))
    said = [f"{op} {n}" for op, n in sorted(busiest.calls.items())] or ["none"]
    return ", ".join(said + [f"{op} {n} (not priced)" for op, n in sorted(busiest.uncounted.items())])


def _balance(groups: Sequence[Sequence[Tally]], limit: float) -> tuple[str, float | None]:
    """`("1.50 unbalanced", 1.5)`: the worst CP group's balance, flagged above `limit`; `("-", None)` unmeasured."""
    values = [b for b in (balance(g) for g in groups) if b is not None]
    if not values:
        return "not measured", None
    worst = max(values)
    return f"{worst:.2f}" + (" unbalanced" if worst > limit else ""), worst


def traffic_table(rows: Sequence[tuple[str, str, Sequence[Sequence[Tally]]]], limit: float = BALANCE_LIMIT) -> str:
    """The bytes and balance report: one line per `(case label, who ran it, per CP group its ranks' tallies)`."""
    head = ("case", "who", "sent per rank", "balance", "collectives per rank")
    lines = [(label, who, _sent([t for g in groups for t in g]), _balance(groups, limit)[0], _calls([t for g in groups for t in g]))
             for label, who, groups in rows]  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    out = ["  ".join(f"{x:<{w}}" for x, w in zip(line, widths)).rstrip() for line in (head, *lines)]
    return "\n".join([out[0], "-" * len(out[0]), *out[1:]])
