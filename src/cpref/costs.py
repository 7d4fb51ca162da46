r"""Which mode when: what each CP mode costs per rank and layer, and what it needs.

Every mode computes the same attention (the test suite checks each rank's output and
gradients against the FP64 oracle); they differ in what they move, what they keep, what they
demand of the head counts, and how they spread the work. The formulas below are this module's
functions, which the test suite checks against the simulated cluster's trace (bytes and
collectives) and against saved-tensor hooks (memory), for every mode, layout and head
configuration; the mode pages' measured tables are checked against them at build time.

## Traffic and memory

Notation: $T_l = T / P$ tokens per rank, $b$ bytes per element of the input dtype, $f$ bytes
per element of the compute dtype (4, or 8 for float64), $H'_{kv}$ the key/value heads after
the replication an all-to-all over $a$ ranks needs ($H_{kv}$ if $a \mid H_{kv}$, else $a$),
$p = P / a$ the ring of the hierarchical mode.

| mode | forward bytes | backward bytes | saved for backward |
| --- | --- | --- | --- |
| `all_gather` | $(P-1) T_l H_{kv} (D + D_v)\, b$ | forward (none with `save_gathered_kv`) $+\ (P-1) T_l H_{kv} (D + D_v)\, f$ | $T_l (b\,(H_q D + H_{kv} D + H_{kv} D_v + H_q D_v) + f H_q)$ |
| `p2p` | $(P-1) T_l H_{kv} (D + D_v)\, b$ | forward $+\ P\, T_l H_{kv} (D + D_v)\, f$ | as `all_gather`, but `out` in $f$ bytes for $P > 1$: $+\,T_l H_q D_v (f - b)$ |
| `a2a` | $\frac{P-1}{P} T_l (H_q D + H'_{kv} D + H'_{kv} D_v + H_q D_v)\, b$ | as forward; replicated heads ($H'_{kv} \ne H_{kv}$) send dK/dV in $f$ bytes | $T_l (b\,(H_q D + H'_{kv} D + H'_{kv} D_v + H_q D_v) + f H_q)$ |
| `a2a+p2p` | $\frac{a-1}{a} T_l (H_q D + H'_{kv} (D + D_v) + H_q D_v)\, b + (p - 1) T_l H'_{kv} (D + D_v)\, b$ | as forward (dK/dV as for `a2a`) $+\ p\, T_l H'_{kv} (D + D_v)\, f$ | as `a2a`, $+\,T_l H_q D_v (f - b)$ for $p > 1$ |

Every call adds the ranks' comparison of their arguments, one host all-gather of an int64 row
([`cpref.consistency`][cpref.consistency]), and the hierarchical mode's first call on a
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
  $D = D_v$, $G = H_q / H_{kv}$): the least of all once $P > G + 1$, and the least for MHA from
  `P = 3` on. Its kernel sees whole documents for $H_q / P$ heads, so its work is balanced
  whatever the layout. But `P` must divide $H_q$, and key/value heads with
  $H_{kv} < P$ are replicated, so their memory stops falling with `P`.
* **`a2a+p2p`** splits the difference: Ulysses inside groups of `a` ranks (typically a node,
  where all-to-all is fast), the ring across the `P / a` groups. It needs only `a` to fit the
  heads, so it scales past the head count, and with `a = 1` or `a = P` it *is* the ring or
  Ulysses.

The tables below give the numbers for two reference layers; every figure comes from this
module's formulas.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from cpref.kernels.contract import compute_dtype

__all__ = ["ModeCosts", "mode_costs", "replicated_kv_heads"]


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


def replicated_kv_heads(hkv: int, a: int) -> int:
    """Key/value heads entering an all-to-all over `a` ranks: `Hkv`, or `a` if each head is replicated."""
    return hkv if hkv % a == 0 else a


def mode_costs(
    mode: str,
    *,
    P: int,
    local_tokens: int,
    heads: tuple[int, int, int, int],
    dtype: torch.dtype,
    a2a_size: int | None = None,
    save_gathered_kv: bool = False,
    selected_kv_rows: int | None = None,
) -> ModeCosts:
    """The per-rank costs of `mode` (see the table in the module docstring).

    Args:
        mode: a name in `cpref.MODES`.
        P: the CP size.
        local_tokens: `T / P`.
        heads: `(Hq, Hkv, D, Dv)`.
        dtype: the input dtype.
        a2a_size: `a` of the hierarchical mode.
        save_gathered_kv: the all-gather mode's other schedule.
        selected_kv_rows: `sum(kv_len)` of the all-gather plan, needed with `save_gathered_kv`.
    """
    hq, hkv, d, dv = heads
    t, b = local_tokens, torch.empty(0, dtype=dtype).element_size()
    f = torch.empty(0, dtype=compute_dtype(dtype)).element_size()
    kv_row = lambda h: h * (d + dv)  # noqa: E731  elements of one token's K and V
    shards = t * (b * (hq * d + hkv * d + hkv * dv + hq * dv) + f * hq)  # q, k, v, out and lse, local
    if mode == "all_gather":
        fwd = (P - 1) * t * kv_row(hkv) * b
        saved = shards
        if save_gathered_kv:
            saved = t * (b * (hq * d + hq * dv) + f * hq) + selected_kv_rows * kv_row(hkv) * b
        bwd_ops = Counter(reduce_scatter=2) + (Counter() if save_gathered_kv else Counter(all_gather=2))
        bwd = (0 if save_gathered_kv else fwd) + (P - 1) * t * kv_row(hkv) * f  # re-gather, float32 dK/dV
        return ModeCosts(fwd, bwd, Counter(all_gather=2), bwd_ops, saved)
    kept = lambda p: t * hq * dv * (f - b) if p > 1 else 0  # noqa: E731  a ring's output, kept unrounded
    if mode == "p2p":
        return _ring(P, t, kv_row(hkv), b, f, Counter(), Counter(), (0, 0), shards + kept(P))
    a = P if mode == "a2a" else a2a_size
    h = replicated_kv_heads(hkv, a)
    a2a_bytes = (a - 1) * t * (hq * d + kv_row(h) + hq * dv) * b // a
    # backward: dK/dV of replicated heads travel unrounded, to be summed (cpref.modes.ulysses)
    a2a_back = (a - 1) * t * ((hq * d + hq * dv) * b + kv_row(h) * (f if h != hkv else b)) // a
    a2a_ops = Counter(all_to_all=4) if a > 1 else Counter()
    saved = t * (b * (hq * d + kv_row(h) + hq * dv) + f * hq)
    if mode == "a2a":
        return ModeCosts(a2a_bytes, a2a_back, a2a_ops, Counter(a2a_ops), saved)
    return _ring(P // a, t, kv_row(h), b, f, a2a_ops, Counter(a2a_ops), (a2a_bytes, a2a_back), saved + kept(P // a))


def _ring(p: int, t: int, row: int, b: int, f: int, fwd_ops: Counter, bwd_ops: Counter, extra: tuple[int, int],
          saved: int) -> ModeCosts:  # fmt: skip
    """A ring of `p` ranks on blocks of `t` tokens of `row` K/V elements, on top of `extra` (forward, backward) bytes."""
    fwd = (p - 1) * t * row * b
    bwd = fwd + (p * t * row * f if p > 1 else 0)  # the float32 dK/dV accumulators take p shifts
    fwd_ops, bwd_ops = fwd_ops + Counter(send_recv=p - 1), bwd_ops + Counter(send_recv=2 * p - 1 if p > 1 else 0)
    return ModeCosts(extra[0] + fwd, extra[1] + bwd, +fwd_ops, +bwd_ops, saved)
