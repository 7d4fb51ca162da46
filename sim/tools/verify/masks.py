r"""The masks of `python -m sim verify --mask`: each built from a case's own documents, the same in every process.

`--mask prefix-lm,spans,shared-prompt,random` (or `all`) runs every case once per mask, each a
[`cpref.Mask`][cpref.batch.mask.Mask] over the real (unpadded) tokens of the case's batch (`real` the
document lengths `sim.tools.verify.cases.lengths` made of `--docs`, `a` a document's first token, `n`
its length):

| `--mask` | the mask | what it stands for |
| --- | --- | --- |
| `prefix-lm` | `Mask.prefix_lm`: every document's first `n // 2` tokens see each other whole, the rest causal | PaliGemma, T5Gemma-style decoders |
| `spans` | `Mask.bidirectional_spans`: causal documents, tokens `a + n // 4 .. a + n // 2` of each seeing each other whole | an image's or a clip's tokens (Gemma 3) |
| `shared-prompt` | `Mask.shared_prompt`: the first document the prompt, every other one an answer that sees the prompt and itself (one document: its first half the prompt, its second the answer) | GRPO groups: a mask across document boundaries |
| `random` | `Mask.from_slices` of [`random_slices`][sim.tools.verify.masks.random_slices]`(seed, T)`: 8 slices, 2 of each kind, each odd one starting inside the one before (they overlap) | any mask, and the rows that see no key |

The random slices depend on `--seed` and the batch's real tokens `T` only (every CP group of a run draws
the same); the command line prints them before the table, so a failure is reproduced by the same
`--seed` (or by `Mask.from_slices` of the printed slices).

Example:
    >>> mask_of("prefix-lm", (6, 4), seed=0).slices  # prompts of 3 and 2 tokens
    ((0, 3, 0, 3, 'full'), (3, 6, 0, 6, 'causal'), (6, 8, 6, 8, 'full'), (8, 10, 6, 10, 'causal'))
    >>> mask_of("shared-prompt", (4, 2, 3), seed=0).slices  # a prompt of 4, answers of 2 and 3
    ((0, 6, 0, 6, 'causal'), (6, 9, 0, 4, 'full'), (6, 9, 6, 9, 'causal'))
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

import cpref
from cpref.batch.mask_union import KINDS
from sim import oracle

__all__ = ["MASKS", "mask_of", "random_slices", "random_note", "blocks", "masked_oracle"]

MASKS = ("prefix-lm", "spans", "shared-prompt", "random")  # the names --mask takes


def _cu(real: Sequence[int]) -> list[int]:
    cu = [0]
    for n in real:
        cu.append(cu[-1] + n)
    return cu


def random_slices(seed: int, total: int, count: int = 8) -> list[tuple[int, int, int, int, str]]:
    """`count` slices `(q_start, q_end, k_start, k_end, kind)` over `total` tokens, drawn by `random.Random(seed)`:
    the kinds in turn (every kind `count / 4` times), each range up to a quarter of the batch, and each odd slice
    starting inside the one before it, so that slices overlap. The same `(seed, total)` draws the same slices.

    Example:
        >>> print(*(s[4] for s in random_slices(0, 100)))
        full causal inv_causal bi_causal full causal inv_causal bi_causal
    """
    rng, span = random.Random(seed), max(1, total // 4)
    out: list[tuple[int, int, int, int, str]] = []
    for i in range(count):
        if i % 2 and out:  # inside the previous slice: an overlap
            q0, k0 = rng.randrange(out[-1][0], out[-1][1]), rng.randrange(out[-1][2], out[-1][3])
        else:
            q0, k0 = rng.randrange(total), rng.randrange(total)
        q1, k1 = rng.randint(q0 + 1, min(total, q0 + span)), rng.randint(k0 + 1, min(total, k0 + span))
        out.append((q0, q1, k0, k1, KINDS[i % len(KINDS)]))
    return out


def random_note(seed: int, totals: dict[str, int]) -> str:
    """The `note:` line of `--mask random`: the slices each batch drew (`totals`: its label, e.g. `"zigzag cp2"`, to its
    real tokens), so that a failure can be reproduced; `""` where no case has the random mask.

    Example:
        >>> drawn = random_note(0, {"zigzag cp2": 12, "stream cp2": 12}).split("real tokens: ")[-1]
        >>> print(drawn[:63])
        zigzag cp2, stream cp2 T=12: [(6, 7, 6, 8, 'full'), (6, 8, 7, 9
    """
    if not totals:
        return ""
    by_total: dict[int, list[str]] = {}
    for label, total in totals.items():
        by_total.setdefault(total, []).append(label)
    return (f"note: --mask random: the slices random_slices(seed {seed}, T) drew, the same in every CP group (--seed {seed} "
            "draws them again; sim.tools.verify.masks), as (q_start, q_end, k_start, k_end, kind) over the real tokens: "
            + "; ".join(f"{', '.join(labels)} T={total}: {random_slices(seed, total)}" for total, labels in by_total.items()))


def mask_of(name: str, real: Sequence[int], seed: int) -> cpref.Mask:
    """The mask `name` (one of `MASKS`) over documents of `real` tokens (the module docstring's table).

    Raises:
        ValueError: an unknown name, naming the ones there are.
    """
    cu = _cu(real)
    if name == "prefix-lm":
        return cpref.Mask.prefix_lm(cu, [n // 2 for n in real])
    if name == "spans":
        return cpref.Mask.bidirectional_spans(cu, [(a + n // 4, a + n // 2) for a, n in zip(cu, real)])
    if name == "shared-prompt":
        prompt, answers = (real[0], list(real[1:])) if len(real) > 1 else (real[0] // 2, [real[0] - real[0] // 2])
        return cpref.Mask.shared_prompt([(prompt, answers)])
    if name == "random":
        return cpref.Mask.from_slices(random_slices(seed, cu[-1]), cu[-1])
    raise ValueError(f"mask {name!r} unknown; choose from {', '.join(MASKS)}")


def blocks(mask: cpref.Mask) -> list[tuple[int, int]]:
    """Disjoint token ranges `[a, b)` that hold every slice whole (queries and keys): attention under the mask never
    crosses from one to another, so the dense oracle runs one range at a time; a token in none sees no key.

    Example:
        >>> blocks(cpref.Mask.from_slices([(0, 2, 0, 2, "full"), (5, 8, 3, 6, "causal")]))
        [(0, 2), (3, 8)]
    """
    spans = sorted((min(q0, k0), max(q1, k1)) for q0, q1, k0, k1, _ in mask.slices)
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and a < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def masked_oracle(batch: Any, mask: cpref.Mask, **variants) -> tuple[torch.Tensor, ...]:
    """The oracle's `(out, dq, dk, dv)` of `batch` (a `sim.tools.verify.cases.Batch`) under `mask` over the padded
    stream (padding rows 0), one of `blocks` and one KV head at a time: `sim.oracle.forward_backward` with
    `slice_mask` of the block's slices; a row in no block, like a row no slice reaches inside one, gives 0.
    `variants`: `softcap`, and `sinks`, whose gradient comes fifth."""
    s = batch.sharding
    q, k, v, dout = (t.double() for t in (batch.q, batch.k, batch.v, batch.dout))
    if s.bounds.is_padded:
        q, k, v, dout = (s.unpad(t) for t in (q, k, v, dout))  # (T_real, H, D): the tokens the mask indexes
    G, sinks = q.shape[1] // k.shape[1], variants.pop("sinks", None)
    full = [torch.zeros_like(dout), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    full += [] if sinks is None else [torch.zeros(q.shape[1], dtype=torch.float64)]
    for a, b in blocks(mask):
        inside = [(q0 - a, q1 - a, k0 - a, k1 - a, kind) for q0, q1, k0, k1, kind in mask.slices if a <= q0 < b]
        dense, rows, cu = oracle.slice_mask(inside, b - a), slice(a, b), torch.tensor([0, b - a])  # (n, n)
        for h in range(k.shape[1]):
            qh, kh = slice(h * G, (h + 1) * G), slice(h, h + 1)  # its G query heads and its KV head
            own = {} if sinks is None else {"sinks": sinks[qh].double()}  # (G,)
            out, _, *grads = oracle.forward_backward(q[rows, qh], k[rows, kh], v[rows, kh], cu, dout[rows, qh],
                                                     mask=dense, **variants, **own)  # fmt: skip
            for t, part, heads in zip(full, (out, *grads[:3]), (qh, qh, kh, kh)):
                t[rows, heads] = part  # (n, G or 1, D)
            if sinks is not None:
                full[4][qh] += grads[3]  # (G,): the block's share of the sinks' gradient
    if s.bounds.is_padded:
        full[:4] = [s.pad(t) for t in full[:4]]  # (T, ...): padding rows 0
    return tuple(full)
