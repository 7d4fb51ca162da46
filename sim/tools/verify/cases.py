"""The cases of `python -m sim verify`, and the inputs every rank and the ground truth build.

A [`Case`][sim.tools.verify.cases.Case] is one CP attention call, forward and backward: the mode,
layout, dtype, padding, CP size and rank placement, mask, sliding window and implementation. A
[`Setup`][sim.tools.verify.cases.Setup] holds what every case of a run shares: the documents, the
heads and the seed. Inputs never travel: every rank, and the ground truth, build the same
global tensors from the seed with [`make_batch`][sim.tools.verify.cases.make_batch].

**Document lengths.** A layout needs every document to be a multiple of its granularity
`g` (`P` contiguous, `2P` zigzag). Without padding each `--docs` length is rounded up to a
multiple of `g`. With padding every document must end in padding: a length that is already
a multiple of `g` loses one token, and the padded boundaries round each real length up to `g`
(the batch's [`cpref.Sharding`][cpref.batch.sharding.Sharding] is then `Sharding.eod_padded`).
The stream layout needs only the batch to be a multiple of `P`: the last document is rounded
up (without padding) or padded up to it (with padding, after losing a token if the batch
already is one), the others are used as given.

**Windows.** A case's `window` is validated and kept as cpref's `check_window` makes it
canonical, so the label names the window that runs: under `causal` the right side is 0.

Example:
    >>> case = Case("all_gather", "zigzag", "bf16", cp=4, padded=True)
    >>> lengths(Setup(docs=(1000, 3000, 500)), case)  # g = 8
    ((999, 2999, 500), (1000, 3000, 504))
    >>> case.label, case.tol(Setup())  # GQA in bf16
    ('all_gather/zigzag/bf16/pad/cp4', 0.035)
    >>> Case("a2a", "zigzag", "fp32", cp=2, window=(127, -1)).label  # causal: right = 0
    'a2a/zigzag/fp32/cp2/window=127,0'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from cpref.batch.layout import layout_multiple
from cpref.batch.mask import Mask
from cpref.batch.sharding import Sharding
from cpref.kernels.contract import NO_WINDOW, check_window
from sim import oracle
from sim.tools.verify.masks import MASKS, mask_of

__all__ = ["DTYPES", "TOL", "TOL_BF16_GQA", "Setup", "Case", "Batch", "lengths", "lengths_note", "make_batch", "case_mask", "placement",
           "cp_groups", "build_cases"]  # fmt: skip

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {name: oracle.TOL[dtype] for name, dtype in DTYPES.items()}  # atol = rtol per dtype name (sim.oracle's)
TOL_BF16_GQA = oracle.TOL_BF16_GQA


@dataclass(frozen=True)
class Setup:
    """What every case of a run shares.

    Attributes:
        docs: document lengths, before rounding to the layout (see the module docstring).
        heads: `(Hq, Hkv)`, `Hq % Hkv == 0`; GQA by default.
        head_dim: `D`, also `Dv`.
        seed: CP group `d` (its DP index) draws its batch with seed `seed + 1000 d`.
        kernel: `"torch"` (`TorchKernel`) or `"npu"` (`NpuKernel`), for `cpref` cases.
        baseline: what the `vs P=1` column holds a row to (`sim.tools.verify.baselines`): `"auto"`,
            `"impl"`, `"sdpa"`, `"eager"`, `"kernel"` or `"package.module:function"`.
        forward_only: run and compare the forward only (`--forward-only`: an implementation without a backward);
            the inputs do not require grad.
    """

    docs: tuple[int, ...] = (1000, 3000, 500)
    heads: tuple[int, int] = (8, 4)
    head_dim: int = 32
    seed: int = 0
    kernel: str = "torch"
    baseline: str = "auto"
    forward_only: bool = False

    def __post_init__(self) -> None:
        if not self.docs or any(not isinstance(n, int) or n < 2 for n in self.docs):
            raise ValueError(f"docs must be document lengths >= 2, got {self.docs!r}; e.g. --docs 1000,3000,500")
        if len(self.heads) != 2 or self.heads[1] < 1 or self.heads[0] % self.heads[1]:
            raise ValueError(f"heads (Hq, Hkv) = {self.heads} need Hkv >= 1 dividing Hq; e.g. --heads 8,4")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be a whole number in [0, 2**62], got {self.seed!r} (CP group d draws seed + "
                             "1000 d, which torch's generators take up to 2**63 - 1)")  # fmt: skip
        if self.head_dim < 1 or self.kernel not in ("torch", "npu"):
            raise ValueError(f"head_dim must be >= 1 and kernel 'torch' or 'npu', got {self.head_dim}, {self.kernel!r}")
        if self.baseline not in ("auto", "impl", "sdpa", "eager", "kernel") and ":" not in self.baseline:
            raise ValueError(f"baseline must be auto, impl, sdpa, eager, kernel or package.module:function, got {self.baseline!r}")


MAX_SEED = 2**62  # seed + 1000 d stays within torch's generators for any number of CP groups a machine holds


@dataclass(frozen=True)
class Case:
    """One CP attention call, forward and backward: one row per rank in the table.

    Attributes:
        mode: a key of `cpref.MODES`.
        layout: `"zigzag"`, `"contiguous"`, `"stream"` or `"balanced"`.
        dtype: `"fp64"`, `"fp32"`, `"fp16"` or `"bf16"`.
        cp: the CP size `P`; the world of `W` ranks holds `W / P` CP groups (DP).
        padded: real lengths that are not multiples of the granularity, with `cu_seqlens_padded`.
        strided: CP groups of non-consecutive ranks `{d, d + W/P, ...}` instead of
            `{d P, ..., d P + P - 1}`.
        causal: causal or full attention inside each document.
        window: `(left, right)`, the sliding window of `cpref.attention` (-1: unbounded), kept in
            cpref's canonical form (`check_window`: `(w, 0)` under `causal`; `(-1, -1)`, the
            default, for none); only the modes with `cpref.MODES[mode].windows` take one.
        impl: `"cpref"` (`cpref.attention` over `TorchComm`) or `"package.module:function"`.
        options: mode options, e.g. `(("a2a_size", 2),)`.
        variants: the attention variants of `cpref.attention` every call of the case takes, e.g.
            `(("softcap", 30.0), ("chunk", 512))` (`--softcap`, `--chunk`).
        mask: a name of `sim.tools.verify.masks.MASKS` (`--mask`): every call takes that mask of the case's
            documents as `mask=`, which replaces `causal`, `window` and `chunk` (so those keep their defaults);
            None: the documents' causal (or full) mask.
        impl_options: settings of the implementation (`--impl-option NAME=VALUE`), passed to every call of an
            `--impl` (and of its run without CP) as keywords; none for cpref.
    """

    mode: str
    layout: str
    dtype: str
    cp: int
    padded: bool = False
    strided: bool = False
    causal: bool = True
    impl: str = "cpref"
    options: tuple[tuple[str, Any], ...] = field(default=())
    window: tuple[int, int] = NO_WINDOW
    variants: tuple[tuple[str, Any], ...] = field(default=())
    mask: str | None = None
    impl_options: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", check_window(self.window, self.causal))  # a CPInputError (ValueError) if bad
        if self.impl_options and self.impl == "cpref":
            raise ValueError(f"--impl-option {self.impl_options[0][0]}: cpref takes its options as --option; "
                             "--impl-option passes settings to an --impl")  # fmt: skip
        if self.mask is not None:
            if self.mask not in MASKS:
                raise ValueError(f"mask {self.mask!r} unknown; choose from {', '.join(MASKS)}")
            given = [x for x, on in (("full attention", not self.causal), ("a window", self.windowed),
                                     ("chunk", "chunk" in dict(self.variants))) if on]  # fmt: skip
            if given:  # cpref.attention's rule: mask= replaces causal, window and chunk
                raise ValueError(f"mask {self.mask} with {' and '.join(given)}: a mask replaces causal, window and chunk "
                                 "(cpref.attention's mask=); leave them out, or the mask")  # fmt: skip

    @property
    def windowed(self) -> bool:
        """Whether this case has a sliding window."""
        return self.window != NO_WINDOW

    @property
    def label(self) -> str:
        """`mode/layout/dtype[/pad]/cpP[/strided][/full][/mask=M][/window=L,R][/variants][/options][/impl]`."""
        parts = [self.mode, self.layout, self.dtype] + (["pad"] if self.padded else []) + [f"cp{self.cp}"]
        parts += (["strided"] if self.strided else []) + ([] if self.causal else ["full"])
        parts += [f"mask={self.mask}"] if self.mask else []
        parts += ["window={},{}".format(*self.window)] if self.windowed else []
        parts += [f"{k}={v:g}" for k, v in self.variants]
        parts += [f"{k}={v}" for k, v in self.options] + ([] if self.impl == "cpref" else [self.impl])
        parts += [f"{k}={v}" for k, v in self.impl_options]
        return "/".join(parts)

    def tol(self, setup: Setup) -> float:
        """atol = rtol of this case's dtype (bf16 with GQA gets `TOL_BF16_GQA`)."""
        hq, hkv = setup.heads
        return TOL_BF16_GQA if self.dtype == "bf16" and hkv < hq else TOL[self.dtype]


@dataclass(frozen=True)
class Batch:
    """The global inputs of one CP group: `(T, ...)` tensors over the padded stream, in the case's dtype."""

    q: torch.Tensor  # (T, Hq, D)
    k: torch.Tensor  # (T, Hkv, D)
    v: torch.Tensor  # (T, Hkv, D)
    dout: torch.Tensor  # (T, Hq, D): the upstream gradient
    cu: torch.Tensor  # (N + 1,) real boundaries
    cu_padded: torch.Tensor | None  # (N + 1,) padded boundaries, or None without padding
    real: tuple[int, ...]
    padded: tuple[int, ...]
    sharding: Sharding  # how the CP group shards it: these boundaries, P = case.cp, the case's layout


def lengths(setup: Setup, case: Case) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(real, padded)` document lengths of `case` (see the module docstring)."""
    g = layout_multiple(case.layout, case.cp)
    up = lambda n: -(-n // g) * g  # noqa: E731  ceil to a multiple of g
    if case.layout in ("stream", "balanced"):  # only the batch's length matters: its last document rounds it to P
        docs = list(setup.docs)
        if case.padded and sum(docs) % case.cp == 0:
            docs[-1] -= 1  # so that the batch ends in padding
        last = docs[-1] + -sum(docs) % case.cp  # the last document, up to a batch that P divides
        real = tuple(docs if case.padded else [*docs[:-1], last])
        return real, (*docs[:-1], last)
    if not case.padded:
        real = tuple(up(n) for n in setup.docs)
        return real, real
    real = tuple(n - 1 if n % g == 0 else n for n in setup.docs)
    return real, tuple(up(n) for n in real)


def lengths_note(setup: Setup, cases: Sequence[Case]) -> str:
    """The `note:` line that says what `lengths` made of `--docs` for `cases` (`""` where each ran as given).

    Without padding it names the lengths rounded up; with padding (`--padded`) the real lengths and the padded
    boundaries they end in, per layout and CP size, and why a length lost a token.

    Example:
        >>> note = lengths_note(Setup(docs=(100, 250, 38)), [Case("p2p", "zigzag", "fp32", cp=2, padded=True)])
        >>> note.split("as run: ")[1].split(" (")[0]  # 100 is a multiple of 2P = 4: it loses a token
        'zigzag cp2 99,250,38 in 100,252,40'
    """
    join = lambda ns: ",".join(map(str, ns))  # noqa: E731
    padded = {f"{c.layout} cp{c.cp}": lengths(setup, c) for c in cases if c.padded}
    plain = {f"{c.layout} cp{c.cp}": lengths(setup, c)[0] for c in cases if not c.padded}
    notes = []
    if any(tuple(u) != tuple(setup.docs) for u in plain.values()):
        notes.append(f"note: documents {join(setup.docs)} as run (each rounded up to its layout's granularity: P tokens "
                     "for contiguous, 2P for zigzag, the batch to P for stream and balanced): "
                     + "; ".join(f"{k} {join(u)}" for k, u in plain.items()))  # fmt: skip
    if padded:
        notes.append("note: --padded: each document's real tokens, then the padded boundaries it ends in "
                     "(cu_seqlens_padded), as run: " + "; ".join(f"{k} {join(r)} in {join(p)}" for k, (r, p) in padded.items())
                     + " (contiguous and zigzag: every document ends in padding, up to a multiple of P or 2P tokens, "
                     "a length that already was one losing its last token; stream and balanced: only the last document "
                     "does, up to a batch that P divides, losing a token where P already divided it)")  # fmt: skip
    return "\n".join(notes)


def _cu(ns: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int64)  # (N + 1,)


def make_batch(setup: Setup, case: Case, dp: int) -> Batch:
    """The global batch of CP group `dp` for `case`: N(0, 1) entries rounded to the case's dtype."""
    real, padded = lengths(setup, case)
    T, (hq, hkv), d = sum(padded), setup.heads, setup.head_dim
    gen = torch.Generator().manual_seed(setup.seed + 1000 * dp)
    q, k, v, dout = (torch.randn(T, h, d, generator=gen, dtype=torch.float64).to(DTYPES[case.dtype])
                     for h in (hq, hkv, hkv, hq))  # fmt: skip
    cu, cu_padded = _cu(real), _cu(padded) if case.padded else None
    sharding = Sharding(cu, cp_size=case.cp, layout=case.layout, cu_seqlens_padded=cu_padded)
    return Batch(q, k, v, dout, cu, cu_padded, real, padded, sharding)


def case_mask(setup: Setup, case: Case) -> Mask | None:
    """The case's `cpref.Mask` (`--mask`) over its real documents (`sim.tools.verify.masks`), or None without one."""
    return None if case.mask is None else mask_of(case.mask, lengths(setup, case)[0], setup.seed)


def sinks_of(scale: float, hq: int, dtype: str) -> torch.Tensor:
    """`--sinks S`: the sink logits `S linspace(-1, 1, Hq)` (large and small, positive and negative: a sink of 0
    changes little), a float32 parameter (float64 in fp64 cases), as mixed precision keeps a model's weights.

    Example:
        >>> sinks_of(20.0, 5, "bf16").tolist()
        [-20.0, -10.0, 0.0, 10.0, 20.0]
    """
    return scale * torch.linspace(-1.0, 1.0, hq, dtype=torch.float64 if dtype == "fp64" else torch.float32)


def call_variants(case: Case, hq: int, dtype: str | None = None, device: Any = None, grad: bool = False) -> dict:
    """The case's variants as `cpref.attention` takes them: `sinks` made the tensor of `sinks_of` (in `dtype`'s,
    default the case's; a leaf requiring grad with `grad`), the others as they are."""
    given = dict(case.variants)
    if "sinks" in given:
        given["sinks"] = sinks_of(given["sinks"], hq, dtype or case.dtype).to(device).requires_grad_(grad)
    return given


def placement(world_rank: int, world_size: int, cp: int, strided: bool) -> tuple[int, int]:
    """`(dp, r)`: the CP group (DP index) of a world rank and its rank in that group.

    Example:
        >>> [placement(g, 4, 2, strided=True) for g in range(4)]  # CP groups {0, 2}, {1, 3}
        [(0, 0), (1, 0), (0, 1), (1, 1)]
    """
    dp_size = world_size // cp
    return (world_rank % dp_size, world_rank // dp_size) if strided else (world_rank // cp, world_rank % cp)


def cp_groups(world_size: int, cp: int, strided: bool) -> list[list[int]]:
    """Every CP group's world ranks, in CP rank order, indexed by DP index.

    Example:
        >>> cp_groups(4, 2, strided=False), cp_groups(4, 2, strided=True)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    groups: list[list[int]] = [[] for _ in range(world_size // cp)]
    for g in range(world_size):
        groups[placement(g, world_size, cp, strided)[0]].append(g)
    return groups


def build_cases(modes: Sequence[str], layouts: Sequence[str], dtypes: Sequence[str], *, cp: int, strided: bool = False,
                padded: Sequence[bool] = (False,), causal: bool = True, impls: Sequence[str] = ("cpref",),
                a2a_size: int | None = None, window: tuple[int, int] = NO_WINDOW,
                options: Mapping[str, Any] | None = None, variants: Mapping[str, Any] | None = None,
                masks: Sequence[str | None] = (None,),
                impl_options: Mapping[str, Any] | None = None) -> list[Case]:  # fmt: skip
    """The product of the choices, as cases.

    `a2a_size` goes only to the modes whose options take it (the hierarchical mode); left
    None, they get 2 for an even `cp` (2 x 2 at `cp = 4`) and 1 (the ring) for an odd one.
    Each of `options` (e.g. `{"overlap": True}`) likewise goes only to the modes that declare it.
    `window` goes to every case: a mode without `cpref.MODES[mode].windows` is refused by
    `sim.tools.verify.run` (the command line skips or refuses it first); so do `variants`. Each of `masks`
    (None: no mask) makes a case of its own, after the padding. `impl_options` go to every `--impl` case.
    """
    import cpref  # here: `MODES` is read when the cases are built, so new modes join by themselves

    cases, given = [], dict(options or {})
    for impl in impls:
        for mode in modes:
            chosen = cpref.MODES[mode].example_options(cp)  # what the mode declares for this CP size
            if a2a_size is not None and "a2a_size" in chosen:
                chosen["a2a_size"] = a2a_size
            chosen.update({name: value for name, value in given.items() if name in cpref.MODES[mode].defaults()})
            options = tuple(chosen.items())
            for layout in layouts:
                for dtype in dtypes:
                    for pad in padded:
                        own = () if impl == "cpref" else tuple((impl_options or {}).items())
                        cases += [Case(mode, layout, dtype, cp, pad, strided, causal, impl, options, window,
                                       tuple((variants or {}).items()), mask, own) for mask in masks]  # fmt: skip
    return cases
