r"""`python -m sim plan`: which CP mode, layout and options, predicted for a batch, a model and a cluster.

Prints, per layer kind (full causal; `--window W`; `--chunk C`), every candidate of
[`sim.plan`][sim.plan.planner] ranked by its predicted step (the slowest rank's): its compute,
the communication it leaves exposed and all its communication, the bytes the slowest rank sends
inside its node and across nodes, and the bytes it saves for the backward; then the winner and the
term that decided it, and the candidates the modes refuse with the reason. `--json` prints the same
as one JSON object.

    python -m sim plan --lengths 8192x16 --heads 32,8,128,128 --dtype bf16 --cp 8 --profile h100-sxm --window 4096

`--lengths` takes the documents' token counts, comma-separated, `NxM` for `M` documents of `N`;
`--sample lognormal:4096,1.0 --tokens 131072 --batches 4` draws them instead
([`sim.plan.batches`][sim.plan.batches]), and ranks by the mean step over the batches.
`--calibrate` measures this machine instead and writes the `this-machine` profile
([`sim.plan.calibrate`][sim.plan.calibrate]); `--check-kernel PROFILE --device cuda` times the device's kernel against
a profile's curve. `--profile` takes a shipped profile's name (`h100-sxm`, `ascend-910b`, `this-machine`) or a JSON
file written as [`sim.plan.profile`][sim.plan.profile] describes.

`--cp 8,16,32,...` asks for several P at once: per layer kind, each mode's best step at every P, the winner, and
where it changes ([`sim.plan.study.scan`][sim.plan.study.scan], as the page [Which mode, from 8 to 1024
ranks][sim.plan.study] shows for one batch). `--figure PATH` draws the answer ([`sim.plan.figures`][sim.plan.figures]):
the best candidates' steps split into compute and exposed communication, or each mode's step against P.

Any P: full causal `p2p`, `all_gather` and `a2a+p2p` in the contiguous and zigzag layouts are built for every
rank at once ([`sim.plan.scale`][sim.plan.scale]; `--cp 1024` takes seconds), `a2a` from one rank; the other
candidates are dry-run rank by rank up to `--dry-run-limit` ranks (32) and listed as not priced above it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Sequence

from sim.tools.cli import DTYPE_ALIASES, Parser, fail, positive

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
    p.add_argument("--profile", default="h100-sxm", help="a shipped profile's name or a JSON file")
    p.add_argument("--window", type=positive, default=None, help="also plan layers with a causal window of W keys")
    p.add_argument("--chunk", type=positive, default=None, help="also plan chunked layers of C positions")
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
    p.add_argument("--top", type=positive, default=12, help="candidates shown per layer kind")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--figure", default=None, metavar="PATH", help="also draw the answer to PATH (a .png or .svg): "
                   "the best candidates' steps, or with several --cp each mode's step against P")
    p.add_argument("--calibrate", action="store_true", help="measure this machine instead (about a minute) and write the "
                   "this-machine profile to --out")
    p.add_argument("--out", default=None, help="where --calibrate writes (default: the shipped profiles' folder)")
    p.add_argument("--check-kernel", metavar="PROFILE", default=None, help="instead: time the default kernel on "
                   "--device against PROFILE's curve in --dtype (the heads of --heads, default 32,32,128)")
    p.add_argument("--device", default="cuda", help="--check-kernel's device (default cuda)")
    return p


def as_json(result) -> dict:
    """The plan as plain data."""

    def rank(r):
        return {"rank": r.rank, "compute_s": r.compute, "comm_s": r.comm, "exposed_s": r.exposed, "step_s": r.step,
                "bytes": r.bytes, "saved_bytes": r.saved_bytes, "kernel_calls": r.calls, "flops": r.flops}  # fmt: skip

    return {"P": result.P, "profile": result.profile.name, "heads": list(result.heads), "dtype": result.dtype,
            "softcap": result.softcap,
            "lengths": list(result.lengths), "batches": [list(b) for b in result.batches],
            "kinds": {kind: {"decided_by": kp.decided_by,
                             "ranked": [{"candidate": p.name, "step_s": p.step, "batch_steps_s": list(p.batch_steps),
                                         "ranks": [rank(r) for r in p.ranks]}
                                        for p in kp.ranked],
                             "refused": [{"candidate": p.name, "reason": p.refused} for p in kp.refused],
                             "not_priced": [{"candidate": p.name, "reason": p.unpriced} for p in kp.unpriced]}
                      for kind, kp in result.kinds.items()}}  # fmt: skip


def table(result, top: int) -> str:
    """The plan as Markdown tables, one per layer kind."""
    mib = 2**20
    batches = result.batches
    what = (f"{len(batches[0])} documents, {sum(batches[0])} tokens" if len(batches) == 1 else
            f"{len(batches)} sampled batches of {sum(batches[0])} tokens ({', '.join(str(len(b)) for b in batches)} "
            "documents; step: the mean over them, the other columns the slowest batch's)")  # fmt: skip
    capped = ("" if result.softcap is None else f", soft-capped at {result.softcap:g} (every call "
              f"{result.profile.kernel(result.dtype, softcap=True).factor:g}x)")  # fmt: skip
    lines = [f"P = {result.P} on {result.profile.name} ({result.profile.ranks_per_node} ranks per node), heads "
             f"{result.heads}, {result.dtype}, {what}{capped}"]  # fmt: skip
    for kind, kp in result.kinds.items():
        lines += ["", f"## {kind}", "",
                  "| # | candidate | step ms | compute ms | exposed comm ms | comm ms | sent intra MiB | sent inter MiB | saved MiB |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for i, p in enumerate(kp.ranked[:top], 1):
            s = p.slowest
            lines.append(f"| {i} | {p.name} | {p.step * 1e3:.3f} | {s.compute * 1e3:.3f} | {s.exposed * 1e3:.3f} | "
                         f"{s.comm * 1e3:.3f} | {s.bytes['intra'] / mib:.1f} | {s.bytes['inter'] / mib:.1f} | "
                         f"{p.peak_saved_bytes / mib:.1f} |")  # fmt: skip
        if kp.ranked:
            lines += ["", f"best: **{kp.ranked[0].name}**; decided by {kp.decided_by}"]
        if kp.refused:
            lines += ["", f"refused ({len(kp.refused)}): " + "; ".join(
                f"{p.name} ({p.refused.split(';')[0]})" for p in kp.refused[:4]) + (" ..." if len(kp.refused) > 4 else "")]
        if kp.unpriced:
            lines += ["", f"not priced ({len(kp.unpriced)}: {', '.join(p.name for p in kp.unpriced[:4])}"
                          f"{' ...' if len(kp.unpriced) > 4 else ''}): {kp.unpriced[0].unpriced}"]  # fmt: skip
    return "\n".join(lines)


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


def main(argv: Sequence[str] | None = None, prog: str = "python -m sim plan") -> int:
    """Plan, print the tables (or JSON); 2 with a one-line error for bad input."""
    from cpref.base.errors import CPInputError
    from sim.plan import plan

    args = parser(prog).parse_args(argv)
    if args.calibrate:
        from sim.plan.calibrate import calibrate
        from sim.plan.profile import PROFILES

        out = Path(args.out) if args.out else PROFILES / "this-machine.json"
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
    if args.check_kernel:
        return _check_kernel(prog, args)
    missing = [f"--{name}" for name in ("heads", "cp") if getattr(args, name) is None]
    if (args.lengths is None) == (args.sample is None):
        missing.insert(0, "one of --lengths and --sample")
    if missing:
        return fail(prog, f"{', '.join(missing)} required (or --calibrate)")
    dtype = SHORT.get(DTYPE_ALIASES.get(args.dtype, args.dtype), args.dtype)
    try:
        batch = args.lengths
        if args.sample is not None:
            from sim.plan.batches import sample

            batch = sample(args.sample, tokens=args.tokens, batches=args.batches, seed=args.seed)
        options = dict(profile=args.profile, window=args.window, chunk=args.chunk, modes=args.modes, layouts=args.layouts,
                       a2a_size=args.a2a_size, dry_run_limit=args.dry_run_limit, softcap=args.softcap)  # fmt: skip
        if len(args.cp) > 1:
            if args.layers:
                raise CPInputError(f"--layers with --cp {','.join(map(str, args.cp))}: give one CP size for a model's plan")
            from sim.plan.study import scan

            result = scan(batch, heads=args.heads, dtype=dtype, Ps=args.cp, **options)
        else:
            result = plan(batch, heads=args.heads, dtype=dtype, P=args.cp[0], **options)
            for kind in ("window", "chunk"):
                if args.layers and kind in args.layers and getattr(args, kind) is None:
                    raise CPInputError(f"--layers {kind}={args.layers[kind]} needs --{kind}: the {kind} of those layers")
            names = {"full": "full", "window": f"window {args.window}", "chunk": f"chunk {args.chunk}"}
            model = result.by_layout({names[k]: n for k, n in args.layers.items()}) if args.layers else None
    except CPInputError as exc:
        return fail(prog, str(exc))
    if len(args.cp) > 1:
        print(json.dumps(scan_json(result), indent=1) if args.json else scan_table(result, args))
    elif args.json:
        data = as_json(result)
        if model is not None:
            data["model"] = [{"layout": c.layout, "step_s": c.step, "picks": {k: p.name for k, p in c.picks.items()}}
                             for c in model]  # fmt: skip
        print(json.dumps(data, indent=1))
    else:
        print(table(result, args.top) + ("" if model is None else "\n\n" + model_table(model, args.layers)))
    return _figure(prog, args, result) if args.figure else 0


def model_table(choices: list, layers: dict[str, int]) -> str:
    """A model's layers over one layout (`Plan.by_layout`) as Markdown: per layout, each kind's pick and the step."""
    kinds = list(choices[0].picks) if choices else []
    what = " + ".join(f"{n} {k}" for k, n in layers.items())
    lines = [f"## the model: {what} layers, one layout for all (the batch is sharded once)", "",
             "| layout | model step ms | " + " | ".join(kinds) + " |", "| --- | ---: |" + " --- |" * len(kinds)]  # fmt: skip
    for c in choices:
        lines.append(f"| {c.layout} | {c.step * 1e3:.3f} | " + " | ".join(
            f"{p.name} ({p.step * 1e3:.3f} ms)" for p in c.picks.values()) + " |")  # fmt: skip
    best = choices[0] if choices else None
    lines += ["", f"best for the model: **{best.layout}**, " + "; ".join(f"{k}: {p.name}" for k, p in best.picks.items())
              if best else "no layout runs every kind"]  # fmt: skip
    return "\n".join(lines)


def scan_table(curves: dict, args) -> str:
    """Several P as Markdown: per layer kind, each mode's best step at every P, the winner, and the crossovers."""
    from sim.plan.study import MODES_SHOWN

    lines = [f"P = {', '.join(map(str, args.cp))} on {next(iter(curves.values())).profile}, heads {tuple(args.heads)}"]
    for kind, c in curves.items():
        lines += ["", f"## {kind}", "", "| P | " + " | ".join(f"{m} ms" for m in MODES_SHOWN) + " | winner |",
                  "| ---: |" + " ---: |" * len(MODES_SHOWN) + " --- |"]  # fmt: skip
        for i, P in enumerate(c.Ps):
            cells = [f"{c.points[m][i].step * 1e3:.3f}" if c.points[m][i] else "-" for m in MODES_SHOWN]
            lines.append(f"| {P} | " + " | ".join(cells) + f" | {c.points[c.winners[i]][i].name} |")
        lines += [""] + [f"crossover: {w0} at P = {p0}, {w1} at P = {p1}: {c.decided_by[c.Ps.index(p1)]}"
                         for p0, p1, w0, w1 in c.crossovers] or ["no crossover: one mode wins at every P"]  # fmt: skip
    return "\n".join(lines)


def scan_json(curves: dict) -> dict:
    """Several P as plain data: per kind, per mode, its best candidate and step at every P (None where none runs)."""
    return {kind: {"P": list(c.Ps), "winners": list(c.winners), "decided_by": list(c.decided_by),
                   "modes": {m: [p and {"candidate": p.name, "step_s": p.step, "compute_s": p.compute,
                                        "exposed_s": p.exposed} for p in pts] for m, pts in c.points.items()}}
            for kind, c in curves.items()}  # fmt: skip


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
