"""Learn CP, page 12: masks as slices, each rank's work under a mask, and what
each mode moves under one (read from the simulated cluster's trace).

Run from the repository root: `.venv/bin/python -m examples.learn.masks`.
"""

# --8<-- [start:kinds]
from itertools import accumulate

import torch

import cpref
from cpref.batch.mask import KINDS  # full, causal, inv_causal, bi_causal
from sim import SimCluster

Lq, Lk = 4, 7  # one slice of 4 queries against 7 keys: Lq != Lk
for kind in KINDS:
    mask = cpref.Mask.from_slices([(0, Lq, 0, Lk, kind)], total=Lk)
    rows = mask.dense()[:Lq]  # (Lq, Lk): True where query i sees key j
    drawn = ["".join(".x"[seen] for seen in row) for row in rows.tolist()]
    print(f"{kind:>10}:", " ".join(drawn))  # row i: x where it sees key j
# --8<-- [end:kinds]


# --8<-- [start:masks]
def window_slices(cu, w):
    """A causal window of w keys before each query, written as slices: a
    causal triangle over a document's first w + 1 rows, a band below it."""
    out = []
    for a, b in zip(cu, cu[1:]):
        n = min(w + 1, b - a)
        out.append((a, a + n, a, a + n, "causal"))
        if b - a > n:  # row x sees keys x - w .. x: a bi_causal band
            out.append((a + n, b, a + n - w, b, "bi_causal"))
    return out


def masks(lengths, window):
    """The usual masks over one packed batch of documents of `lengths`."""
    cu = [0, *accumulate(lengths)]
    middle = [(a + (b - a) // 4, b - (b - a) // 4) for a, b in zip(cu, cu[1:])]
    groups = [(lengths[i], lengths[i + 1 : i + 4])  # (prompt, answers)
              for i in range(0, len(lengths), 4)]
    return {
        "causal documents": cpref.Mask.causal_documents(cu),
        # each document's first half sees itself whole (the prompt)
        "prefix-LM": cpref.Mask.prefix_lm(cu, [n // 2 for n in lengths]),
        # an image in the middle half of each document, seen whole by itself
        "image spans": cpref.Mask.bidirectional_spans(cu, middle),
        # documents 0, 4, ...: prompts; the next three: answers to them
        "shared prompt": cpref.Mask.shared_prompt(groups),
        "window": cpref.Mask.from_slices(window_slices(cu, window), cu[-1]),
    }


SMALL = [12, 6, 8, 6]  # the page's picture: four documents, 32 tokens
for name, mask in masks(SMALL, window=3).items():
    print(f"{name}: {len(mask.slices)} slices, {mask.visible_pairs()} pairs")
print("prefix-LM's slices:", masks(SMALL, window=3)["prefix-LM"].slices)
# --8<-- [end:masks]

# --8<-- [start:work]
P = 4
LENGTHS = [96, 40, 64, 24, 72, 48, 56, 112]  # 512 tokens, multiples of 2P
cu = [0, *accumulate(LENGTHS)]
MASKS = masks(LENGTHS, window=32)


def keys_seen(mask):
    """(T,): how many keys each query sees, from the normalised slices
    (disjoint, so their counts add up), kind by kind."""
    seen = torch.zeros(mask.total, dtype=torch.long)
    for q0, q1, k0, k1, kind in mask.slices:
        i, n_q, n_k = torch.arange(q1 - q0), q1 - q0, k1 - k0
        last = torch.full_like(i, n_k - 1)  # the last key query i sees
        if kind in ("causal", "bi_causal"):  # bottom-right: j <= i + Lk - Lq
            last = torch.minimum(last, i + n_k - n_q)
        first = i if kind in ("inv_causal", "bi_causal") else torch.zeros_like(i)
        seen[q0:q1] += (last - first + 1).clamp(min=0)
    return seen


def work(mask, layout):
    """Each rank's pairs under the mask: the keys its own queries see (the
    work of p2p and all_gather, which compute a rank's queries there)."""
    sharding = cpref.Sharding(cu, cp_size=P, layout=layout)
    seen, token = keys_seen(mask), torch.arange(cu[-1])  # no padding here
    return [int(seen[sharding.shard(token, r)].sum()) for r in range(P)]


print(f"\nwork per rank under each mask (pairs of one head), P = {P}:")
works = {(n, lay): work(m, lay) for n, m in MASKS.items()
         for lay in ("contiguous", "zigzag")}
for (name, layout), w in works.items():
    print(f"{name:>16} {layout:>10}: {w}, slowest / mean "
          f"{max(w) * P / sum(w):.2f}")
# --8<-- [end:work]

# --8<-- [start:balanced]
print(f"\nthe layout balanced by each mask (its own work), P = {P}:")
for name, mask in MASKS.items():
    by_mask = cpref.Sharding(cu, cp_size=P, layout="balanced", mask=mask)
    w = [by_mask.attention_work(r, mask=mask) for r in range(P)]
    works[name, "by mask"] = w
    print(f"{name:>16} {'by mask':>10}: {w}, slowest / mean "
          f"{max(w) * P / sum(w):.2f}")
# --8<-- [end:balanced]

# --8<-- [start:traffic]
g = torch.Generator().manual_seed(0)
q = torch.randn(cu[-1], 8, 32, generator=g).bfloat16()  # (T, Hq, D)
k, v = (torch.randn(cu[-1], 4, 32, generator=g).bfloat16() for _ in "kv")


def sent(layout, mode, mask):
    """The bytes each rank sends in one forward + backward, from the trace."""
    sharding = cpref.Sharding(cu, cp_size=P, layout=layout)

    def on_rank(comm):
        qkv = [sharding.shard(x, comm.rank).requires_grad_() for x in (q, k, v)]
        out = cpref.attention(*qkv, sharding, comm=comm, mode=mode, mask=mask,
                              **cpref.MODES[mode].example_options(P))
        out.float().square().sum().backward()

    cluster = SimCluster(P)
    cluster.run(on_rank)
    moved = [e for e in cluster.trace if e.param != "host"]  # not the check
    return [sum(e.bytes_sent[e.group.index(r)] for e in moved if r in e.group)
            for r in range(P)]


SHOWN = {"no mask": None, "causal": MASKS["causal documents"],
         "prefix-LM": MASKS["prefix-LM"], "spans": MASKS["image spans"],
         "shared": MASKS["shared prompt"]}
moved = {(layout, mode, name): sent(layout, mode, mask)
         for layout in ("zigzag", "stream") for mode in cpref.MODES
         for name, mask in SHOWN.items()}
print("\nKiB each rank sends, forward + backward (bf16, 512 tokens, P = 4):")
print(f"{'':18}" + "".join(f"{name:>12}" for name in SHOWN))
for layout in ("zigzag", "stream"):
    for mode in cpref.MODES:
        cells = [moved[layout, mode, name] for name in SHOWN]
        text = [f"{min(c) / 1024:g}" + ("" if min(c) == max(c) else
                f"-{max(c) / 1024:g}") for c in cells]  # the same on each rank?
        print(f"{layout:>7} {mode:>10}" + "".join(f"{t:>12}" for t in text))
# --8<-- [end:traffic]
