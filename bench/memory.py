r"""Memory per rank: the peak of forward + backward on each rank, every mode, at P = 1, 2 and 4, measured.

{{ figure figures/bench_memory.png }}

Memory is what CP is for. What it promises is that the activations saved for the backward fall as
$1/P$; the peak of one layer's step adds what a mode holds only during the step (the all-gather
mode's gathered K/V, $O(T)$ by design).

Each rank of the simulated cluster (a thread) runs `cpref.attention` forward + backward on its
shard under `LiveBytes`, a `TorchDispatchMode` that counts the bytes of every storage an op
creates on that thread while the storage is alive, and keeps the peak. The count starts at the
bytes of the rank's input shards (q, k, v and the upstream gradient), which the rank holds
throughout the step: at $P = 1$ the kernel saves the inputs themselves for its backward, at
$P > 1$ most modes save exchanged copies, so leaving the inputs out would compare unlike things.
Everything the step allocates is counted too (gathered K/V, kernel outputs and temporaries
visible to the dispatcher, merges, gradients). A collective's result is counted for the rank that
receives it (`CountedComm`), and what the simulator allocates while computing a collective for the
whole group is not counted for any rank. The fused op's own tiles (at most two 256 x 512 float32
tiles per thread) are allocated inside the op and are not seen.

Printed per mode and $P$: the largest peak over the ranks, the bytes saved for the backward
(measured with saved-tensor hooks) beside the formula of [`mode_costs`][cpref.api.mode_costs], and
each figure relative to $P = 1$. The peak should fall with $P$ as the formula does (a mode that
replicates key/value heads falls more slowly, as its page says). There is no target.

Run it with `python -m bench.memory` (or `make bench`): by default documents of 1024 and 3072
tokens, 8 query heads, 2 key/value heads, head dim 64, float32; `--lengths`,
`--heads HQ HKV D DV` and `--cp` change them.

{{ results memory }}
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cpref
from cpref.api import check_mode, mode_costs
from cpref.base.errors import CPInputError
from sim import SimCluster
from sim.tools.cli import Parser, positive

__all__ = ["LiveBytes", "CountedComm", "rank_memory"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops on this thread created and that are still alive; `peak` is their maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.paused = False  # inside a collective: the simulator's work for the whole group
        self._counted: set[int] = set()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:  # views and in-place ops allocate nothing
                    self.count(t)
        return out

    def count(self, t: torch.Tensor) -> None:
        """Count `t`'s storage until it is freed (once, however many tensors view it)."""
        storage = t.untyped_storage()
        key, nbytes = id(storage), storage.nbytes()
        with self._lock:
            if key in self._counted:
                return
            self._counted.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._counted.discard(key)
            self.live -= nbytes


class _CountedHandle:
    def __init__(self, handle: Any, comm: "CountedComm") -> None:
        self._handle, self._comm = handle, comm

    def wait(self) -> torch.Tensor:
        return self._comm._received(self._handle.wait)


class CountedComm:
    """`comm`, with the result of every collective counted for this rank and the simulator's own work not."""

    def __init__(self, comm: Any, live: LiveBytes) -> None:
        self.inner, self.live = comm, live
        self.rank, self.size, self.group = comm.rank, comm.size, comm.group
        self.global_rank, self.unsupported_ops = comm.global_rank, comm.unsupported_ops
        self._splits: dict[tuple, CountedComm] = {}

    def _received(self, fn, *args):
        self.live.paused = True
        try:
            out = fn(*args)
        finally:
            self.live.paused = False
        if isinstance(out, torch.Tensor):
            self.live.count(out)
        return out

    def all_gather(self, x):
        return self._received(self.inner.all_gather, x)

    def reduce_scatter(self, x):
        return self._received(self.inner.reduce_scatter, x)

    def all_to_all(self, x):
        return self._received(self.inner.all_to_all, x)

    def send_recv(self, x, shift=1):
        return self._received(self.inner.send_recv, x, shift)

    def send_recv_async(self, x, shift=1):
        return _CountedHandle(self._received(self.inner.send_recv_async, x, shift), self)

    def all_gather_async(self, x):
        return _CountedHandle(self._received(self.inner.all_gather_async, x), self)

    def reduce_scatter_async(self, x):
        return _CountedHandle(self._received(self.inner.reduce_scatter_async, x), self)

    def all_to_all_async(self, x):
        return _CountedHandle(self._received(self.inner.all_to_all_async, x), self)

    def all_reduce(self, x, op="sum"):
        return self._received(self.inner.all_reduce, x, op)

    def barrier(self):
        return self._received(self.inner.barrier)

    def split(self, groups):
        key = tuple(tuple(part) for part in groups)
        sub = self._received(self.inner.split, groups)
        return self._splits.setdefault(key, CountedComm(sub, self.live))


def rank_memory(cu: torch.Tensor, heads: tuple[int, int, int, int], P: int, mode: str) -> list[tuple[int, int]]:
    """`(peak bytes, saved bytes)` of every rank's forward + backward on the simulated cluster."""
    hq, hkv, d, dv = heads
    g = torch.Generator().manual_seed(0)
    T = int(cu[-1])
    q, dout = torch.randn(T, hq, d, generator=g), torch.randn(T, hq, dv, generator=g)
    k, v = torch.randn(T, hkv, d, generator=g), torch.randn(T, hkv, dv, generator=g)
    options = cpref.MODES[mode].example_options(P)
    sharding = cpref.Sharding(cu, cp_size=P, layout="zigzag")

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v, dout)]
        ql, kl, vl = (t.requires_grad_(True) for t in local[:3])
        cpref.attention(ql, kl, vl, sharding, comm=comm, mode=mode, **options).backward(local[3])  # warm-up: plans, rank check
        ql.grad = kl.grad = vl.grad = None
        saved, live = [], LiveBytes()
        live.live = live.peak = sum(t.numel() * t.element_size() for t in local)  # the input shards
        with live, torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel() * x.element_size()) or x, lambda x: x):
            cpref.attention(ql, kl, vl, sharding, comm=CountedComm(comm, live), mode=mode, **options).backward(local[3])
        return live.peak, sum(saved)

    return SimCluster(P, timeout=600.0).run(rank_fn)


def markdown(results: dict) -> str:
    """The table: per mode and `P`, MiB of the peak, the measured saved bytes and the formula's, each relative to `P = 1`."""
    lines = ["| mode | P | peak with the input shards (max over ranks) | saved for backward, measured | saved, formula |",
             "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    first: dict[str, dict] = {}
    for r in results["rows"]:
        one = first.setdefault(r["mode"], r)
        cells = [f"{r[key] / 2**20:.2f} ({r[key] / one[key]:.2f})" for key in ("peak", "saved", "formula")]
        lines.append(f"| `{r['mode']}` | {r['P']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=positive, nargs="+", default=[1024, 3072], help="documents (multiples of 8)")
    parser.add_argument("--heads", type=positive, nargs=4, default=[8, 2, 64, 64], metavar=("HQ", "HKV", "D", "DV"))
    parser.add_argument("--cp", type=positive, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    cu, heads = torch.tensor([0, *torch.tensor(args.lengths).cumsum(0).tolist()]), tuple(args.heads)
    try:  # every case the run will make, refused before any of them runs
        for P in args.cp:
            sharding = cpref.Sharding(cu, cp_size=P, layout="zigzag")
            for mode in sorted(cpref.MODES):
                check_mode(mode, cp_size=P, heads=heads[:2], layout=sharding.layout, **cpref.MODES[mode].example_options(P))
    except CPInputError as exc:
        parser.error(str(exc))
    title = (f"Memory per rank: forward + backward, documents {args.lengths}, (Hq, Hkv, D, Dv) = {heads}, float32, "
             "causal, zigzag, simulated cluster; MiB, and relative to P = 1")  # fmt: skip
    print(f"## {title}\n")
    rows = []
    for mode in sorted(cpref.MODES):
        for P in args.cp:
            per_rank = rank_memory(cu, heads, P, mode)
            formula = mode_costs(mode, P=P, local_tokens=int(cu[-1]) // P, heads=heads, dtype=torch.float32,
                                 **cpref.MODES[mode].example_options(P)).saved_bytes  # fmt: skip
            rows.append({"mode": mode, "P": P, "peak": max(p for p, _ in per_rank), "saved": max(s for _, s in per_rank),
                         "formula": formula})  # fmt: skip
    results = {"title": title, "rows": rows}
    print(markdown(results))
    return results

if __name__ == "__main__":
    main()
