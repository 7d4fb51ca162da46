r"""The planner: every mode, layout and option priced on every rank, ranked, the deciding term named.

[`plan`][sim.plan.planner.plan] takes a batch (document lengths), the model's heads, a dtype,
the CP size and a [profile][sim.plan.profile]; for each layer kind (full causal, a window, a
chunk) it dry-runs every candidate on every rank ([`sim.plan.dry`][sim.plan.dry]), prices each
rank's timeline ([`sim.plan.model`][sim.plan.model]) and ranks the candidates by the slowest
rank's step. A candidate the mode refuses (heads that do not split, an `a2a_size` that does not
divide P, an overlap under a window) is listed with the refusal, as `cpref.attention` words it.

The candidates: `p2p`; `all_gather`, and with `overlap=True`; `a2a`, and in head groups of 2 and
4; `a2a+p2p` for every `a2a_size` that divides P strictly between 1 and P, and with head groups
of 2; each in the four layouts. Documents are padded at their end as each layout needs
([`Sharding.eod_padded`][cpref.batch.sharding.Sharding.eod_padded]), as a user's batch would be.

**A model's layers share one layout.** The batch is sharded once, so a model that interleaves
window and full layers (or chunked ones) runs one layout in all of them; what may differ per
layer is the mode and its options (Megatron takes a per-layer `cp_comm_type` list). The best
candidate of each kind alone may pick different layouts; [`Plan.by_layout`][sim.plan.planner.Plan.by_layout]
answers for the model: per layout, each kind's best candidate there and the model's step,
$\sum_k n_k\, t_k$ over its $n_k$ layers of each kind, fastest first (`--layers full=24,window=24`).

**The deciding term.** Between the winner and the best candidate of another mode, the term of the slowest rank's step
(compute, or exposed communication) by which the runner-up loses most is named: "exposed
communication" means the winner hides or avoids traffic the other waits for; "compute" that it
spreads the work better or makes fewer, larger calls. With several batches (`sim.plan.batches`) a
candidate's step is its mean over them, and its terms are those of its slowest batch.

**What it answers, and from what.** Each prediction is built from the counts of the mode's own
code (the dry run: every kernel call's work, every collective's bytes, group and peer, the order
of posts, waits and calls, the saved tensors), so a plan's traffic and work equal the simulated
cluster's (`tests/plan/test_dry_run.py`); what is modelled is only their *time*, by the
[time model][sim.plan.model] and a [profile][sim.plan.profile]. On this machine the model is held
to the measurement by `bench/scaling.py`, which calibrates the `this-machine` profile and prints
each mode's predicted step beside its measured one ([Strong scaling over gloo](perf-scaling.md#the-planners-predictions)).

**What it leaves out.** Time outside kernel calls and collectives (argument checks, plan lookups,
merges, copies: a few percent of a long step, more of a short one); a collective's wait for a peer
that is still computing (each rank is priced alone; the layer's step is the slowest rank's);
contention between a rank's communication and its compute for the same cores or memory; and the
plans' own building on the host, once per batch (the windowed, stream and balanced rings' plans
take every rank's pieces into account on every rank: a sweep over the pieces that see each other).

**Soft-capped layers** (`softcap=c`, `--softcap C`: Gemma 2's $c \tanh(S / c)$) change no count, only
what each kernel call costs: every call is priced at the profile's `softcap_factor` times its time
([`Profile.kernel`][sim.plan.profile.Profile.kernel]). No published profile has the factor (no
public figure was found), so there the plan is refused by name; `--calibrate` measures it here.

**At scale.** Dry-running every rank costs a ring of $P$ ranks $P^2$ steps: seconds at $P = 8$,
minutes at 64. Where [`sim.plan.scale`][sim.plan.scale] covers a candidate (full causal `p2p`,
`all_gather` with or without `overlap`, and `a2a+p2p` with or without head groups, in the contiguous
and zigzag layouts; `all_gather` under a window there too) it builds every rank's calls and
collectives as arrays and plays all timelines at once, equal to the dry run rank by rank (tested at
P = 2 to 8), the whole plan at $P = 1024$ in seconds (`bench/plan.py` measures it beside the dry run); so does
[`sim.plan.scale_window`][sim.plan.scale_window] for `p2p` on the ring over pieces (under a window or
chunks, and over the stream and balanced layouts), `a2a+p2p` under a window or chunks, and
`all_gather`'s one call on the pieces' plan (chunks, the stream and balanced layouts); and
[`sim.plan.scale_split`][sim.plan.scale_split] for `a2a` and `a2a+p2p` over the stream and balanced layouts (own
rows at home, shared rows exchanged). `a2a`, whose ranks all do the same in the chunked layouts, is dry-run on
rank 0 alone. A candidate none of them covers (none the planner makes today; `all_gather` with both `overlap`
and `save_gathered_kv` over stream and balanced, say) is dry-run up to `dry_run_limit` ranks (32) and listed as
not priced above it.

Example:
    >>> from sim.plan import plan
    >>> result = plan([4096, 2048, 2048], heads=(8, 2, 64, 64), dtype="bfloat16", P=4, profile="h100-sxm",
    ...               modes=["p2p", "a2a"], layouts=["zigzag"])
    >>> [p.name for p in result.kinds["full"].ranked]
    ['a2a zigzag', 'p2p zigzag']
    >>> result.kinds["full"].decided_by  # the ring's eight kernel calls pay the curve's per-call cost eight times
    'compute: 0.127 ms against 0.306 ms for p2p zigzag'
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from cpref.base.errors import CPInputError
from cpref.batch.seqlens import LAYOUTS
from cpref.kernels.contract import check_softcap
from sim.plan import scale
from sim.plan.dry import dry_run
from sim.plan.model import RankTime, rank_time
from sim.plan.profile import Profile, load_profile
from sim.plan.scale_split import split_a2a_covers, split_a2a_schedule, split_hierarchy_covers, split_hierarchy_schedule
from sim.plan.scale_window import (
    piece_all_gather_covers,
    piece_all_gather_schedule,
    piece_ring_covers,
    piece_ring_schedule,
)

__all__ = ["Candidate", "Prediction", "KindPlan", "Plan", "LayoutChoice", "candidates", "plan"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
UNSCALED = ("only the dry run prices it (no builder of sim.plan.scale, scale_window or scale_split covers it), one rank "
            "at a time; raise dry_run_limit to wait for it")


@dataclass(frozen=True)
class Candidate:
    """A mode, a layout and the mode's options."""

    mode: str
    layout: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        """`mode layout option=value ...`."""
        return " ".join([self.mode, self.layout, *(f"{k}={v}" for k, v in self.options)])


@dataclass(frozen=True)
class Prediction:
    """A candidate priced on every rank (`ranks`), refused by its mode (`refused`: the reason), or not priced at this
    P (`unpriced`: why)."""

    candidate: Candidate
    ranks: tuple[RankTime, ...] = ()
    refused: str = ""
    unpriced: str = ""
    batch_steps: tuple[float, ...] = ()  # with several batches: each one's step; `ranks` are the slowest batch's

    @property
    def name(self) -> str:
        """The candidate's name."""
        return self.candidate.name

    @property
    def slowest(self) -> RankTime:
        """The rank whose step is the layer's."""
        return max(self.ranks, key=lambda r: r.step)

    @property
    def step(self) -> float:
        """The layer's step: the slowest rank's, in seconds (with several batches, the mean over them)."""
        return sum(self.batch_steps) / len(self.batch_steps) if self.batch_steps else self.slowest.step

    @property
    def peak_saved_bytes(self) -> int:
        """The most bytes a rank saves for the backward."""
        return max(r.saved_bytes for r in self.ranks)


@dataclass(frozen=True)
class KindPlan:
    """One layer kind's candidates: `ranked` (fastest first), `refused`, `unpriced`, and what decided the winner;
    `mask`: the kind's arguments of `cpref.attention` as pairs (`(("window", (W, 0)),)`, `(("chunk", C),)`, `()` for full
    causal, `(("mask", None),)` for a `cpref.Mask`, one per batch)."""

    kind: str
    ranked: tuple[Prediction, ...]
    refused: tuple[Prediction, ...]
    decided_by: str
    unpriced: tuple[Prediction, ...] = ()
    mask: tuple[tuple[str, Any], ...] = ()
    balanced_by_mask: bool = False  # the balanced layout's sharding places tokens by the planned cpref.Mask

    @property
    def against(self) -> Prediction | None:
        """The candidate `decided_by` names: the best of another mode than the winner's (else the runner-up); None
        with a single candidate."""
        return _rival(self.ranked)


@dataclass(frozen=True)
class Plan:
    """The planner's answer: per layer kind (`"full"`, `"window ..."`, `"chunk ..."`), its `KindPlan`; `batches`, the
    batches it was asked about (one, or several sampled)."""

    P: int
    profile: Profile
    heads: tuple[int, int, int, int]
    dtype: str
    batches: tuple[tuple[int, ...], ...]
    kinds: dict[str, KindPlan] = field(default_factory=dict)
    softcap: float | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        """The (first) batch's documents."""
        return self.batches[0]

    def by_layout(self, layers: dict[str, int]) -> list["LayoutChoice"]:
        """A model of `layers[kind]` layers of each kind, over **one** layout: the batch is sharded once, so every
        layer runs the same layout, each kind with its own best mode and options there (a per-layer mode is what
        Megatron's list of `cp_comm_type` allows). Per layout every kind of `layers` can run in, its picks and the
        model's step, the sum of `layers[kind]` times each pick's step; fastest first.

        Raises:
            CPInputError: for a kind this plan has not priced, or a count that is not a positive int.
        """
        for kind, count in layers.items():
            if kind not in self.kinds:
                raise CPInputError(f"layers: no {kind!r} layer kind in this plan; its kinds are {list(self.kinds)} (a "
                                   "window or chunk kind needs window= or chunk=)")  # fmt: skip
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise CPInputError(f"layers[{kind!r}]={count!r}: give the number of such layers, a positive int")
        out = []
        for layout in dict.fromkeys(p.candidate.layout for kp in self.kinds.values() for p in kp.ranked):
            picks = {kind: next((p for p in self.kinds[kind].ranked if p.candidate.layout == layout), None)
                     for kind in layers}  # fmt: skip
            if all(picks.values()):
                out.append(LayoutChoice(layout, picks, sum(layers[k] * picks[k].step for k in layers)))
        return sorted(out, key=lambda c: (c.step, LAYOUTS.index(c.layout)))


@dataclass(frozen=True)
class LayoutChoice:
    """One layout for a whole model (`Plan.by_layout`): each layer kind's best candidate in it, and the model's step
    (seconds: every layer's forward and backward, the slowest rank's)."""

    layout: str
    picks: dict[str, Prediction]
    step: float


def candidates(P: int, modes: Sequence[str], layouts: Sequence[str], a2a_size: int | None = None) -> list[Candidate]:
    """Every candidate of the module docstring for CP size `P`, in `modes` and `layouts` (`a2a+p2p` with `a2a_size`
    alone where one is given)."""
    sizes = [a2a_size] if a2a_size is not None else [a for a in range(2, P) if P % a == 0]
    per_mode = {"p2p": [()], "all_gather": [(), (("overlap", True),)],
                "a2a": [(), (("head_groups", 2),), (("head_groups", 4),)],
                "a2a+p2p": [(("a2a_size", a),) + hg for a in sizes for hg in ((), (("head_groups", 2),))]}  # fmt: skip
    return [Candidate(m, la, o) for m in modes for la in layouts for o in per_mode[m]]


@functools.lru_cache(maxsize=16)
def _sharding(lengths: tuple[int, ...], P: int, layout: str, balance: Any = None):
    """The batch padded as `layout` needs (balanced by the mask `balance`, where one is planned); one object per
    (batch, P, layout, mask), so that candidates share its plans."""
    from cpref.batch.sharding import Sharding

    balance = balance if layout == "balanced" else None
    return Sharding.eod_padded([0, *itertools.accumulate(lengths)], cp_size=P, layout=layout, mask=balance)


def predict(candidate: Candidate, lengths: Sequence[int], *, heads, dtype: str, P: int, profile: Profile,
            mask: dict[str, Any], dry_run_limit: int = 32, softcap: float | None = None,
            balance: Any = None) -> Prediction:  # fmt: skip
    """`candidate` priced on every rank, or refused: built at scale where `sim.plan.scale` covers it, else dry-run
    (on rank 0 alone where every rank does the same), else, above `dry_run_limit` ranks, not priced. Soft-capped
    (`softcap`), the dry run runs with it and every call costs the profile's `softcap_factor` times as much. Under a
    `cpref.Mask` (`mask["mask"]`) every rank is dry-run; `balance`, the mask the balanced layout places tokens by."""
    compute = profile.kernel(dtype, softcap=softcap is not None)
    if softcap is not None:
        mask = {**mask, "softcap": softcap}
    sharding = _sharding(tuple(lengths), P, candidate.layout, balance)
    options = dict(candidate.options)
    try:
        counted = {k: v for k, v in mask.items() if k != "softcap"}  # soft-capping changes no count
        if "mask" in counted:  # no builder at scale states a mask's plan: the modes' own code, on every rank
            if P > dry_run_limit:
                scale.validate(candidate.mode, sharding, heads, DTYPES[dtype], {**mask, **options})
                return Prediction(candidate, unpriced=f"P = {P} > dry_run_limit = {dry_run_limit}: a mask is priced "
                                                      "by dry-running every rank")  # fmt: skip
            runs = [dry_run(candidate.mode, sharding, r, heads=heads, dtype=DTYPES[dtype], **mask, **options)
                    for r in range(P)]  # fmt: skip
            return Prediction(candidate, tuple(rank_time(run, profile, compute) for run in runs))
        if scale.covers(candidate.mode, candidate.layout, options, P, counted):
            built = scale.schedule(candidate.mode, sharding, heads=heads, dtype=DTYPES[dtype], **counted, **options)
            return Prediction(candidate, built.price(profile, compute))
        for covered, build in ((piece_ring_covers, piece_ring_schedule), (piece_all_gather_covers, piece_all_gather_schedule),
                               (split_a2a_covers, split_a2a_schedule),
                               (split_hierarchy_covers, split_hierarchy_schedule)):  # fmt: skip
            if covered(candidate.mode, candidate.layout, options, P, counted):  # the builder refuses as the mode does
                built = build(sharding, heads=heads, dtype=DTYPES[dtype], **counted, **options)
                return Prediction(candidate, built.price(profile, compute))
        if scale.a2a_alike(candidate.mode, candidate.layout, mask):
            runs = scale.alike_runs(dry_run(candidate.mode, sharding, 0, heads=heads, dtype=DTYPES[dtype], **mask,
                                            **options), P)  # fmt: skip
        elif P > dry_run_limit:
            scale.validate(candidate.mode, sharding, heads, DTYPES[dtype], {**mask, **options})  # refused, or not priced
            return Prediction(candidate, unpriced=f"P = {P} > dry_run_limit = {dry_run_limit}: {UNSCALED}")
        else:
            runs = [dry_run(candidate.mode, sharding, r, heads=heads, dtype=DTYPES[dtype], **mask, **options)
                    for r in range(P)]  # fmt: skip
    except CPInputError as refused:
        return Prediction(candidate, refused=str(refused))
    return Prediction(candidate, tuple(rank_time(run, profile, compute) for run in runs))


def _over_batches(preds: list[Prediction]) -> Prediction:
    """One batch's prediction as it is; several batches' as one: their mean step, the slowest batch's ranks."""
    if len(preds) == 1 or any(p.refused or p.unpriced for p in preds):
        return next((p for p in preds if p.refused or p.unpriced), preds[0])
    worst = max(preds, key=lambda p: p.step)
    return Prediction(worst.candidate, worst.ranks, batch_steps=tuple(p.step for p in preds))


def _order(p: Prediction) -> tuple:
    """Fastest first; at equal steps, fewer bytes moved, less memory, then the simpler mode (`cpref.MODES` order)."""
    from cpref import MODES

    moved = sum(sum(r.bytes.values()) for r in p.ranks)
    return p.step, moved, p.peak_saved_bytes, MODES[p.candidate.mode].order, LAYOUTS.index(p.candidate.layout)


def _rival(ranked: Sequence[Prediction]) -> Prediction | None:
    """The best candidate of another mode than the winner's, else the runner-up; None with fewer than two."""
    if len(ranked) < 2:
        return None
    return next((p for p in ranked[1:] if p.candidate.mode != ranked[0].candidate.mode), ranked[1])


def _decided_by(ranked: Sequence[Prediction]) -> str:
    """The term by which the best candidate of another mode (else the next one) loses to the winner."""
    rival = _rival(ranked)
    if rival is None:
        return "the only candidate"
    if rival.step == ranked[0].step:
        mine, theirs = _order(ranked[0]), _order(rival)
        why = next(w for w, a, b in zip(("", "fewer bytes moved", "less memory saved", "the simpler mode", "the simpler layout"),
                                        mine, theirs) if a != b)  # fmt: skip
        return f"a tie in step time with {rival.name} ({ranked[0].step * 1e3:.3f} ms), broken by {why}"
    win, other = ranked[0].slowest, rival.slowest
    terms = {"compute": (win.compute, other.compute), "exposed communication": (win.exposed, other.exposed)}
    name, (w, o) = max(terms.items(), key=lambda kv: kv[1][1] - kv[1][0])
    return f"{name}: {w * 1e3:.3f} ms against {o * 1e3:.3f} ms for {rival.name}"


def _check(lengths, heads, dtype, P, modes, layouts, a2a_size) -> None:
    from cpref import MODES

    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise CPInputError(f"lengths={list(lengths)!r}: give the documents' token counts, positive ints")
    if not (isinstance(heads, (tuple, list)) and len(heads) == 4 and all(isinstance(h, int) and h > 0 for h in heads)):
        raise CPInputError(f"heads={heads!r}: give (Hq, Hkv, D, Dv), positive ints")
    if heads[0] % heads[1]:
        raise CPInputError(f"heads={tuple(heads)!r}: Hq = {heads[0]} is not a multiple of Hkv = {heads[1]}")
    if dtype not in DTYPES:
        raise CPInputError(f"dtype={dtype!r}: give one of {sorted(DTYPES)}")
    if isinstance(P, bool) or not isinstance(P, int) or P < 1:
        raise CPInputError(f"P={P!r}: give the CP size, a positive int")
    if a2a_size is not None and (isinstance(a2a_size, bool) or not isinstance(a2a_size, int) or a2a_size < 1
                                 or P % a2a_size):  # fmt: skip
        raise CPInputError(f"a2a_size={a2a_size!r} does not divide P = {P}: give a divisor of P (the ranks of one "
                           "a2a group, typically a node's), or none to try every divisor")  # fmt: skip
    for name, given, known in (("mode", modes, list(MODES)), ("layout", layouts, list(LAYOUTS))):
        unknown = [x for x in given if x not in known]
        if unknown:
            raise CPInputError(f"unknown {name} {unknown[0]!r}: give some of {known}")


def plan(lengths: Sequence[int] | Sequence[Sequence[int]], *, heads: tuple[int, int, int, int], dtype: str, P: int,
         profile: str | Profile, window: int | None = None, chunk: int | None = None,
         modes: Sequence[str] | None = None, layouts: Sequence[str] | None = None,
         a2a_size: int | None = None, dry_run_limit: int = 32, softcap: float | None = None,
         mask: Any = None, mask_name: str = "mask") -> Plan:  # fmt: skip
    """Rank every candidate for a batch, per layer kind (module docstring).

    Args:
        lengths: the batch's documents, in tokens; or several batches (a list of such lists, `sim.plan.batches`),
            each candidate then ranked by its mean step over them.
        heads: `(Hq, Hkv, D, Dv)`.
        dtype: `"bfloat16"`, `"float16"` or `"float32"`.
        P: the CP size.
        profile: a shipped profile's name, a file, or a loaded `Profile`.
        window: a causal sliding window of this many keys: a layer kind of its own beside full causal.
        chunk: chunked attention of this many positions: a layer kind of its own.
        modes: the modes to consider (default: all).
        layouts: the layouts to consider (default: all).
        a2a_size: `a2a+p2p`'s group size (default: every divisor of P strictly between 1 and P).
        dry_run_limit: above this many ranks, a candidate that only the dry run prices is listed as not priced
            (`sim.plan.scale` builds the others at any P).
        softcap: every layer's logits soft-capped at this value (Gemma 2): the same counts, every kernel call
            priced at the profile's `softcap_factor` times its time (refused on a profile without one).
        mask: the model's attention mask in place of full causal: a `cpref.Mask` of the batch, or (several
            batches) a function of a batch's lengths returning its mask. Its layers are the kind
            `"mask {mask_name}"`, every rank dry-run; the balanced layout is then balanced by the mask, in every kind.
        mask_name: how the mask's kind is named (`sim plan --mask prefix-lm`: `"prefix-lm"`).

    Raises:
        CPInputError: for an unknown mode, layout, profile or dtype, bad lengths, heads or P, an `a2a_size` that does
            not divide P, or a layer kind no candidate can run (all refused: their first reason), naming the value.
    """
    from cpref import MODES

    modes, layouts = list(modes or MODES), list(layouts or LAYOUTS)
    several = bool(lengths) and all(isinstance(b, (list, tuple)) for b in lengths)
    batches = [list(b) for b in lengths] if several else [list(lengths)]
    for batch in batches:
        _check(batch, heads, dtype, P, modes, layouts, a2a_size)
    profile = profile if isinstance(profile, Profile) else load_profile(profile)
    if softcap is not None:
        check_softcap(softcap)
    profile.kernel(dtype, softcap=softcap is not None)
    build = mask if callable(mask) or mask is None else (lambda lengths: mask)
    kinds = {"full": {}} if mask is None else {f"mask {mask_name}": {"mask": None}}  # the mask: per batch, below
    if window is not None:
        kinds[f"window {window}"] = {"window": (int(window), 0)}
    if chunk is not None:
        kinds[f"chunk {chunk}"] = {"chunk": chunk}
    result = Plan(P, profile, tuple(heads), dtype, tuple(tuple(b) for b in batches), softcap=softcap)
    masks = [None if build is None else build(tuple(batch)) for batch in batches]
    for kind, args in kinds.items():
        preds = [_over_batches([predict(c, batch, heads=tuple(heads), dtype=dtype, P=P, profile=profile,
                                        mask={**args, "mask": m} if "mask" in args else args,
                                        dry_run_limit=dry_run_limit, softcap=softcap, balance=m)
                                for batch, m in zip(batches, masks)])
                 for c in candidates(P, modes, layouts, a2a_size)]  # fmt: skip
        ranked = tuple(sorted((p for p in preds if p.ranks), key=_order))
        refused = tuple(p for p in preds if p.refused)
        unpriced = tuple(p for p in preds if p.unpriced)
        if not ranked and unpriced:
            raise CPInputError(f"no candidate is priced for {kind} layers at P = {P} with heads {tuple(heads)} "
                               f"({len(refused)} refused by their modes, {len(unpriced)} not priced): "
                               f"{unpriced[0].name}: {unpriced[0].unpriced}")  # fmt: skip
        if not ranked:
            raise CPInputError(f"no candidate runs {kind} layers at P = {P} with heads {tuple(heads)}: "
                               f"{refused[0].name}: {refused[0].refused}")  # fmt: skip
        result.kinds[kind] = KindPlan(kind, ranked, refused, _decided_by(ranked), unpriced, tuple(args.items()),
                                      balanced_by_mask=mask is not None)  # fmt: skip
    return result
