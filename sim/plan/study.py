r"""The modes from 8 to 1024 ranks: every mode's predicted step, and where the best one changes.

The [planner][sim.plan.planner] answers for one batch and one cluster. This page asks it the
question a team sizing a long-context run asks first: **as the CP group grows, which mode wins,
and where does that change?** It runs the planner for a 128k-token packed batch at
$P = 8, 16, \dots, 1024$ on two of the published [profiles][sim.plan.profile] (eight H100s per node
over NVLink with InfiniBand across; eight Ascend 910Bs per node over HCCS with RoCE across), with
the heads of a Llama-3-8B-like layer ($H_q = 32$, $H_{kv} = 8$, $D = 128$) and a Llama-3-70B-like
one ($H_q = 64$, $H_{kv} = 8$), and keeps each mode's best candidate (its best layout and
options) at every $P$. Everything below is computed when this site is built
([`curves`][sim.plan.study.curves]); at $P = 1024$ the plans are [built at
scale][sim.plan.scale], every rank of every candidate.

{{ figure figures/study_h100.png }}

{{ figure figures/study_910b.png }}

## What the curves say

In the contiguous and zigzag layouts (the [next section](#documents-kept-whole) says what the
layouts that keep documents whole change):

* **Inside one node ($P = 8$) the fabric and the head count decide.** On the H100s the ring
  (`p2p`) wins for the 8B-like heads, NVLink carrying each shift behind its step, where
  Ulysses' (`a2a`) blocking all-to-alls stay exposed; for the 70B-like heads the overlapped
  all-gather (`overlap=True`) edges past it: twice the query heads give its local call twice the
  work to hide the gather behind. On the 910Bs Ulysses wins for the 8B-like heads and the
  overlapped all-gather for the 70B-like, and the ring comes last: its shifts go over one HCCS
  link (19 GB/s, the profile's `send_recv_bandwidth_GBps`), too slow to hide.
* **From the first node boundary on ($P \ge 16$) `a2a+p2p` wins**, on both machines and for
  both head counts, with `a2a_size` = 8 (the ranks of one node, USP's advice) or 4 up to 128
  ranks: the all-to-alls stay inside a node and the ring across nodes has $P / a$ steps on
  blocks $a$ times larger. Past 128 ranks larger groups win, spanning nodes: with a few hundred
  tokens a rank, a ring of $P / 8$ steps pays each kernel call's fixed cost too often.
* **Ulysses alone** is second from 16 ranks on (its all-to-alls cross nodes) and stops where
  the heads do: at $P = H_q$ = 32 (8B-like) or 64 (70B-like).
* **The ring and all-gather gain nothing past the first node boundary.** From 16 to 1024 ranks
  their step never falls below four fifths of what it is at 16, where perfect scaling falls
  64-fold. On a packed batch a ring step's work falls as $\sum_i L_i^2 / P^2$ (attention stays
  inside documents) while every shift still moves $T / P$ tokens' K/V, now over InfiniBand or
  RoCE; all-gather moves the whole stream's K/V each way whatever $P$ is.
* **Nothing scales past about 64 ranks for 128k tokens.** The best step levels off (about 6 to
  7.5 ms a layer on the H100s, 14 to 18 on the 910Bs) while perfect scaling keeps falling: at 2k
  tokens a rank and fewer, the calls and messages are too small for their fixed costs. Longer
  documents move the limit: one document of 1M tokens still scales on the ring to 128 ranks
  (the table "One long document").

## Documents kept whole

The stream and balanced layouts keep most documents on one rank, so the modes move only the
documents that span ranks ([`cpref.batch.balanced`][cpref.batch.balanced]). Every mode's plan over them is
built at scale ([`sim.plan.scale_window`][sim.plan.scale_window], [`sim.plan.scale_split`][sim.plan.scale_split]),
so the planner prices them at every $P$ ([`whole_curves`][sim.plan.study.whole_curves]); the curves above keep to
the chunked layouts, the layouts of the published comparisons below. Each mode's best over stream or
balanced (solid) beside its best over contiguous or zigzag (dotted), on the H100s with the 8B-like heads:

{{ figure figures/study_whole_h100.png }}

* **Kept whole, the packed batch scales past 64 ranks.** `a2a+p2p` over stream or balanced
  keeps falling all the way to 1024 ranks, to about 1.4 ms a layer, under a quarter of its best
  in the chunked layouts there: a rank's own documents need no communication, and only the rows
  of the documents that span ranks go through the all-to-all and round the ring, where a chunked
  layout cuts every document over every rank. So "nothing scales past about 64 ranks" above is
  the chunked layouts' verdict, not the batch's.
* **The ring** over stream or balanced is at its best at 128 ranks, under a fifth of its chunked
  step there, and slower again beyond: its $P$ steps each pay a kernel call's and a message's
  fixed cost.
* **All-gather and Ulysses gain nothing** from keeping documents whole past one node: at 16
  ranks and more nearly every rank's rows belong to a document that spans ranks, so the
  all-gather still moves nearly the whole stream's K/V, and Ulysses' all-to-all every rank's rows.

At 8 and 16 ranks (the table "Documents kept whole, at 8 and 16 ranks" below, H100s, 8B-like heads),
each mode's best candidate in them against its best in contiguous or zigzag:

* inside one node, `all_gather` over balanced with `overlap=True` is the fastest candidate of
  all: it gathers only the shared rows, behind the local call;
* at 16 ranks `a2a+p2p` still wins, and faster over balanced than over zigzag;
* the ring over balanced takes at most half its zigzag step at 16 ranks: it sends only the rows
  of the documents that span ranks.

## Against published results

* **USP** (Fang and Zhao 2024, [arXiv 2405.07719](https://arxiv.org/abs/2405.07719), section 3)
  advises, for Llama-3-8B at 16-way sequence parallelism, "set the Ulysses degree to 8 and the
  ring degree to 2". The planner's winner at 16 ranks for the 8B-like heads, on both machines,
  is `a2a+p2p` with `a2a_size=8`: **agrees** (for the 70B-like heads on the H100s it picks 4).
* **Ulysses against the ring inside one NVLink node.** The USP repository's README ("If the
  head number is enough, Ulysses outperforms Ring-Attention", 8 A100s), EasyContext
  ([issue 37](https://github.com/jzhang38/EasyContext/issues/37): Ulysses about 15 % faster on
  8 A100s) and yunchang
  ([issue 40](https://github.com/feifeibear/long-context-attention/issues/40): 60 ms against
  over 100 ms, 8 heads) all put Ulysses first. The planner puts the ring a few percent ahead on
  the H100s at $P = 8$: **disagrees**. What it leaves out is the ring's: each step's merge of
  the partial output (an elementwise pass over the rank's output, $P$ times), host time
  between the $2P$ calls, and the kernel's lower efficiency on split blocks (the zigzag ring at
  about 85 % of the unsplit kernel in ring-flash-attention's benchmark on 8 H800s, as the USP
  README quotes it); any one is larger than the margin. On the 910Bs, whose ring shifts are
  slow, it puts Ulysses first.
* **Megatron's guidance** (Megatron-Bridge's performance guide, "Long Sequence Training"):
  `p2p` for small and medium CP, and for strong scaling at large CP "`a2a+p2p` ought to be the
  preferred choice", where chunks become too short to hide the ring's transfers. **Agrees**:
  `a2a+p2p` wins every P from two nodes on, and for one long document (the table below) the
  ring ties it up to 16 ranks.
* **Llama 3** ([arXiv 2407.21783](https://arxiv.org/abs/2407.21783), section 3.3.2) chose
  all-gather CP for its 128k training: with GQA the exposed all-gather is small against
  attention's $O(S^2)$. For one 128k document on eight H100s the planner puts the overlapped
  all-gather first and all four modes within 1 % of each other: **agrees**. It also shows where
  the argument stops: across nodes (at 16 ranks the all-gather is a third slower than the best,
  over InfiniBand) and on packed batches, whose attention is $\sum_i L_i^2$, not $T^2$, while
  the all-gather still moves all $T$ tokens.
* **Meta's million-token inference** ([arXiv 2411.01783](https://arxiv.org/abs/2411.01783))
  ran a pass-KV ring over 128 H100s in 16 nodes at 93 % parallel efficiency for a 1M-token
  prefill. The planner's ring on one 1M document (forward and backward) keeps within a few
  percent of perfect scaling from 8 to 128 ranks: **agrees**, as a ceiling (no host time, no
  contention in the model).
* **Head limits.** TransformerEngine's `a2a` needs the CP size to divide the key/value heads
  (Megatron-Bridge's hierarchical-CP guide: "8 KV heads ... at most CP=8"); cpref replicates
  key/value heads when the a2a group is a multiple of $H_{kv}$, so its Ulysses runs up to
  $H_q$ ranks. The curves' `a2a` past 8 ranks, and `a2a+p2p` groups larger than 8, have no
  TransformerEngine counterpart.
* **Not compared:** NVIDIA's long-sequence tables (NeMo, Llama-2-7B in FP8 on H100s, CP up to
  32, 536 to 610 TFLOP/s per GPU from 32k to 1M tokens) measure a whole model's step with
  tensor parallelism and FP8, neither of which the planner models.

## Assumptions

* One packed batch of 131 072 tokens, documents drawn from `lognormal:8192,1.0`
  ([`sim.plan.batches`][sim.plan.batches], seed 0); every layout pads each document to its
  multiple ($2P$ tokens for zigzag: at $P = 1024$ a document of a few hundred tokens is padded
  to 2048), as a real run would.
* Full causal attention, bf16, forward and backward of one layer; the step is the slowest
  rank's (the others wait for it at the next collective).
* The candidates are those [built at scale][sim.plan.scale] at every $P$: `p2p`, `all_gather`
  and `a2a+p2p` (every `a2a_size` dividing $P$, with and without head groups) in the contiguous
  and zigzag layouts, `all_gather` with and without `overlap`, and `a2a` with and without head
  groups. The stream and balanced layouts have curves of their own (the section "Documents kept
  whole", H100s and 8B-like heads): every mode, with the same options.
* The [time model][sim.plan.model] and the profiles' published rates: no contention between a
  rank's communication and its compute, no host time outside kernels and collectives, a
  collective priced by the slowest link it crosses (at the node boundary of a ring, the
  InfiniBand or RoCE hop), kernel calls on the profile's throughput curve.

Example:
    >>> from sim.plan.study import curves
    >>> c = curves("h100-sxm", (32, 8, 128, 128), Ps=(8, 16))
    >>> c.winners, c.crossovers
    (('p2p', 'a2a+p2p'), ((8, 16, 'p2p', 'a2a+p2p'),))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

from sim.plan.batches import sample
from sim.plan.planner import Plan, plan
from sim.plan.profile import Profile, load_profile

__all__ = ["STUDY_P", "MODELS", "PROFILES", "Point", "Curves", "study_batch", "scan", "curves_of", "curves", "whole_curves",
           "best_per_mode", "documents_kept_whole", "MODES_SHOWN", "WHOLE_LAYOUTS"]

STUDY_P = (8, 16, 32, 64, 128, 256, 512, 1024)
MODELS = {"Llama-3-8B-like": (32, 8, 128, 128), "Llama-3-70B-like": (64, 8, 128, 128)}
PROFILES = ("h100-sxm", "ascend-910b")
MODES_SHOWN = ("a2a", "a2a+p2p", "p2p", "all_gather")
WHOLE_LAYOUTS = ("stream", "balanced")


def study_batch() -> tuple[int, ...]:
    """The 128k-token packed batch of the study (module docstring)."""
    return tuple(sample("lognormal:8192,1.0", tokens=131072, batches=1, seed=0)[0])


@dataclass(frozen=True)
class Point:
    """A mode's best candidate at one P: its name, step, and the slowest rank's compute and exposed communication
    (seconds); `decided_by`: the planner's words for the winner at this P."""

    P: int
    name: str
    step: float
    compute: float
    exposed: float


@dataclass(frozen=True)
class Curves:
    """Per mode, its best `Point` at each P of `Ps` (None: no candidate of the mode runs there); the winning mode per
    P; `crossovers`: `(P before, P after, mode before, mode after)` where the winner changes; `decided_by` per P."""

    profile: str
    heads: tuple[int, int, int, int]
    Ps: tuple[int, ...]
    points: dict[str, tuple[Point | None, ...]]
    winners: tuple[str, ...]
    decided_by: tuple[str, ...]

    @property
    def crossovers(self) -> tuple[tuple[int, int, str, str], ...]:
        """Where the winning mode changes between consecutive P."""
        return tuple((p0, p1, w0, w1) for p0, p1, w0, w1 in zip(self.Ps, self.Ps[1:], self.winners, self.winners[1:])
                     if w0 != w1)  # fmt: skip


def scan(lengths, *, heads: tuple[int, int, int, int], dtype: str, Ps: tuple[int, ...], profile: str | Profile,
         **planner: Any) -> dict[str, Curves]:  # fmt: skip
    """Each layer kind's `Curves` over `Ps`: the planner (`sim.plan.plan`, its other arguments in `planner`) at every
    P, each mode's best candidate kept (`curves_of`). A P where no candidate of a kind runs, or a P the planner
    refuses, raises as the planner does; a mode none of whose candidates runs at a P has None there.

    Raises:
        CPInputError: as `plan` refuses, naming the value (and the P).
    """
    profile = profile if isinstance(profile, Profile) else load_profile(profile)
    return curves_of([plan(lengths, heads=heads, dtype=dtype, P=P, profile=profile, **planner) for P in Ps])


def curves_of(plans: Sequence[Plan]) -> dict[str, Curves]:
    """Each layer kind's `Curves` over the plans of one batch at several P (`scan`'s, or a caller's that keeps the
    plans: `python -m sim plan --cp 8,16 --layers ...` prices a model's layers from the same plans)."""
    rows: dict[str, list] = {}
    for result in plans:
        for kind, kp in result.kinds.items():
            best = {mode: next((p for p in kp.ranked if p.candidate.mode == mode), None) for mode in MODES_SHOWN}
            rows.setdefault(kind, []).append((best, kp.ranked[0].candidate.mode, kp.decided_by))
    Ps, out = tuple(r.P for r in plans), {}
    for kind, per_P in rows.items():
        points = {mode: tuple(b[mode] and Point(P, b[mode].name, b[mode].step, b[mode].slowest.compute,
                                                b[mode].slowest.exposed) for P, (b, _, _) in zip(Ps, per_P))
                  for mode in MODES_SHOWN}  # fmt: skip
        out[kind] = Curves(plans[0].profile.name, plans[0].heads, Ps, points, tuple(w for _, w, _ in per_P),
                           tuple(d for _, _, d in per_P))  # fmt: skip
    return out


@functools.lru_cache(maxsize=8)
def curves(profile: str, heads: tuple[int, int, int, int], Ps: tuple[int, ...] = STUDY_P) -> Curves:
    """The study's curves for one profile and one head configuration (module docstring): `scan` of the study's batch
    with its candidates; cached, so that the page's figures and table share one run."""
    return scan(list(study_batch()), heads=heads, dtype="bfloat16", Ps=Ps, profile=profile,
                layouts=["contiguous", "zigzag"], dry_run_limit=1)["full"]  # fmt: skip


@functools.lru_cache(maxsize=4)
def whole_curves(profile: str, heads: tuple[int, int, int, int], Ps: tuple[int, ...] = STUDY_P) -> Curves:
    """`curves` with the candidates of the layouts that keep documents whole (`WHOLE_LAYOUTS`) instead of the
    chunked ones, every rank of every candidate built at scale: the section "Documents kept whole"."""
    return scan(list(study_batch()), heads=heads, dtype="bfloat16", Ps=Ps, profile=profile,
                layouts=list(WHOLE_LAYOUTS), dry_run_limit=1)["full"]  # fmt: skip


def best_per_mode(lengths: tuple[int, ...], heads: tuple[int, int, int, int], profile: str, P: int) -> dict[str, Point]:
    """Each mode's best candidate for one batch at one P, with the study's candidates (fastest first)."""
    result = plan(list(lengths), heads=heads, dtype="bfloat16", P=P, profile=profile, layouts=["contiguous", "zigzag"],
                  dry_run_limit=1).kinds["full"]  # fmt: skip
    best: dict[str, Point] = {}
    for p in result.ranked:
        best.setdefault(p.candidate.mode, Point(P, p.name, p.step, p.slowest.compute, p.slowest.exposed))
    return best


@functools.lru_cache(maxsize=4)
def documents_kept_whole(profile: str, heads: tuple[int, int, int, int], P: int) -> dict[str, tuple[Point, Point]]:
    """Per mode, its best candidate in the chunked layouts and its best in `WHOLE_LAYOUTS`, on the study's batch at
    `P` with every candidate (dry-run where `sim.plan.scale` does not cover it): `(chunked, whole)`; the winner
    overall under the key `"winner"` (both entries the same point)."""
    result = plan(list(study_batch()), heads=heads, dtype="bfloat16", P=P, profile=profile).kinds["full"]
    out: dict[str, tuple[Point, Point]] = {}
    for mode in MODES_SHOWN:
        pair = [next((p for p in result.ranked if p.candidate.mode == mode and (p.candidate.layout in WHOLE_LAYOUTS) == whole),
                     None) for whole in (False, True)]  # fmt: skip
        if all(pair):
            out[mode] = tuple(Point(P, p.name, p.step, p.slowest.compute, p.slowest.exposed) for p in pair)
    w = result.ranked[0]
    out["winner"] = (Point(P, w.name, w.step, w.slowest.compute, w.slowest.exposed),) * 2
    return out
