r"""What each mode costs per rank and layer, and what it needs.

Every mode computes the same attention (the test suite checks each rank's output and
gradients against the FP64 oracle); they differ in what they move, what they keep, what they
demand of the head counts, and how they spread the work. The formulas below are each mode's `costs`
(declared with the mode, built from this module's pieces; [`mode_costs`][cpref.api.mode_costs]
asks the mode), which the test suite checks against the simulated cluster's trace (bytes and
collectives) and against saved-tensor hooks (memory), for every mode, layout and head
configuration; the mode pages' measured tables are checked against them at build time.

## Traffic and memory

Notation: $T_l = T / P$ tokens per rank, $b$ bytes per element of the input dtype, $f$ bytes
per element of the compute dtype (4, or 8 for float64), $H'_{kv}$ the key/value heads after
the replication an all-to-all over $a$ ranks needs ($H_{kv}$ if $a \mid H_{kv}$, else $a$),
$p = P / a$ the ring of the hierarchical mode.

| mode | per rank | bytes |
| --- | --- | --- |
| `all_gather` | forward | $(P-1) T_l H_{kv} (D + D_v)\, b$ |
| | backward | forward (none with `save_gathered_kv`) $+\ (P-1) T_l H_{kv} (D + D_v)\, f$ |
| | saved for backward | $T_l (b\,(H_q D + H_{kv} D + H_{kv} D_v + H_q D_v) + f H_q)$ |
| `p2p` | forward | $(P-1) T_l H_{kv} (D + D_v)\, b$ |
| | backward | forward $+\ P\, T_l H_{kv} (D + D_v)\, f$ |
| | saved for backward | as `all_gather`, but `out` in $f$ bytes for $P > 1$: $+\,T_l H_q D_v (f - b)$ |
| `a2a` | forward | $\frac{P-1}{P} T_l (H_q D + H'_{kv} D + H'_{kv} D_v + H_q D_v)\, b$ |
| | backward | as forward; replicated heads ($H'_{kv} \ne H_{kv}$) send dK/dV in $f$ bytes |
| | saved for backward | $T_l (b\,(H_q D + H'_{kv} D + H'_{kv} D_v + H_q D_v) + f H_q)$ |
| `a2a+p2p` | forward | $\frac{a-1}{a} T_l (H_q D + H'_{kv} (D + D_v) + H_q D_v)\, b + (p - 1) T_l H'_{kv} (D + D_v)\, b$ |
| | backward | as forward (dK/dV as for `a2a`) $+\ p\, T_l H'_{kv} (D + D_v)\, f$ |
| | saved for backward | as `a2a`, $+\,T_l H_q D_v (f - b)$ for $p > 1$ |

Under a sliding window the ring levels of `p2p` and `a2a+p2p` move only what the window reaches
([`halo_costs`][cpref.modes.costs.halo_costs]: for each distance $d$ the window reaches, one shift
of the rows the rank $d$ ahead reads, forward and backward, and one of their float32 dK/dV back), and
`all_gather` and `a2a` move what they move without one (`all_gather` selects, computes and
saves only the visible rows; `a2a` runs its one call windowed). With the stream and balanced
layouts the ring levels move only what is read too, window or not, `all_gather` gathers
only the `gathered_rows` of each rank that other ranks read
([`cpref.modes.all_gather_pieces`][cpref.modes.all_gather_pieces]), and `a2a` exchanges only the
`gathered_rows` of the documents that span ranks ([`cpref.modes.ulysses_split`][cpref.modes.ulysses_split]),
as does the exchange level of `a2a+p2p`, whose ring then rings those rows alone, `halo_sizes` of its
plan ([`cpref.modes.hierarchical_split`][cpref.modes.hierarchical_split]).

Every call adds the ranks' comparison of their arguments, one host all-gather of an int64 row
([`cpref.modes.consistency`][cpref.modes.consistency]), and the hierarchical mode's first call on a
communicator two `split`s; neither moves payload, and neither is in the table.

## Choosing

* **`all_gather`** is the simplest and makes one kernel call each way. It moves
  $(P - 1) T_l H_{kv} (D + D_v)$ elements forward, which grows with `P` towards the whole
  stream's K/V: cheap with strong GQA (few key/value heads), costly for MHA at large `P`.
  It has no constraint on head counts, and zigzag balances its work exactly.
* **`p2p`** (the ring) moves as much as all-gather forward, and one block more backward (its
  dK/dV accumulators take `P` shifts, in float32 as all-gather's reduce-scatter, so that bf16
  errors do not grow with `P`), but in `P - 1` shifts
  that overlap with compute, and never holds more than two K/V blocks at once. Zigzag balances
  every step. No head constraint. The choice when the network is slow relative to compute and
  memory is tight.
* **`a2a`** (Ulysses) moves $\frac{G + 1}{P}$ times all-gather's forward traffic (with
  $D = D_v$, $G = H_q / H_{kv}$), less once $P > G + 1$; forward + backward in bf16,
  $\frac{G + 1}{2P}$ times, less once $P > \frac{G + 1}{2}$ (all-gather's backward gathers K
  and V again and reduce-scatters dK and dV in float32; Ulysses' backward moves what its forward
  does). [The rules, recomputed][rules-of-thumb-recomputed] below give, per $G$, the `P` from
  which it moves the least of all four modes. Its kernel sees whole documents for $H_q / P$ heads, so the layout's
  balance concerns it differently ([the rule](learn/layouts.md)). But `P` must divide $H_q$, and key/value heads with
  $H_{kv} < P$ are replicated, so their memory stops falling with `P`.
* **`a2a+p2p`** splits the difference: Ulysses inside groups of `a` ranks (typically a node,
  where all-to-all is fast), the ring across the `P / a` groups. It needs only `a` to fit the
  heads, so it scales past the head count, and with `a = 1` or `a = P` it *is* the ring or
  Ulysses.

The tables below give the numbers for two reference layers; every figure comes from the
modes' cost formulas.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from cpref.base.errors import CPInputError
from cpref.kernels.contract import compute_dtype
from cpref.modes.shared import head_split

__all__ = ["ModeCosts", "element_bytes", "halo_costs", "shard_bytes", "kept_output_bytes", "ring_costs",
           "exchange_costs", "combine"]


@dataclass(frozen=True)
class ModeCosts:
    """Per-rank costs of one forward and backward of one layer.

    Attributes:
        forward_bytes, backward_bytes: bytes each rank sends (= receives).
        forward_ops, backward_ops: collectives called, by name.
        saved_bytes: bytes saved for the backward (the autograd Function's saved tensors).
    """

    forward_bytes: int
    backward_bytes: int
    forward_ops: Counter = field(default_factory=Counter)
    backward_ops: Counter = field(default_factory=Counter)
    saved_bytes: int = 0


def element_bytes(dtype: torch.dtype) -> tuple[int, int]:
    """`(b, f)`: bytes per element of the input dtype and of its compute dtype."""
    return torch.empty(0, dtype=dtype).element_size(), torch.empty(0, dtype=compute_dtype(dtype)).element_size()


def shard_bytes(t: int, heads: tuple[int, int, int, int], dtype: torch.dtype) -> int:
    """What a mode that keeps its local shards saves: q, k, v, out in `b` bytes, lse in `f`."""
    hq, hkv, d, dv = heads
    b, f = element_bytes(dtype)
    return t * (b * (hq * d + hkv * d + hkv * dv + hq * dv) + f * hq)


def kept_output_bytes(p: int, t: int, heads: tuple[int, int, int, int], dtype: torch.dtype) -> int:
    """The extra bytes of a ring of `p` ranks keeping its output unrounded (in `f` bytes) for the backward."""
    b, f = element_bytes(dtype)
    return t * heads[0] * heads[3] * (f - b) if p > 1 else 0


def ring_costs(p: int, t: int, hkv: int, heads: tuple[int, int, int, int], dtype: torch.dtype) -> ModeCosts:
    """A ring of `p` ranks passing blocks of `t` tokens of `hkv` key/value heads (saved bytes: none)."""
    b, f = element_bytes(dtype)
    row = hkv * (heads[2] + heads[3])  # elements of one token's K and V
    fwd = (p - 1) * t * row * b
    bwd = fwd + (p * t * row * f if p > 1 else 0)  # the float32 dK/dV accumulators take p shifts
    return ModeCosts(fwd, bwd, +Counter(send_recv=p - 1), +Counter(send_recv=2 * p - 1 if p > 1 else 0))


def halo_costs(sizes: tuple[int, ...], heads: tuple[int, int, int, int], hkv: int, dtype: torch.dtype) -> ModeCosts:
    """The windowed ring (`cpref.modes.ring_window`): at each step `t >= 1` one shift brings `sizes[t]` rows of `hkv`
    key/value heads (saved bytes: none). Forward: those shifts; backward: them again, and each step's float32
    dK/dV share of the same rows back to its owner."""
    b, f = element_bytes(dtype)
    row, n = hkv * (heads[2] + heads[3]), len(sizes) - 1  # n: the distances the window reaches
    fwd = sum(sizes[1:]) * row * b
    bwd = fwd + sum(sizes[1:]) * row * f
    return ModeCosts(fwd, bwd, +Counter(send_recv=n), +Counter(send_recv=2 * n))


def exchange_costs(a: int, t: int, heads: tuple[int, int, int, int], dtype: torch.dtype) -> ModeCosts:
    """Ulysses' head-for-token all-to-all over `a` ranks, both ways, and what its kernel call saves."""
    hq, hkv, d, dv = heads
    b, f = element_bytes(dtype)
    replicas = head_split(hq, hkv, a)
    if replicas is None:
        raise CPInputError(f"{a} ranks cannot split Hq = {hq}, Hkv = {hkv} heads (see cpref.modes.shared.head_split): "
                           "no all-to-all over them, so no costs")  # fmt: skip
    h = hkv * replicas  # key/value heads after replication
    fwd = (a - 1) * t * (hq * d + h * (d + dv) + hq * dv) * b // a
    # backward: dK/dV of replicated heads travel unrounded, to be summed (cpref.modes.ulysses)
    bwd = (a - 1) * t * ((hq * d + hq * dv) * b + h * (d + dv) * (f if h != hkv else b)) // a
    ops = Counter(all_to_all=4) if a > 1 else Counter()
    return ModeCosts(fwd, bwd, ops, Counter(ops), t * (b * (hq * d + h * (d + dv) + hq * dv) + f * hq))


def combine(*parts: ModeCosts, saved: int) -> ModeCosts:
    """The sum of the parts' traffic and collectives, with `saved` bytes kept for the backward."""
    return ModeCosts(sum(c.forward_bytes for c in parts), sum(c.backward_bytes for c in parts),
                     sum((c.forward_ops for c in parts), Counter()), sum((c.backward_ops for c in parts), Counter()),
                     saved)  # fmt: skip
