r"""Deterministic backward: the same gradients, bit for bit, on every run.

`cpref.attention(..., deterministic=True)` (the MindSpeed interface's flag) makes the backward
repeatable on the devices where it is not by default. Two things in it can sum in an order
that changes from run to run:

1. **Scattered sums into rank-major buffers.** The all-gather mode sums each key row's dK/dV
   over the query chunks that read it with `index_add_` (and the ring's window and piece plans
   sum a block's share the same way). On CUDA, `index_add_` adds rows with atomics: when two
   entries of the index name one row, the order in which their additions land is the
   scheduler's, and floating-point addition is not associative.
2. **The kernel's own backward.** Flash attention's backward accumulates dQ over key blocks
   with atomics unless it is asked for its deterministic algorithm.

**Occurrence layers** ([`add_rows`][cpref.base.determinism.add_rows]). Number each entry of the
index by how many earlier entries name the same row: entry $p$ with index $i_p$ has occurrence
$o_p = |\{p' < p : i_{p'} = i_p\}|$. Layer $j$ holds the entries with $o_p = j$, in position
order; no two of them name one row, so for the entries $p_0 < p_1 < \dots$ of row $i$

$$
\mathrm{dst}_i \leftarrow \big((\mathrm{dst}_i + \mathrm{src}_{p_0}) + \mathrm{src}_{p_1}\big) + \dots :
$$

one `index_add_` a layer, with distinct rows, adds every row's terms in position order. For the
index `(3, 1, 3, 0, 3, 1)`:

| layer | positions | rows |
| --- | --- | --- |
| 0 | 0, 1, 3 | 3, 1, 0 |
| 1 | 2, 5 | 3, 1 |
| 2 | 4 | 3 |

{{ figure figures/occurrence_layers.png }}

No two additions ever race, on any device, and the result is bit for bit the sequential sum
(what `index_add_` computes on the CPU). The layers cost one stable sort of the index and one
host read (how many layers), and one `index_add_` per layer instead of one: the all-gather
plan's index under the zigzag layout has two (a document's first local chunk is in the prefix
of its second), an index without repeats one: one `index_add_`, as without the switch. The sort and the host read are
paid **once per index tensor**: the indices come from the plans, which the batch cache keeps,
so `add_rows` keeps each index's layers beside it (by identity, checked against the tensor's
version, so an index changed in place gets new layers; dropped with the tensor), and its
sums in a backward after the batch's first read nothing back from the device.

--8<-- "src/cpref/base/determinism.py:layers"

**The kernel** declares what it can do: a kernel that honours the flag has an attribute
`deterministic = True` (`TorchKernel`, whose backward has no atomics; `CudaKernel(deterministic=True)`
and `NpuKernel(deterministic=True)`, which run their fused backward inside
[`torch_deterministic`][cpref.base.determinism.torch_deterministic]). `attention` refuses, before any
communication, `deterministic=True` with a kernel that does not declare it.

**Why a global switch.** PyTorch's flash backward (`_flash_attention_backward`) has no
deterministic argument: it reads `torch.use_deterministic_algorithms` (and with
`warn_only=True` it warns and stays nondeterministic), and `torch_npu` maps the same switch onto
the NPU's deterministic computing (`aclnnFlashAttentionUnpaddingScoreGrad` is on its list).
`torch_deterministic` turns the switch on, strictly, for the op's duration only, and restores
what it found; threads that share the process (the simulated cluster's ranks) see the switch
while any of them holds it, and it is restored when the last one leaves.

**What is not here.** The collectives' reductions: the simulated cluster and gloo sum in a
fixed order; NCCL's order is fixed by the algorithm and protocol it picks (pin `NCCL_ALGO` and
`NCCL_PROTO` to keep it across runs), HCCL's needs `HCCL_DETERMINISTIC=true`. Neither is checked
on hardware yet.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

__all__ = ["add_rows", "occurrence_layers", "torch_deterministic"]


# --8<-- [start:layers]
def occurrence_layers(index: torch.Tensor) -> list[torch.Tensor]:
    """The entries of `index (n,)` by occurrence: layer `j` holds, in position order, the positions whose row
    appeared exactly `j` times before them. Within a layer the rows are distinct.

    Examples:
        >>> [p.tolist() for p in occurrence_layers(torch.tensor([3, 1, 3, 0, 3, 1]))]
        [[0, 1, 3], [2, 5], [4]]
    """
    n = index.shape[0]
    if n == 0:
        return []
    # 1) sort the index, stably: equal rows become runs, each run in position order
    order = torch.sort(index, stable=True).indices  # (n,)
    ranked = index[order]  # (n,) non-decreasing
    # 2) o = (place in the sorted index) - (where its run starts)
    place = torch.arange(n, device=index.device)  # (n,)
    starts = torch.ones(n, dtype=torch.bool, device=index.device)
    starts[1:] = ranked[1:] != ranked[:-1]
    run_start = torch.cummax(torch.where(starts, place, 0), dim=0).values  # (n,)
    occurrence = torch.empty_like(place).scatter_(0, order, place - run_start)  # (n,) o_p at position p
    # 3) one layer per occurrence number (one host read: how many)
    return [torch.nonzero(occurrence == j).squeeze(1) for j in range(int(occurrence.max()) + 1)]
# --8<-- [end:layers]


# id(index) -> (its version, its layers), each entry dropped with its tensor (so an id is never read for another);
# threads (the simulated ranks) may share an index: each step is one dict operation, and two threads that miss at
# once compute the same layers
_LAYERS: dict[int, tuple[int, list[torch.Tensor]]] = {}


def _layers_of(index: torch.Tensor) -> list[torch.Tensor]:
    """`occurrence_layers(index)`, computed once per index tensor (and again after an in-place change)."""
    try:
        version = index._version
    except RuntimeError:  # an inference-mode tensor counts no versions: nothing to check a kept answer by
        return occurrence_layers(index)
    key = id(index)
    kept = _LAYERS.get(key)
    if kept is not None and kept[0] == version:
        return kept[1]
    layers = occurrence_layers(index)
    if key not in _LAYERS:  # the first time this tensor is seen: forget it with the tensor
        weakref.finalize(index, _LAYERS.pop, key, None)
    _LAYERS[key] = (version, layers)
    return layers


def add_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, *, deterministic: bool) -> torch.Tensor:
    """`dst.index_add_(0, index, src)`, in place; with `deterministic`, one `index_add_` per occurrence layer (distinct
    rows in each, so no two additions race), bit for bit the sequential sum. Returns `dst`."""
    if not deterministic:
        return dst.index_add_(0, index, src)
    layers = _layers_of(index)
    if len(layers) == 1:  # distinct rows already
        return dst.index_add_(0, index, src)
    for positions in layers:
        dst.index_add_(0, index[positions], src.index_select(0, positions))  # (n_j,) distinct rows
    return dst


_lock = threading.Lock()
_held = {"holders": 0, "found": (False, False)}  # how many blocks hold the switch, and what it was before the first


@contextlib.contextmanager
def torch_deterministic() -> Iterator[None]:
    """`torch.use_deterministic_algorithms(True)` (strict) inside the block, what was set before restored after the
    last holder leaves (where it was already strictly on, it stays on)."""
    with _lock:
        if _held["holders"] == 0:
            _held["found"] = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
            torch.use_deterministic_algorithms(True)
        _held["holders"] += 1
    try:
        yield
    finally:
        with _lock:
            _held["holders"] -= 1
            if _held["holders"] == 0:
                enabled, warn_only = _held["found"]
                torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
