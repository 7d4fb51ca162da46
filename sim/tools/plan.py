r"""`python -m sim plan`: which CP mode, layout and options, predicted for a batch, a model and a cluster.

Prints, per layer kind (full causal; `--window W`, a causal window of `window=(W, 0)`; `--chunk C`), every
candidate of [`sim.plan`][sim.plan.planner] ranked by its predicted step (the slowest rank's, one layer forward
and backward): its compute, the communication it leaves exposed and all its communication, the bytes the
slowest rank sends inside its node and across nodes, and the bytes a rank saves for the backward; a key under
the tables says what each column is. Then the winner and the term that decided it against the best candidate
of another mode, which always has a row (after the `--top` rows where it ranks lower); the winner as the lines
to paste into a model, a `Sharding` of its layout and the `cpref.attention(...)` call with its mode, options and
the kind's mask ([`sim.plan.report`][sim.plan.report]); and how many candidates the modes refuse
(`--show-refused` lists each with its reason). `--json` prints the same as one JSON object.

    python -m sim plan --lengths 8192x16 --heads 32,8,128,128 --dtype bf16 --cp 8 --profile h100-sxm --window 4096

`--lengths` takes the documents' token counts, comma-separated, `NxM` for `M` documents of `N`;
`--sample lognormal:4096,1.0 --tokens 131072 --batches 4` draws them instead
([`sim.plan.batches`][sim.plan.batches]), and ranks by the mean step over the batches.
`--profile` takes a shipped profile's name (`h100-sxm`, `a100-sxm`, `h200-sxm`, `b200-sxm`, `ascend-910b`,
`this-machine`) or a JSON file written as [`sim.plan.profile`][sim.plan.profile] describes; `--ranks-per-node N`
replaces the profile's node size (which collectives cross nodes). `--calibrate` measures this machine instead
and writes the `this-machine` profile ([`sim.plan.calibrate`][sim.plan.calibrate]; git ignores it, and a
published profile is never written over); `--check-kernel PROFILE --device cuda` times the device's kernel
against a profile's curve.

`--layers full=24,window=24` prices a model: its layers share one layout (the batch is sharded once), each kind
with its own mode there; per layout the model's step, the best layout's calls. `--cp 8,16,32,...` asks for several
P at once: per layer kind, each mode's best step at every P, the winner, and where it changes
([`sim.plan.study.scan`][sim.plan.study.scan], as the page [The modes from 8 to 1024 ranks][sim.plan.study] shows
for one batch); with `--layers`, the best layout for the model at every P. `--figure PATH` draws the answer
([`sim.plan.figures`][sim.plan.figures]): the best candidates' steps split into compute and exposed
communication, or each mode's step against P.

Any P: full causal `p2p`, `all_gather` and `a2a+p2p` in the contiguous and zigzag layouts are built for every
rank at once ([`sim.plan.scale`][sim.plan.scale]; `--cp 1024` takes seconds), `a2a` from one rank; the other
candidates are dry-run rank by rank up to `--dry-run-limit` ranks (32) and listed as not priced above it.

`--mask prefix-lm` (or `spans`, `shared-prompt`, `random`) plans the model's global layers under that mask
instead of full causal, the kind `mask prefix-lm`, built from each batch's documents as
[`sim verify --mask`][sim.tools.verify.masks] builds it: every candidate is dry-run on every rank (the mask's
kernel work and the rows each mode moves are the modes' own), and the `balanced` layout is the one placed by the
mask ([`cpref.batch.balanced_mask`][cpref.batch.balanced_mask]). The winner's lines then say `mask=mask`.

    python -m sim plan --lengths 4096,1024x4,512x8 --heads 32,8,128,128 --cp 4 --mask prefix-lm --window 1024
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Sequence

from sim.plan.profile import profile_names
from sim.tools.cli import DTYPE_ALIASES, Parser, fail, positive
from sim.tools.verify.masks import MASKS, mask_of

SHORT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def lengths_arg(value: str) -> tuple[int, ...]:
    """Document lengths: `4096,2048,...`, with `NxM` for `M` documents of `N` tokens."""
    out: list[int] = []
    try:
        for part in value.split(","):
            n, _, m = part.partition("x")
            out += [positive(n)] * (positive(m) if m else 1)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected document lengths such as 4096,2048 or 8192x16, got {value!r}") from None
    return tuple(out)


def heads_arg(value: str) -> tuple[int, int, int, int]:
    """`Hq,Hkv,D,Dv` (or `Hq,Hkv,D` for Dv = D)."""
    try:
        parts = tuple(positive(x) for x in value.split(","))
    except argparse.ArgumentTypeError:
        parts = ()
    if len(parts) == 3:
        parts = (*parts, parts[2])
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"expected Hq,Hkv,D[,Dv] as whole numbers >= 1, got {value!r}")
    return parts


def cp_arg(value: str) -> tuple[int, ...]:
    """One CP size, or several comma-separated in increasing order."""
    try:
        sizes = tuple(positive(x) for x in value.split(","))
    except argparse.ArgumentTypeError:
        sizes = ()
    if not sizes or list(sizes) != sorted(set(sizes)):
        raise argparse.ArgumentTypeError(f"expected a CP size or increasing sizes such as 8,16,32, got {value!r}")
    return sizes


def layers_arg(value: str) -> dict[str, int]:
    """`full=24,window=24,chunk=8`: how many layers of each kind the model has."""
    out = {}
    for part in value.split(","):
        kind, _, count = part.partition("=")
        if kind.strip() not in ("full", "window", "chunk") or not count:
            raise argparse.ArgumentTypeError(f"expected layer counts such as full=24,window=24 (kinds full, window, "
                                             f"chunk), got {value!r}")  # fmt: skip
        out[kind.strip()] = positive(count)
    return out


def names(value: str) -> tuple[str, ...]:
    """Comma-separated names."""
    return tuple(x.strip() for x in value.split(",") if x.strip())


def parser(prog: str) -> Parser:
    """The command's options."""
    p = Parser(prog=prog, description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--lengths", type=lengths_arg, default=None, help="documents' tokens: 4096,2048 or 8192x16 (required)")
    p.add_argument("--sample", default=None, help="instead of --lengths: documents drawn from a distribution, "
                   "lognormal:MEDIAN,SPREAD, uniform:LO,HI or fixed:N, packed into --batches batches of --tokens tokens")
    p.add_argument("--tokens", type=positive, default=131072, help="tokens per sampled batch")
    p.add_argument("--batches", type=positive, default=4, help="sampled batches (candidates ranked by their mean step)")
    p.add_argument("--seed", type=positive, default=1, help="the sampling's seed")
    p.add_argument("--heads", type=heads_arg, default=None, help="Hq,Hkv,D[,Dv] (required)")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32")
    p.add_argument("--cp", type=cp_arg, default=None, help="the CP size P (required); several, 8,16,32: each mode's "
                   "best step at every P and where the winner changes")
    p.add_argument("--profile", default="h100-sxm", help=f"a shipped profile's name ({', '.join(profile_names())}) or a "
                   "JSON file written as sim.plan.profile describes")
    p.add_argument("--window", type=positive, default=None, metavar="W", help="also plan layers with a causal sliding "
                   "window, window=(W, 0): each query sees the W keys before it and itself")
    p.add_argument("--chunk", type=positive, default=None, help="also plan chunked layers of C positions")
    p.add_argument("--mask", choices=MASKS, default=None, help="the model's global layers under this mask instead of "
                   "full causal, built from each batch's documents as `sim verify --mask` builds it (every rank "
                   "dry-run; the balanced layout placed by the mask; --layers full=N counts those layers)")
    p.add_argument("--softcap", type=float, default=None, metavar="C", help="every layer's logits soft-capped at C "
                   "(Gemma 2: 50): each kernel call costs the profile's softcap_factor times as much")
    p.add_argument("--modes", type=names, default=None, help="comma-separated modes (default: all)")
    p.add_argument("--layouts", type=names, default=None, help="comma-separated layouts (default: all)")
    p.add_argument("--a2a-size", type=positive, default=None, help="a2a+p2p's group size (default: every divisor of P)")
    p.add_argument("--dry-run-limit", type=positive, default=32, metavar="P",
                   help="above this CP size, candidates only the dry run prices are listed as not priced (default 32)")
    p.add_argument("--layers", type=layers_arg, default=None, help="the model's layers of each kind, e.g. "
                   "full=24,window=24: also the best layout for them all (the batch is sharded once) and each kind's "
                   "mode there")
    p.add_argument("--ranks-per-node", type=positive, default=None, metavar="N", help="ranks (GPUs, NPUs) per node, in "
                   "place of the profile's (8 in every published one): which collectives cross nodes")
    p.add_argument("--top", type=positive, default=12, help="candidates shown per layer kind (and the one the deciding "
                   "term names, wherever it ranks)")
    p.add_argument("--show-refused", action="store_true", help="list every candidate the modes refuse, with the reason "
                   "(default: how many)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--figure", default=None, metavar="PATH", help="also draw the answer to PATH (a .png or .svg): "
                   "the best candidates' steps, or with several --cp each mode's step against P")
    p.add_argument("--calibrate", action="store_true", help="measure this machine instead (about a minute) and write the "
                   "this-machine profile to --out")
    p.add_argument("--out", default=None, help="where --calibrate writes (default: sim/plan/profiles/this-machine.json, "
                   "ignored by git, what --profile this-machine reads; never a published profile)")
    p.add_argument("--check-kernel", metavar="PROFILE", default=None, help="instead: time the default kernel on "
                   "--device against PROFILE's curve in --dtype (the heads of --heads, default 32,32,128)")
    p.add_argument("--device", default="cuda", help="--check-kernel's device (default cuda)")
    return p


def _check_kernel(prog: str, args) -> int:
    """`--check-kernel PROFILE`: each call's measured time beside the profile's prediction, and the fitted curve."""
    import torch

    from cpref.base.errors import CPInputError
    from sim.plan.calibrate import check_kernel

    dtype = SHORT.get(DTYPE_ALIASES.get(args.dtype, args.dtype), args.dtype)
    hq, _, d, _ = args.heads or (32, 32, 128, 128)
    try:
        torch.empty(0, device=args.device)
        result = check_kernel(args.check_kernel, device=args.device, dtype=dtype, heads=hq, dim=d)
    except (CPInputError, RuntimeError) as exc:
        return fail(prog, f"--check-kernel {args.check_kernel} on --device {args.device} in {dtype}: {exc}")
    lines = [f"{args.check_kernel}'s {dtype} curve against the default kernel on {args.device} ({hq} heads of {d}, one "
             "causal document a call)", "", "| tokens | pass | GFLOP | measured ms | predicted ms | measured / predicted |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in result["rows"]:
        lines.append(f"| {r['tokens']} | {r['direction']} | {r['gflop']:.2f} | {r['measured_s'] * 1e3:.3f} | "
                     f"{r['predicted_s'] * 1e3:.3f} | {r['ratio']:.2f} |")  # fmt: skip
    fit, prof = result["fit"], result["profile"]
    lines += ["", f"fitted: peak {fit['peak_tflops']:.3g} TFLOP/s, half size {fit['half_size_gflop']:.3g} GFLOP a call; "
                  f"the profile: {prof['peak_tflops']:.3g} TFLOP/s, {prof['half_size_gflop']:.3g} GFLOP"]  # fmt: skip
    print("\n".join(lines))
    return 0


def _calibrate(prog: str, args) -> int:
    """`--calibrate`: measure this machine into `--out` (default: `this-machine`, git-ignored), never over a published
    profile, refused before measuring where the folder cannot take the file."""
    from sim.plan.calibrate import calibrate
    from sim.plan.profile import PROFILES, profile_names

    out = Path(args.out) if args.out else PROFILES / "this-machine.json"
    published = [n for n in profile_names() if n != "this-machine"]
    if out.resolve().parent == PROFILES.resolve() and out.stem in published:
        return fail(prog, f"--out {out} is the published profile {out.stem!r}, which --calibrate must not overwrite; "
                          "leave --out out (this-machine) or give another file")  # fmt: skip
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):  # before 15 s of measuring, not after
        return fail(prog, f"cannot write the profile to {out}: {out.parent} is not a writable folder; give --out a "
                          "file in one")  # fmt: skip
    try:
        profile = calibrate(out)
    except OSError as exc:  # the folder is missing or not writable
        return fail(prog, f"cannot write the profile to {out}: {exc.strerror or exc}; give --out a writable file")
    intra, kernel = profile["links"]["intra"], profile["compute"]["float32"]
    print(f"wrote {out}: link {intra['bandwidth_GBps']} GB/s (a ring shift {intra['send_recv_bandwidth_GBps']} GB/s), "
          f"latency {intra['latency_us']} us; TorchKernel float32 up to {kernel['peak_tflops'] * 1e3:.1f} GFLOP/s")
    return 0


KINDS = {"full": "full", "window": "window {}", "chunk": "chunk {}"}  # a --layers kind -> the plan's kind name


def _plans(args, dtype: str) -> list:
    """The plan at every `--cp` (1. the batch, sampled or given; 2. the profile, with `--ranks-per-node`; 3. the
    `--layers` kinds checked against `--window` and `--chunk`; 4. each P planned), refused by `CPInputError`."""
    import dataclasses

    from cpref.base.errors import CPInputError
    from sim.plan import load_profile, plan

    batch = args.lengths
    if args.sample is not None:
        from sim.plan.batches import sample

        batch = sample(args.sample, tokens=args.tokens, batches=args.batches, seed=args.seed)
    profile = load_profile(args.profile)
    if args.ranks_per_node is not None:
        profile = dataclasses.replace(profile, ranks_per_node=args.ranks_per_node)
    for kind in ("window", "chunk"):
        if args.layers and kind in args.layers and getattr(args, kind) is None:
            raise CPInputError(f"--layers {kind}={args.layers[kind]} needs --{kind}: the {kind} of those layers")
    options = dict(profile=profile, window=args.window, chunk=args.chunk, modes=args.modes, layouts=args.layouts,
                   a2a_size=args.a2a_size, dry_run_limit=args.dry_run_limit, softcap=args.softcap)  # fmt: skip
    if args.mask is not None:  # one mask per batch, from its documents
        options.update(mask=lambda lengths: mask_of(args.mask, lengths, seed=args.seed), mask_name=args.mask)
    return [plan(batch, heads=args.heads, dtype=dtype, P=P, **options) for P in args.cp]


def main(argv: Sequence[str] | None = None, prog: str = "python -m sim plan") -> int:
    """Plan, print the tables (or JSON); 2 with a one-line error for bad input."""
    from cpref.base.errors import CPInputError
    from sim.plan import report
    from sim.plan.study import curves_of

    args = parser(prog).parse_args(argv)
    if args.calibrate:
        return _calibrate(prog, args)
    if args.check_kernel:
        return _check_kernel(prog, args)
    missing = [f"--{name}" for name in ("heads", "cp") if getattr(args, name) is None]
    if (args.lengths is None) == (args.sample is None):
        missing.insert(0, "one of --lengths and --sample")
    if missing:
        return fail(prog, f"{', '.join(missing)} required (or --calibrate)")
    dtype = SHORT.get(DTYPE_ALIASES.get(args.dtype, args.dtype), args.dtype)
    try:
        plans = _plans(args, dtype)
    except CPInputError as exc:
        return fail(prog, str(exc))
    named = {k: f"mask {args.mask}" if k == "full" and args.mask else KINDS[k].format(getattr(args, k, None))
             for k in args.layers or {}}  # fmt: skip
    if len(plans) > 1:
        curves = curves_of(plans)
        if args.json:
            data = report.scan_json(curves)
            if args.layers:
                data["model"] = {str(r.P): _model_json(r, args.layers, named) for r in plans}
            print(json.dumps(data, indent=1))
        else:
            models = report.models_table(plans, args.layers, named) if args.layers else ""
            print(report.scan_table(curves, args.cp, args.heads) + ("\n" + models if models else ""))
        return _figure(prog, args, curves) if args.figure else 0
    result = plans[0]
    if args.json:
        data = report.as_json(result)
        if args.layers:
            data["model"] = _model_json(result, args.layers, named)
        print(json.dumps(data, indent=1))
    else:
        model = result.by_layout({named[k]: n for k, n in args.layers.items()}) if args.layers else None
        print(report.plan_table(result, args.top, args.show_refused)
              + ("" if model is None else "\n\n" + report.model_table(result, model, args.layers)))  # fmt: skip
    return _figure(prog, args, result) if args.figure else 0


def _model_json(result, layers: dict[str, int], named: dict[str, str]) -> list[dict]:
    """`Plan.by_layout` of the `--layers` as plain data: per layout, its step and each kind's pick."""
    return [{"layout": c.layout, "step_s": c.step, "picks": {k: p.name for k, p in c.picks.items()}}
            for c in result.by_layout({named[k]: n for k, n in layers.items()})]  # fmt: skip


def _figure(prog: str, args, result) -> int:
    """`--figure PATH`: the answer drawn (sim.plan.figures), or one line saying why it cannot be."""
    try:
        from sim.plan.figures import figure
    except ImportError:  # pragma: no cover - matplotlib is in the dev and docs extras
        return fail(prog, "--figure needs matplotlib: pip install matplotlib")
    panels = result if len(args.cp) > 1 else result.kinds
    title = f"P = {', '.join(map(str, args.cp))}, heads {tuple(args.heads)}, {args.profile}"
    try:
        figure(panels, title, args.top).savefig(args.figure, dpi=120)
    except (OSError, ValueError) as exc:
        return fail(prog, f"cannot write the figure to {args.figure}: {exc}; give --figure a writable .png or .svg path")
    print(f"figure: {args.figure}")
    return 0
