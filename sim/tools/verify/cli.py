"""The command line of `python -m sim verify`: its options, the cases they make, the notes and table it prints."""

from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Any, Sequence

import cpref
from cpref.kernels.contract import NO_WINDOW, check_window
from sim.tools.cli import Parser, dtype_name, fail, nonnegative, positive, positive_float, positives, seconds
from sim.tools.launch import LaunchFailure, under_torchrun
from sim.tools.verify.baselines import BASELINES, EAGER, VARIANTS, label
from sim.tools.verify.cases import DTYPES, Case, Setup, build_cases, lengths, lengths_note
from sim.tools.verify.impls import PEERS, load_impl, takes_mask
from sim.tools.verify.masks import MASKS, random_note
from sim.tools.verify.rank import DEVICE_TYPES
from sim.tools.verify.runner import check_cases, run, window_modes
from sim.tools.verify.table import KEY, summary
from sim.tools.verify.wire import BALANCE_LIMIT, traffic_table

__all__ = ["main", "parse_args", "cases_from_args"]


def _names(value: str, allowed: Sequence[str], what: str) -> list[str]:
    """`all` or a comma list of names from `allowed`."""
    names = list(allowed) if value == "all" else [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{what} {bad or value!r} unknown; choose from {', '.join(allowed)} or all")
    return names


def _option(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` as `(name, value)`, the value a Python literal (`True`, `2`, `'x'`)."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. overlap=True")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a Python literal (True, 2, 'x')") from None


def _window(value: str) -> tuple[int, int]:
    """`LEFT,RIGHT`: two ints >= -1, `cpref.attention`'s `window=(left, right)`."""
    try:
        left, right = map(int, value.split(","))
        if min(left, right) >= -1:
            return left, right
    except ValueError:  # not two integers
        pass
    raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT, two integers >= -1 (-1: unbounded), e.g. 127,0; got {value!r}")


def _glued(argv: Sequence[str]) -> list[str]:
    """`--window -1,4` as `--window=-1,4`: argparse would take a value starting with `-` for an option."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--window" and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--window={arg}"
        else:
            out.append(arg)
    return out


def _windowed_modes(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`(modes, skipped)`: under a window, `--mode all` skips the modes that take none; naming one is an error."""
    if args.window == NO_WINDOW:
        return args.modes, []
    skipped = [m for m in args.modes if not cpref.MODES[m].windows]
    if skipped and args.mode != "all":
        raise ValueError(f"--window {_pair(args.window)}: mode {', '.join(skipped)} takes no sliding window; "
                         f"the modes that do: {', '.join(window_modes())} (--mode all runs those only)")  # fmt: skip
    return [m for m in args.modes if m not in skipped], skipped


def _masked(args: argparse.Namespace) -> list[str | None]:
    """`--mask`'s names (`[None]` without it); refused with `--no-causal`, `--window` or `--chunk`, which it replaces."""
    if args.mask is None:
        return [None]
    names = _names(args.mask, MASKS, "mask")
    given = [flag for flag, on in (("--no-causal", not args.causal), (f"--window {_pair(args.window)}", args.window != NO_WINDOW),
                                   (f"--chunk {args.chunk}", args.chunk is not None)) if on]  # fmt: skip
    if given:
        raise ValueError(f"--mask {args.mask} with {' and '.join(given)}: a mask replaces causal, window and chunk "
                         "(cpref.attention's mask=); leave them out, or --mask")  # fmt: skip
    return names


def _mask_takers(cases: Sequence[Case]) -> tuple[list[Case], dict[str, int]]:
    """`(cases to run, {impl: cases skipped})`: under a mask, the cases of an `--impl` that does not take `mask=`."""
    skipped: dict[str, int] = {}
    for case in cases:
        if case.mask is None or case.impl == "cpref":
            continue
        try:
            fn = load_impl(case.impl)
        except ValueError:  # one that does not import: `check_cases` names it
            continue
        if not takes_mask(fn):
            skipped[case.impl] = skipped.get(case.impl, 0) + 1
    return [c for c in cases if c.impl not in skipped or c.mask is None], skipped


def _pair(window: tuple[int, int]) -> str:
    return f"{window[0]},{window[1]}"


def _mask_name(args: argparse.Namespace) -> str:
    """How the run's description names its mask: `mask prefix-lm,spans`, `causal` or `full`."""
    return f"mask {','.join(args.masks)}" if args.mask is not None else "causal" if args.causal else "full"


def _random_totals(setup: Setup, cases: Sequence[Case]) -> dict[str, int]:
    """`{"zigzag cp2": T}`: the real tokens of every batch a `--mask random` case draws its slices over."""
    return {f"{c.layout} cp{c.cp}{' pad' if c.padded else ''}": sum(lengths(setup, c)[0]) for c in cases if c.mask == "random"}


def _peer_defaults(args: argparse.Namespace) -> None:
    """`--peer NAME` is `--impl` of its adapter, with the peer's modes, layouts and documents where the command line
    gives none (several peers: their union); without a peer, every mode and layout over cpref's documents."""
    peers = [PEERS[name] for name in args.peer]
    args.impl = [*(args.impl or []), *(peer.impl for peer in peers)] or None
    union = lambda attr: ",".join(dict.fromkeys(x for peer in peers for x in getattr(peer, attr)))  # noqa: E731
    args.mode = args.mode or (union("modes") if peers else "all")
    args.layout = args.layout or (union("layouts") if peers else "all")
    args.docs = args.docs or (max((peer.docs for peer in peers), key=len) if peers else Setup.docs)


def parse_args(argv: Sequence[str] | None = None, prog: str = "python -m sim verify") -> argparse.Namespace:
    """The command line of `python -m sim verify` (`--help` lists it)."""
    p = Parser(prog=prog, description="Rank-by-rank verification of CP attention against the simulated cluster's "
               "FP64 ground truth (see the sim.tools.verify docs page).")  # fmt: skip
    p.add_argument("--backend", choices=sorted(DEVICE_TYPES), default="gloo")
    p.add_argument("--nproc", type=positive, default=2, help="world size: processes to start (ignored under torchrun)")
    p.add_argument("--cp", type=positive, help="CP size (default: the world size); the world holds nproc / cp CP groups")
    p.add_argument("--cp-ranks", choices=("consecutive", "strided"), default="consecutive",
                   help="CP groups {0..cp-1}, ... or {0, nproc/cp, ...}, ... (non-consecutive ranks)")
    p.add_argument("--mode", default=None, help=f"comma list or all; of {', '.join(sorted(cpref.MODES))} (default: "
                   "all; a --peer's own)")  # fmt: skip
    p.add_argument("--layout", default=None, help=f"comma list or all; of {', '.join(cpref.LAYOUTS)} (default: all; "
                   "a --peer's own)")  # fmt: skip
    p.add_argument("--dtype", default="fp32", help=f"comma list or all; of {', '.join(DTYPES)} (or torch's names: float32, ...)")
    p.add_argument("--option", action="append", type=_option, default=[], metavar="NAME=VALUE",
                   help="a mode option, for the modes that declare it, e.g. overlap=True (repeatable; Python literals)")
    p.add_argument("--a2a-size", type=positive, help="all-to-all group size, for the modes that take a2a_size (default: 2 for an even CP size, else 1)")
    p.add_argument("--docs", type=positives, default=None, help="document lengths (default 1000,3000,500; a --peer's "
                   "own: one document for a peer without boundaries)")  # fmt: skip
    p.add_argument("--heads", type=positives, default=Setup.heads, help="Hq,Hkv (default 8,4)")
    p.add_argument("--head-dim", type=positive, default=Setup.head_dim)
    p.add_argument("--seed", type=nonnegative, default=0)
    p.add_argument("--kernel", choices=("torch", "npu"), default="torch", help="cpref's attention kernel")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--window", type=_window, default=NO_WINDOW, metavar="LEFT,RIGHT",
                   help="sliding window (-1: unbounded; causal: RIGHT 0), for the modes that take one: "
                   f"{', '.join(window_modes())}; --mode all skips the others (default -1,-1: none)")  # fmt: skip
    p.add_argument("--softcap", type=positive_float, metavar="C",
                   help="logit soft-capping: every score C tanh(S / C) (Gemma 2: 50); every mode takes it")
    p.add_argument("--sinks", type=positive_float, metavar="S",
                   help="learnable sinks of S linspace(-1, 1, Hq) (GPT-OSS's are about 20); every mode; the sinks' "
                        "gradient, summed over the CP group, is a fifth column")  # fmt: skip
    p.add_argument("--chunk", type=positive, metavar="C",
                   help="chunked attention: a query sees only its chunk of C positions (Llama 4: 8192); every mode")
    p.add_argument("--mask", metavar="NAMES", help=f"comma list or all; of {', '.join(MASKS)}: every case once under each "
                   "mask, built from its documents and given as cpref.attention's mask= (an --impl gets the cpref.Mask); "
                   "replaces causal, --window and --chunk (default: none, the documents' causal or full mask)")  # fmt: skip
    p.add_argument("--padded", action="store_true", help="real lengths off the granularity, with cu_seqlens_padded")
    p.add_argument("--peer", action="append", default=[], choices=sorted(PEERS), help="verify an adapter cpref ships: "
                   + "; ".join(f"{name}: {peer.about}" for name, peer in PEERS.items()) + " (repeatable)")  # fmt: skip
    p.add_argument("--impl", action="append", metavar="MODULE:FUNCTION", help="verify this function, named by its module "
                   "(package.module:function) or its file (path/to/file.py:function); repeatable")
    p.add_argument("--impl-option", action="append", type=_option, default=[], metavar="NAME=VALUE",
                   help="a setting of every --impl, passed to its calls as a keyword (repeatable; Python literals), "
                   "e.g. convert_to_f32=False")  # fmt: skip
    p.add_argument("--baseline", default="auto", metavar="NAME", help="the run without CP of the vs P=1 column: auto "
                   "(impl for --impl rows, falling back to the looser of sdpa and eager where the implementation "
                   "raises at CP size 1; kernel for cpref), impl (the implementation at CP size 1), sdpa (PyTorch's "
                   "SDPA in the dtype), eager (scores and probabilities in the dtype, softmax in float32), kernel "
                   "(cpref's) or MODULE:FUNCTION (your local attention, named as --impl names one)")  # fmt: skip
    p.add_argument("--forward-only", action="store_true", help="run and compare the forward only (an implementation "
                   "without a backward); dq, dk, dv are not computed")  # fmt: skip
    p.add_argument("--balance", type=positive_float, nargs="?", const=BALANCE_LIMIT, metavar="LIMIT",
                   help="fail the run where a CP group's largest attention work over its mean exceeds LIMIT (default "
                   f"{BALANCE_LIMIT}); without it the report flags such a layout and the verdict ignores it")  # fmt: skip
    p.add_argument("--check-mask", action="store_true", help="instead of the numbers, probe which (query, key) pairs "
                   "each rank attends against the pairs the mask allows, on small documents (sim.tools.verify.probe)")
    p.add_argument("--timeout", type=seconds, default=300.0, help="process-group timeout in seconds")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="a progress bar on stderr "
                   "(default: if stderr is a terminal, else one line per case as it finishes; --no-progress: neither)")
    args = p.parse_args(_glued(sys.argv[1:] if argv is None else argv))
    try:
        args.window = check_window(args.window, args.causal)  # canonical: (w, 0) under causal, (-1, -1) for none
    except ValueError as exc:  # RIGHT > 0 under causal
        p.error(f"--window {_pair(args.window)}: {exc} (--no-causal)")
    try:
        _peer_defaults(args)
        args.masks = _masked(args)
        args.modes = _names(args.mode, sorted(cpref.MODES), "mode")
        args.modes, args.skipped = _windowed_modes(args)
        unknown = [name for name, _ in args.option if all(name not in cpref.MODES[m].defaults() for m in args.modes)]
        if unknown:
            raise ValueError(f"--option {unknown[0]}: no mode of {args.modes} takes it")
        args.layouts = _names(args.layout, list(cpref.LAYOUTS), "layout")
        args.dtypes = _names(",".join(dtype_name(x) for x in args.dtype.split(",")), list(DTYPES), "dtype")
        if args.impl_option and not [i for i in args.impl or () if i != "cpref"]:
            raise ValueError(f"--impl-option {args.impl_option[0][0]}: it passes settings to an --impl, and none is "
                             "given (cpref's mode options are --option)")  # fmt: skip
        if args.baseline not in BASELINES and ":" not in args.baseline:
            raise ValueError(f"--baseline {args.baseline!r}: expected {', '.join(BASELINES)} or package.module:function "
                             "(or path/to/file.py:function)")
        args.variants = {name: getattr(args, name) for name in VARIANTS if getattr(args, name) is not None}
        if args.variants and args.baseline in ("sdpa", "eager"):
            flags = " ".join(f"--{name} {value:g}" for name, value in args.variants.items())
            raise ValueError(f"--baseline {args.baseline} with {flags}: {args.baseline} attends without the variants; "
                             "use --baseline auto (cpref's kernel, or your implementation on one rank) or kernel")  # fmt: skip
        baseline = EAGER if args.baseline == "eager" else args.baseline  # eager is a function, named as yours is
        args.setup = Setup(args.docs, tuple(args.heads), args.head_dim, args.seed, args.kernel, baseline,
                           args.forward_only)  # fmt: skip
        if ":" in baseline and not takes_mask(load_impl(baseline, "--baseline")) and args.mask is not None:
            raise ValueError(f"--baseline {args.baseline} does not take mask= (a keyword, or **options), which every "
                             f"run without CP gets under --mask {args.mask}; give it one, or use --baseline auto")  # fmt: skip
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        p.error(str(exc))
    return args


def cases_from_args(args: argparse.Namespace, world: int, dtypes: Sequence[str] | None = None) -> list[Case]:
    """The product of the command line's choices (`dtypes`: in place of `--dtype`'s)."""
    cp = args.cp or world
    return build_cases(args.modes, args.layouts, dtypes or args.dtypes, cp=cp, strided=args.cp_ranks == "strided",
                       padded=(args.padded,), causal=args.causal, impls=args.impl or ("cpref",),
                       a2a_size=args.a2a_size, window=args.window, options=dict(args.option),
                       variants=args.variants, masks=args.masks, impl_options=dict(args.impl_option))  # fmt: skip


def main(argv: Sequence[str] | None = None, prog: str = "python -m sim verify") -> int:
    """Parse, run, print the table (or, with `--check-mask`, the mask probe's report); return the exit status (0: every
    row passes, 1: a row fails or a rank failed, 2: bad input, refused before any process starts)."""
    args = parse_args(argv, prog)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    probe = args.check_mask  # the probe's values are exact in fp64; another backend's device may have none
    what = "--check-mask" if probe else f"--mask {args.mask}"
    cases = cases_from_args(args, world, ["fp64" if args.backend == "gloo" else args.dtypes[0]] if probe else None)
    cases, maskless = _mask_takers(cases)
    printer = int(os.environ.get("RANK", "0")) == 0
    if printer and maskless:
        print("".join(f"note: {what}: --impl {impl} skipped (does not take mask=): {n} case(s); give it a mask "
                      "keyword (a cpref.Mask: its .slices say which keys each query sees) to verify it under masks\n"
                      for impl, n in maskless.items()), end="", flush=True)  # fmt: skip
    if not cases:
        return fail(prog, f"{what}: no case left to run, every --impl skipped (does not take mask=)")
    try:
        check_cases(cases, world, args.backend, args.setup.heads)  # refused in one line, before anything is printed
        if probe:
            from sim.tools.verify.probe import check_mask, check_size

            check_size(args.setup, cases)
    except ValueError as exc:
        return fail(prog, str(exc))
    if printer and not probe:
        _describe(args, cases, world)
    try:
        if probe:
            report = check_mask(cases, args.setup, nproc=args.nproc, backend=args.backend, timeout=args.timeout)
        else:
            report = run(cases, args.setup, nproc=args.nproc, backend=args.backend, timeout=args.timeout,
                         progress=args.progress)  # fmt: skip
    except ValueError as exc:
        return fail(prog, str(exc))
    except LaunchFailure as failure:
        print(f"{'mask check' if probe else 'verification'} FAILED: a rank failed before every case was compared\n"
              f"{failure}", file=sys.stderr)  # fmt: skip
        return 1
    if report is None:
        return 0  # torchrun rank > 0: rank 0 compares and prints
    print(report.format())
    if probe:
        print("mask check " + ("passed" if report.ok else "FAILED"), flush=True)
        return 0 if report.ok else 1
    print(KEY)
    if report.traffic:
        print(f"\nwhat every rank moved and computed (forward{'' if args.forward_only else ' + backward'}; "
              "sim.tools.verify.wire):\n" + traffic_table(report.traffic_rows(), args.balance or BALANCE_LIMIT))
    unbalanced = report.unbalanced(args.balance) if args.balance else []
    verdict, status = summary(report, unbalanced, args.balance)
    print(verdict, flush=True)
    return status


def _describe(args: argparse.Namespace, cases: Sequence[Case], world: int) -> None:
    """The lines before the table: what runs, on what, against what; the skipped modes; the batches' notes."""
    s, window = args.setup, "" if args.window == NO_WINDOW else f", window {_pair(args.window)}"
    window += "".join(f", {name} {value:g}" for name, value in args.variants.items())
    if args.skipped:
        print(f"note: --window {_pair(args.window)} skips mode {', '.join(args.skipped)} (no sliding window); "
              f"the modes that take one: {', '.join(window_modes())}", flush=True)  # fmt: skip
    print(f"rank-by-rank verification: {len(cases)} case(s) on {world} {args.backend} rank(s), kernel {s.kernel}; "
          f"documents {','.join(map(str, s.docs))}{' padded' if args.padded else ''}, Hq={s.heads[0]} "
          f"Hkv={s.heads[1]} D={s.head_dim}, {_mask_name(args)}{window}, seed {s.seed}; "
          "errors against the simulated cluster in FP64 "
          f"(pass/fail), vs P=1: error against the oracle over that of the same attention without CP (baseline "
          f"{label(s.baseline)}; pass: <= 2), "
          "oracle column: against the FP64 oracle", flush=True)  # fmt: skip
    note = "\n".join(n for n in (lengths_note(s, cases), random_note(s.seed, _random_totals(s, cases))) if n)
    if note:
        print(note, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
