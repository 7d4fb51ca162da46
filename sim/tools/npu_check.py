r"""`make test-npu`: `NpuKernel` against the FP64 oracle on one Ascend NPU.

`python -m sim.tools.npu_check` runs every case below in float16 and bfloat16 on one NPU and prints
one row per case and dtype: the largest absolute error of `out`, `lse`, `dq`, `dk`, `dv`
against the oracle run on the same (rounded) inputs, and pass/fail at the field's tolerances
(atol = rtol = 5e-3 for fp16, 2.5e-2 for bf16, 3.5e-2 for bf16 with GQA). It exits non-zero
on any failure. Where no NPU is usable it prints one line saying so and exits 0, so the
target is safe anywhere. It lives in the harness, not in `cpref`, because the oracle does.

The adapter was written from documentation alone; each of its guesses has a case that fails
loudly if the guess is wrong:

| guess in `NpuKernel` | cases that fail if it is wrong |
| --- | --- |
| TND softmax stats are stored per sequence, head-major | every case with several sequences (lse, then every gradient) |
| `softmax_layout="TND"` gives token-major stats | `*-stats-TND` (optional: reported `n/a` if this torch_npu lacks it) |
| `sparse_mode=3` + 2048 mask is bottom-right causal | `bottom-right`, `packed-*-causal` |
| zero-length sequences inside the lists are fine | `no-key-rows`, `empty-sequences-*` |
| grad with `softmax_max = lse`, `softmax_sum = 1` gives `exp(S - lse)` | every gradient, and `ring-global-lse` (a longer row's lse) |
| at most 2048 sequences per call | `2100-sequences` |
| `sparse_mode=4` is a band counted from each sequence's bottom-right corner, `pre_tockens` / `next_tockens` its sides (windows, shifts) | `window-*` |

**Multi-rank verification.** After the single-device table, `make test-npu` runs the command
lines of [`multi_rank_commands`][sim.tools.npu_check.multi_rank_commands]: the rank-by-rank check
of every mode (`python -m sim verify --backend hccl --kernel npu`, see `sim.tools.verify`) in fp16
and bf16 at CP 2, 4 and 8, as far as the machine has NPUs.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from cpref.kernels import Varlen
from cpref.kernels.merge import merge_partial
from sim import oracle
from sim.oracle import TOL, TOL_BF16_GQA
from sim.tools.cli import Parser, nonnegative

__all__ = ["Case", "CASES", "Row", "find_npu", "format_table", "main", "multi_rank_commands", "run_case", "run_cases"]

NAMES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    """One check: sequence lengths, heads `(Hq, Hkv, D, Dv)`, masking and the kernel's stat layout.

    `ring`: the keys of each sequence are split into the earlier ones (a full call) and the
    last `q_len` (a causal call); the outputs merge by lse and both backward calls get the
    merged, *global* out and lse. `optional`: an exception is reported `n/a`, not a failure.
    `window`, `shifts`: a sliding window and explicit shifts of the sequences (the kernel
    contract's); the reference is then a dense band per sequence.
    """

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    heads: tuple[int, int, int, int]
    causal: bool
    softmax_layout: str = ""
    ring: bool = False
    optional: bool = False
    window: tuple[int, int] = (-1, -1)
    shifts: tuple[int, ...] | None = None


def _many(n: int) -> tuple[int, ...]:
    return tuple(1 + (i * 7) % 4 for i in range(n))  # lengths 1..4, deterministic


MHA, GQA, MQA, MLA = (8, 8, 128, 128), (16, 4, 128, 128), (8, 1, 64, 64), (8, 2, 192, 128)
PACKED = (256, 1000, 1, 513, 7)
CASES = [
    Case("packed-mha-causal", PACKED, PACKED, MHA, True),
    Case("packed-gqa-full", PACKED, PACKED, GQA, False),
    Case("packed-mqa-causal", PACKED, PACKED, MQA, True),
    Case("packed-mla-causal", (300, 129), (300, 129), MLA, True),
    Case("bottom-right", (100, 1, 64), (700, 300, 64), GQA, True),
    Case("q-shorter-full", (100, 1, 64), (700, 300, 64), GQA, False),
    Case("no-key-rows", (50, 20, 30, 16), (10, 0, 30, 16), GQA, True),
    Case("empty-sequences-causal", (0, 40, 0, 60, 0), (30, 0, 0, 60, 20), GQA, True),
    Case("empty-sequences-full", (0, 40, 0, 60, 0), (30, 0, 0, 60, 20), GQA, False),
    Case("ring-global-lse", (128, 64, 96), (384, 64, 200), GQA, True, ring=True),
    Case("2100-sequences", _many(2100), _many(2100), (4, 2, 64, 64), True),
    Case("packed-gqa-causal-stats-TND", PACKED, PACKED, GQA, True, softmax_layout="TND", optional=True),
    Case("ring-stats-TND", (128, 64, 96), (384, 64, 200), GQA, True, softmax_layout="TND", ring=True, optional=True),
    Case("window-causal", PACKED, PACKED, GQA, True, window=(127, 0)),
    Case("window-full-asymmetric", PACKED, PACKED, MHA, False, window=(64, 16)),
    Case("window-shifted", (100, 64, 40), (300, 64, 90), GQA, True, window=(50, 0), shifts=(120, -10, 30)),
    Case("window-shifted-full", (100, 64, 40), (300, 64, 90), MLA, False, window=(20, 40), shifts=(120, -10, 30)),
]


@dataclass
class Row:
    """One line of the table: a case in one dtype."""

    case: str
    dtype: str
    errors: dict[str, float]
    tol: float
    status: str  # "pass", "FAIL", "ERROR" or "n/a"
    note: str = ""

    @property
    def ok(self) -> bool:
        """Whether every error is within the tolerance."""
        return self.status in ("pass", "n/a")


def find_npu() -> tuple[bool, str]:
    """Return `(found, reason)`: whether torch_npu imports and sees at least one device."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or a CANN library failing to load
        return False, f"torch_npu is not importable ({type(exc).__name__}: {exc})"
    count = torch.npu.device_count() if hasattr(torch, "npu") else 0
    if count < 1:
        return False, f"torch_npu {getattr(torch_npu, '__version__', '?')} sees no device"
    return True, f"{count} Ascend NPU(s) with torch_npu {getattr(torch_npu, '__version__', '?')}"


def reference(q, k, v, q_lens, kv_lens, dout, *, causal: bool, scale: float):
    """`(out, lse, dq, dk, dv)` in float64 from the oracle, one self-attention document per sequence.

    Sequence `i`'s queries are placed into a document of its `kv_len` keys: bottom-right causal
    puts query `j` at key position `j + kv_len - q_len` (rows before 0 see nothing); without a
    mask any positions do, in chunks of at most `kv_len` rows. Other rows get a zero `dout`.
    """
    q, k, v, dout = (x.double().cpu() for x in (q, k, v, dout))
    out, lse = q.new_zeros(*q.shape[:2], v.shape[2]), q.new_full(q.shape[:2], -math.inf)  # (T, Hq, Dv), (T, Hq)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q0 = k0 = 0
    for n_q, n_k in zip(q_lens, kv_lens):
        chunks = [(max(0, n_q - n_k), n_q, n_k - n_q)] if causal else [(a, min(a + n_k, n_q), -a) for a in range(0, n_q, n_k or 1)]
        for a, b, shift in chunks if n_k else []:  # (first row, end row, position shift)
            pos = torch.arange(a, b) + shift  # (b - a,) positions in the key document
            qd, dod = q.new_zeros(n_k, *q.shape[1:]), q.new_zeros(n_k, *dout.shape[1:])  # (n_k, Hq, D|Dv)
            qd[pos], dod[pos] = q[q0 + a : q0 + b], dout[q0 + a : q0 + b]
            o, l, gq, gk, gv = oracle.forward_backward(qd, k[k0 : k0 + n_k], v[k0 : k0 + n_k], torch.tensor([0, n_k]), dod, causal=causal, scale=scale)
            out[q0 + a : q0 + b], lse[q0 + a : q0 + b], dq[q0 + a : q0 + b] = o[pos], l[pos], gq[pos]
            dk[k0 : k0 + n_k] += gk
            dv[k0 : k0 + n_k] += gv
        q0, k0 = q0 + n_q, k0 + n_k
    return out, lse, dq, dk, dv


def _run_plain(kernel, case: Case, q, k, v, dout, scale):
    seqs = Varlen.from_lengths(case.q_lens, case.kv_lens, case.shifts)
    mask = dict(causal=case.causal, window=case.window, scale=scale)
    out, lse = kernel.forward(q, k, v, seqs, **mask)
    return (out, lse, *kernel.backward(dout, q, k, v, out, lse, seqs, **mask))


def band_reference(q, k, v, case: Case, dout, *, scale: float):
    """`(out, lse, dq, dk, dv)` in float64 of a windowed or shifted case, one dense band per sequence: query `x`
    stands at key `p = x + shift` and sees the keys `p - left .. p + right` (the kernel contract's rule)."""
    q, k, v, dout = (x.double().cpu().requires_grad_(x is not dout) for x in (q, k, v, dout))
    seqs = Varlen.from_lengths(case.q_lens, case.kv_lens, case.shifts)
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for i, (q0, q1, k0, k1) in enumerate(seqs.pairs()):
        seen = torch.tensor([seqs.visible(i, x, case.causal, case.window) for x in range(q1 - q0)]).reshape(-1, 2)
        y = torch.arange(k1 - k0)
        hidden = (y[None, :] < seen[:, :1]) | (y[None, :] >= seen[:, 1:])  # (n_q, n_k)
        s = scale * torch.einsum("xhd,yhd->hxy", q[q0:q1], k[k0:k1].repeat_interleave(g, 1)).masked_fill(hidden, -math.inf)
        lse = torch.logsumexp(s, -1)  # (H, n_q): -inf where a row sees nothing
        p = torch.exp(s - lse.clamp_min(-1e300)[..., None]).nan_to_num(0.0)  # (H, n_q, n_k)
        outs.append(torch.einsum("hxy,yhd->xhd", p, v[k0:k1].repeat_interleave(g, 1)))
        lses.append(lse.transpose(0, 1))
    out = torch.cat(outs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), torch.cat(lses).detach(), dq, dk, dv


def _run_ring(kernel, case: Case, q, k, v, dout, scale):
    """Earlier keys (full) + diagonal block (causal), merged by lse; backward with the global lse."""
    early = [n_k - n_q for n_q, n_k in zip(case.q_lens, case.kv_lens)]
    starts = [sum(case.kv_lens[:i]) for i in range(len(early))]
    rows_a = [j for s, e in zip(starts, early) for j in range(s, s + e)]  # earlier keys
    rows_b = [j for s, e, m in zip(starts, early, case.q_lens) for j in range(s + e, s + e + m)]  # diagonal
    seqs_a, seqs_b = Varlen.from_lengths(case.q_lens, early), Varlen.from_lengths(case.q_lens, case.q_lens)
    o_a, l_a = kernel.forward(q, k[rows_a], v[rows_a], seqs_a, causal=False, scale=scale)
    o_b, l_b = kernel.forward(q, k[rows_b], v[rows_b], seqs_b, causal=True, scale=scale)
    # lse = log(e^lse_a + e^lse_b); out = sum_x e^(lse_x - lse) out_x: cpref's one merge
    out, lse = o_a.to(l_a.dtype), l_a.clone()  # (T, Hq, Dv), (T, Hq) in the lse's precision
    merge_partial(out, lse, o_b, l_b)
    out = out.to(q.dtype)
    dq_a, dk_a, dv_a = kernel.backward(dout, q, k[rows_a], v[rows_a], out, lse, seqs_a, causal=False, scale=scale)
    dq_b, dk_b, dv_b = kernel.backward(dout, q, k[rows_b], v[rows_b], out, lse, seqs_b, causal=True, scale=scale)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[rows_a], dk[rows_b], dv[rows_a], dv[rows_b] = dk_a, dk_b, dv_a, dv_b
    return out, lse, dq_a + dq_b, dk, dv


def _max_errors(got, want, tol: float) -> tuple[dict[str, float], bool]:
    """Largest |got - want| per tensor, and whether all lie within atol = rtol = tol (-inf must match)."""
    errors, ok = {}, True
    for name, g_in, w in zip(NAMES, got, want):
        g = g_in.detach().double().cpu()
        same_inf = bool(((g == w) | (torch.isfinite(g) & torch.isfinite(w))).all())
        finite = torch.isfinite(w) & torch.isfinite(g)
        diff = (g - w)[finite].abs()
        errors[name] = float(diff.max()) if diff.numel() else 0.0
        ok &= same_inf and not bool(g.isnan().any()) and bool((diff <= tol + tol * w[finite].abs()).all())
    return errors, ok


def run_case(make_kernel: Callable[[str], object], case: Case, dtype: torch.dtype, device: torch.device, *, seed: int = 0) -> Row:
    """Run one case in `dtype` on `device` and compare with the oracle on the rounded inputs."""
    hq, hkv, d, dv = case.heads
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sum(case.q_lens), hq, n, generator=gen, dtype=torch.float64).to(dtype) for n in (d, dv))
    k, v = (torch.randn(sum(case.kv_lens), hkv, n, generator=gen, dtype=torch.float64).to(dtype) for n in (d, dv))
    tol = TOL_BF16_GQA if dtype == torch.bfloat16 and hq != hkv else TOL[dtype]
    name = str(dtype).removeprefix("torch.")
    try:
        run = _run_ring if case.ring else _run_plain
        got = run(make_kernel(case.softmax_layout), case, *(x.to(device) for x in (q, k, v, dout)), d**-0.5)
    except Exception as exc:  # a failure to run is a result too: one row, and on to the next case
        note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
        return Row(case.name, name, {}, tol, "n/a" if case.optional else "ERROR", note)
    if case.window != (-1, -1) or case.shifts is not None:
        want = band_reference(q, k, v, case, dout, scale=d**-0.5)
    else:
        want = reference(q, k, v, case.q_lens, case.kv_lens, dout, causal=case.causal, scale=d**-0.5)
    errors, ok = _max_errors(got, want, tol)
    return Row(case.name, name, errors, tol, "pass" if ok else "FAIL")


def run_cases(make_kernel, device: torch.device, dtypes, *, cases=None, small: bool = False) -> list[Row]:
    """Every case in every dtype; `small` shrinks the lengths 16-fold (a CPU dry run of the harness)."""
    rows = []
    for given in CASES if cases is None else cases:
        case = given
        if small:
            shrink = lambda lens: tuple(-(-n // 16) for n in lens)  # noqa: E731  ceil(n / 16): zeros stay zeros
            case = Case(**{**given.__dict__, "q_lens": shrink(given.q_lens), "kv_lens": shrink(given.kv_lens)})
        rows += [run_case(make_kernel, case, dtype, device) for dtype in dtypes]
    return rows


def format_table(rows: list[Row]) -> str:
    """The per-case table `make test-npu` prints."""
    head = f"{'case':<30} {'dtype':<9}" + "".join(f"{n:>10}" for n in NAMES) + f"{'tol':>9}  result"
    lines = [head, "-" * len(head)]
    for r in rows:
        errs = "".join(f"{r.errors[n]:>10.2e}" if n in r.errors else f"{'-':>10}" for n in NAMES)
        lines.append(f"{r.case:<30} {r.dtype:<9}{errs}{r.tol:>9.1e}  {r.status}" + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines)


def multi_rank_commands(device_count: int) -> list[list[str]]:
    """The multi-rank runs `make test-npu` adds after the single-device table.

    The rank-by-rank verification of `sim.tools.verify` with HCCL and `NpuKernel`: every mode and
    layout, fp16 and bf16, unpadded and padded, at CP 2, 4 and 8 where `device_count` NPUs
    exist (the hierarchical mode as 2 x P/2). Each runs in order and a non-zero exit fails the
    target.

    Example:
        >>> " ".join(cmd[cmd.index("--nproc") + 1] for cmd in multi_rank_commands(4))  # CP sizes
        '2 2 4 4'
    """
    commands = []
    for cp in (2, 4, 8):
        if cp > device_count:
            break
        base = [sys.executable, "-m", "sim", "verify", "--backend", "hccl", "--kernel", "npu", "--nproc", str(cp),
                "--mode", "all", "--layout", "all", "--dtype", "fp16,bf16", "--timeout", "600"]  # fmt: skip
        commands += [base, base + ["--padded"]]
    return commands


def main(argv: list[str] | None = None) -> int:
    """`make test-npu`: the NPU suite where an NPU is present, one line and exit 0 where not."""
    parser = Parser(prog="python -m sim.tools.npu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=nonnegative, default=0, help="NPU index for the single-device checks")
    args = parser.parse_args(argv)
    found, reason = find_npu()
    if not found:
        print(f"no Ascend NPU found: {reason}; skipping the NPU tests")
        return 0
    from cpref.kernels import NpuKernel

    device = torch.device(f"npu:{args.device}")
    torch.npu.set_device(device)
    print(f"found {reason}; NpuKernel against the FP64 oracle on {device}")
    rows = run_cases(lambda layout: NpuKernel(softmax_layout=layout), device, [torch.float16, torch.bfloat16])
    print(format_table(rows))
    status = 0 if all(r.ok for r in rows) else 1
    for command in multi_rank_commands(torch.npu.device_count()):
        print("$", " ".join(command), flush=True)
        status = max(status, 1 if subprocess.run(command).returncode else 0)
    print("NPU checks " + ("passed" if status == 0 else "FAILED"))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
