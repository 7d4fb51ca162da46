"""The public entry point: `cpref.attention`.

```python
# given: comm, cu_seqlens, q, k, v; comm: this rank's CP group; q, k, v: the whole packed batch (T, H, D)
sharding = cpref.Sharding(cu_seqlens, cp_size=comm.size, layout="zigzag")
out = cpref.attention(sharding.shard(q, comm.rank), sharding.shard(k, comm.rank), sharding.shard(v, comm.rank),
                      sharding, comm=comm, mode="all_gather")
```

Its `q, k, v` are this rank's shards, `sharding` the [`Sharding`][cpref.batch.sharding.Sharding] that
cut them (the document boundaries, real and padded, the CP size and the layout, given once),
and `comm` the CP group's collectives ([`cpref.comm.protocol.Collectives`][cpref.comm.protocol.Collectives]). The result is this rank's
output shard, differentiable (once) in `q`, `k` and `v` through an `autograd.Function` with an
explicit backward: autograd never runs through a collective.

## Validation before communication

Under `torch.autocast`, the inputs arrive in the autocast dtype (bf16 from the projections) and
attention still computes in its own precision: autocast is switched off for the mode's forward
(the backward runs outside autocast, where training loops call it).

Every input is validated **before any of the mode's communication**, by checks that depend
mostly on values every rank shares (the global boundaries, the shapes, the arguments), so a
bad call fails on every rank alike instead of leaving some ranks waiting in a collective. The
checks, in order:
the communicator and the sharding (its CP size must be the group's), the mode and its options,
the flags (`causal`, the window), the kernel, the tensors (dims, dtypes, heads, head dims), the scale, the shard size
(the boundaries were validated when the sharding was built, once per batch), the mode's own constraints, and the
backend's known limits. Then, on every call, the ranks compare their arguments with one
tiny host exchange ([`cpref.modes.consistency`][cpref.modes.consistency]). A rank whose own inputs fail
(its shard's length, say, which only it sees) still meets the others in that comparison,
marked invalid, before raising: they raise too, naming it, instead of waiting for it.

## The output

It is differentiable (once) in `q`, `k` and `v`, and handed out as a view
([`CPAttentionOutput`][cpref.api.CPAttentionOutput]): an in-place edit of it (`out.add_(1)`) is
refused by autograd in every mode, naming it; edit `out.clone()` instead.

## Under torch.compile

`attention` is a graph break (`torch.compiler.disable`): a model compiled with `torch.compile`
(`inductor`, `aot_eager`, ...) compiles the code before and after each call, and the call itself,
its checks, the host exchange, the mode's collectives and kernels, forward and backward, runs
eagerly, as without compile. So the output and gradients are those of the eager attention, and a new
batch's `Sharding` (another object, the same shapes) reuses the compiled graphs. With
`fullgraph=True`, dynamo raises at the call, naming `attention` and this reason: compile the parts
around it instead. Why not inside a graph: the checks and the collectives are host code, and the
kernels write into strided views of their outputs, which functionalization refuses.

## Modes

`MODES` maps each mode name to the [`ModeSpec`][cpref.modes.spec.ModeSpec] its own file
declares at its end (its run, plan, collectives, options, checks and costs), collected from
the modules of [`cpref.modes`][cpref.modes]: adding a mode, or an option to one, touches that
mode's file only. A mode option given to another mode is an error, never silently ignored.
"""

from __future__ import annotations

import contextlib
import importlib
import numbers
import pkgutil
import reprlib
from types import MappingProxyType
from typing import Any, Mapping

import torch

import cpref.modes
from cpref.base.checks import as_bool, as_choice, as_int, as_scale, missing_members
from cpref.base.errors import CPInputError
from cpref.batch.layout import LAYOUTS
from cpref.batch.mask import Mask, check_mask
from cpref.batch.sharding import Sharding
from cpref.comm.protocol import Collectives, check_comm
from cpref.kernels import AttentionKernel, check_heads, default_kernel
from cpref.kernels.contract import FLOAT_DTYPES, NO_WINDOW, SoftCapped, check_softcap, check_window, compute_dtype
from cpref.modes.call import CPCall, records_backward
from cpref.modes.consistency import check_ranks_agree, report_invalid_inputs
from cpref.modes.costs import ModeCosts
from cpref.modes.spec import ModeSpec

__all__ = ["attention", "MODES", "CPAttentionOutput", "collect_modes", "mode_costs", "prepare", "check_mode", "check_sharding"]


def collect_modes() -> dict[str, ModeSpec]:
    """Every mode of `cpref.modes`: the `MODE` each module declares at its end, in their `order`."""
    specs = []
    for info in pkgutil.iter_modules(cpref.modes.__path__):
        spec = getattr(importlib.import_module(f"cpref.modes.{info.name}"), "MODE", None)
        if spec is not None:
            specs.append(spec)
    return {spec.name: spec for spec in sorted(specs, key=lambda spec: spec.order)}


MODES: Mapping[str, ModeSpec] = MappingProxyType(collect_modes())

# keywords of the old form, whose values are now the sharding's: named, not reported as unknown options
_SHARDING_KEYWORDS = ("cu_seqlens", "cu_seqlens_padded", "layout", "cp_size")


def _check_options(mode: str, given: dict[str, Any]) -> dict[str, Any]:
    spec = MODES[mode]
    mine, every = {o.name for o in spec.options}, sorted({o.name for other in MODES.values() for o in other.options})
    for name, value in given.items():
        if name in _SHARDING_KEYWORDS:
            raise CPInputError(
                f"{name}= is not an argument of cpref.attention: the boundaries, the layout and the CP size are the "
                f"batch's cpref.Sharding's, given once (cpref.Sharding(cu_seqlens, cp_size=P, layout=..., "
                "cu_seqlens_padded=...)); shard q, k, v with it and pass it as the fourth argument"
            )
        if name not in every:
            raise CPInputError(f"cpref.attention got an unknown option {name}={value!r}; the modes' options are {every}")
        if name not in mine and value is not None:  # another mode's option, given a value (None: absent)
            users = [m for m, other in MODES.items() if name in {o.name for o in other.options}]
            raise CPInputError(f"{name}={value!r} is only used by mode {' / '.join(users)}, not mode={mode!r}")
    return spec.parse_options(given)


def mode_costs(mode: str, sharding: Sharding | None = None, **arguments: Any) -> ModeCosts:
    """The per-rank costs of one layer of `mode`, from its own declaration (see `cpref.modes.costs`).

    Two ways: for a batch, `mode_costs(mode, sharding, heads=, dtype=, rank=0, causal=True, window=, chunk=, **options)`
    asks the mode what it does on `rank` for that call: the formulas with the amounts read from the plan it
    runs ([`ModeSpec.call_costs`][cpref.modes.spec.ModeSpec.call_costs]); or, without a batch, the formulas
    themselves, with every amount given.

    Args:
        mode: a name in `MODES`.
        sharding: the batch, or None for the formulas alone.
        **arguments: with a `sharding`: `heads` `(Hq, Hkv, D, Dv)`, `dtype`, `rank`, `causal`, `window`, `chunk` and the
            mode's options, validated as `cpref.attention` validates them. Without: `P`, `local_tokens`,
            `heads`, `dtype`, `selected_kv_rows` (the all-gather plan's `sum(kv_len)`, for `save_gathered_kv`),
            `halo_sizes` (the ring plan's `halo.sizes`, under a window or with the stream and balanced layouts),
            `gathered_rows` (the all-gather plan's, with those layouts), `window` (the call's sliding window,
            default none) and the mode's options.

    Raises:
        ValueError: (`CPInputError`) as `cpref.attention` would refuse the call, naming the value.
    """
    mode = as_choice("mode", mode, list(MODES))
    if sharding is None:
        return MODES[mode].mode_costs(**arguments)
    return MODES[mode].call_costs(_costed_call(mode, sharding, **arguments))


def _costed_call(mode: str, sharding: Any, *, heads: Any, dtype: Any, rank: int = 0, causal: bool = True,
                 window: Any = NO_WINDOW, chunk: Any = None, **options: Any) -> CPCall:  # fmt: skip
    """The `CPCall` of rank `rank` that `mode_costs` costs (no tensors: their heads and dtype are given)."""
    if not isinstance(sharding, Sharding):
        sharding = check_sharding(sharding, 1)  # refused with its message
    rank = as_int("rank", rank, lo=0, hi=sharding.cp_size)
    if not (isinstance(heads, (tuple, list)) and len(heads) == 4):
        raise CPInputError(f"heads must be (Hq, Hkv, D, Dv), got {heads!r}")
    heads = tuple(as_int(name, h, lo=1) for name, h in zip(("Hq", "Hkv", "D", "Dv"), heads))
    if dtype not in FLOAT_DTYPES:
        raise CPInputError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    causal = as_bool("causal", causal)
    call = CPCall(sharding, rank, causal, check_window(window, causal), 1.0, None, heads, dtype, torch.device("cpu"),
                  MappingProxyType(_check_options(mode, options)), chunk=_check_chunk(chunk))  # fmt: skip
    _check_mode_constraints(call, mode)
    return call


VARIANTS = {"chunk": "chunked attention", "sinks": "learnable sinks", "softcap": "logit soft-capping",
            "mask": "a mask given as slices"}


def _check_chunk(chunk: Any) -> int | None:
    """`chunk` as an int `C >= 1` (a query sees only its own chunk of `C` positions), or None."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
        raise CPInputError(f"chunk={chunk!r} must be an int >= 1, the positions of a chunk (Llama 4's "
                           "attention_chunk_size, 8192), or None for no chunks")  # fmt: skip
    return int(chunk)


def _check_sinks(sinks: Any, q: torch.Tensor) -> torch.Tensor | None:
    """`sinks` if it is one float logit per query head `(Hq,)` on the device of `q`, and trained where `q` is."""
    if sinks is None:
        return None
    fix = f"pass the layer's sinks, a float tensor of shape ({q.shape[1]},) (one logit per query head) on {q.device}"
    if not isinstance(sinks, torch.Tensor):
        raise CPInputError(f"sinks is {type(sinks).__name__}, not a tensor; {fix}")
    if tuple(sinks.shape) != (q.shape[1],) or not sinks.is_floating_point() or sinks.device != q.device:
        raise CPInputError(f"sinks has shape {tuple(sinks.shape)}, dtype {sinks.dtype} on {sinks.device}; {fix}")
    frozen = isinstance(sinks, torch.nn.Parameter)  # a parameter that does not require grad is frozen on purpose (LoRA)
    if torch.is_grad_enabled() and q.requires_grad and not sinks.requires_grad and not frozen:
        raise CPInputError("sinks do not require grad while q does: training would leave them untrained without a word; "
                           "pass a parameter (sinks.requires_grad_(), or a frozen torch.nn.Parameter), or run under "
                           "torch.no_grad() to evaluate")  # fmt: skip
    return sinks


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    check_heads(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FLOAT_DTYPES:
            raise CPInputError(f"{name} has dtype {t.dtype}; use one of {FLOAT_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise CPInputError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on {q.device}/{k.device}/{v.device}"
        )


def prepare(q, k, v, sharding, *, comm, mode=None, causal=True, window=NO_WINDOW, softmax_scale=None, kernel=None,
            deterministic=False, softcap=None, chunk=None, sinks=None, mask=None, **options) -> CPCall:  # fmt: skip
    """Validate one `attention` call without communicating; return it as a `CPCall`.

    Raises:
        ValueError: (`CPInputError`) naming the offending value and the fix.
    """
    # 1) who we are, what to run, how
    rank, P = check_comm(comm)
    sharding = check_sharding(sharding, P)
    if mode is None:  # left out
        raise CPInputError(f"cpref.attention needs mode=, the CP algorithm: one of {sorted(MODES)} (cpref.MODES; the "
                           "docs' 'Which mode?' compares them), the same on every rank")  # fmt: skip
    mode = as_choice("mode", mode, sorted(MODES))
    options = _check_options(mode, options)
    causal = as_bool("causal", causal)
    window = check_window(window, causal)
    deterministic = as_bool("deterministic", deterministic)
    kernel = default_kernel(getattr(q, "device", None), deterministic=deterministic) if kernel is None else kernel
    if missing_members(kernel, AttentionKernel):
        raise CPInputError(
            f"kernel must be an attention kernel instance (forward and backward, see cpref.kernels.AttentionKernel), "
            f"got {_kernel_name(kernel)} (without {', '.join(missing_members(kernel, AttentionKernel))}); pass e.g. cpref.TorchKernel()"
        )
    if deterministic and getattr(kernel, "deterministic", False) is not True:
        raise CPInputError(
            f"deterministic=True needs a kernel whose backward is repeatable, but {_kernel_name(kernel)} does not declare "
            "deterministic = True; pass e.g. kernel=cpref.CudaKernel(deterministic=True), cpref.NpuKernel(deterministic=True) "
            "or cpref.TorchKernel(), or leave kernel unset"
        )
    # 2) the tensors and the scale
    _check_tensors(q, k, v)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else as_scale(softmax_scale, compute_dtype(q.dtype))
    # 3) the shard size (the boundaries, validated once per batch, are the sharding's)
    sharding.check_local(q=q, k=k, v=v)
    heads = (q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    softcap, chunk, sinks = check_softcap(softcap), _check_chunk(chunk), _check_sinks(sinks, q)
    mask = check_mask(mask, sharding.cu_seqlens[-1], causal=causal, window=window, chunk=chunk)
    if softcap is not None:
        if "softcap" not in getattr(kernel, "variants", ()):
            raise CPInputError(f"softcap={softcap} needs a kernel that soft-caps its logits, but {_kernel_name(kernel)} does "
                               "not list 'softcap' in its variants; pass kernel=cpref.TorchKernel() (or CudaKernel, which "
                               "hands such calls to it), or leave kernel unset")  # fmt: skip
        kernel = SoftCapped(kernel, softcap)
    call = CPCall(sharding, rank, causal, window, scale, kernel, heads, q.dtype, q.device, MappingProxyType(options),
                  deterministic, softcap, chunk, sinks, records_backward(q, k, v, sinks), mask)  # fmt: skip
    # 4) the mode's own constraints, and what the backend cannot do
    spec = _check_mode_constraints(call, mode)
    missing = spec.collectives & frozenset(comm.unsupported_ops)
    if missing:
        raise CPInputError(
            f"mode={mode!r} needs {sorted(missing)}, which this communicator ({type(comm).__name__}, size {P}) "
            "does not support; choose another mode or CP size"
        )
    return call


def _check_mode_constraints(call: CPCall, mode: str):
    """The mode's own constraints on a call (its window, its variants, its heads, its options); returns its
    `ModeSpec`."""
    spec = MODES[mode]
    if call.window != NO_WINDOW and not spec.windows:
        takes = [name for name, other in MODES.items() if other.windows]
        raise CPInputError(f"mode={mode!r} does not take a sliding window yet (window={call.window}); the modes that do: {takes}")
    for variant in sorted(call.variants - {"softcap"} - spec.variants):  # every mode soft-caps: its kernel calls do
        takes = [name for name, other in MODES.items() if variant in other.variants]
        raise CPInputError(f"mode={mode!r} does not run {VARIANTS[variant]} ({variant}=) yet; the modes that do: {takes}")
    if spec.check is not None:
        spec.check(call)
    return spec


def _kernel_name(kernel: Any) -> str:
    """The kernel named by its class, the same on every rank (a repr carries the object's address)."""
    if isinstance(kernel, (str, int, float)):
        return repr(kernel)
    if isinstance(kernel, type):
        return f"the class {kernel.__qualname__} (an instance is needed)"
    return f"an instance of {type(kernel).__qualname__}"


def check_mode(mode: str, *, cp_size: int, heads: tuple[int, int], causal: bool = True, window=NO_WINDOW,
               layout: str = "zigzag", mask: bool = False, **options: Any) -> None:  # fmt: skip
    """Refuse, as `attention` would, a mode that cannot run at `cp_size` with `heads = (Hq, Hkv)` (under a mask, where
    `mask` is True), without tensors or a communicator: what a tool checks of its arguments before it starts a process.

    Raises:
        ValueError: (`CPInputError`) an unknown mode, layout or option, a window the mode does not take, heads
            the mode cannot split over `cp_size` ranks, or an option that does not fit `cp_size`.
    """
    P = as_int("cp_size", cp_size, lo=1)
    mode = as_choice("mode", mode, sorted(MODES))
    options = _check_options(mode, options)
    window = check_window(window, as_bool("causal", causal))
    hq, hkv = (as_int(name, h, lo=1) for name, h in zip(("Hq", "Hkv"), heads))
    if hq % hkv:
        raise CPInputError(f"heads: Hq = {hq} is not a multiple of Hkv = {hkv} (GQA shares each key/value head "
                           "among Hq / Hkv query heads)")  # fmt: skip
    sharding = Sharding.eod_padded([0, 1], cp_size=P, layout=as_choice("layout", layout, list(LAYOUTS)))
    any_mask = Mask.causal_documents([0, 1]) if as_bool("mask", mask) else None  # what the mode checks is that there is one
    call = CPCall(sharding, 0, causal, window, 1.0, None, (hq, hkv, 1, 1), torch.float32, torch.device("cpu"),
                  MappingProxyType(options), mask=any_mask)  # fmt: skip
    _check_mode_constraints(call, mode)


def check_sharding(sharding: Any, cp_size: int) -> Sharding:
    """`sharding` if it is a `Sharding` over `cp_size` ranks (the communicator's size), else a `CPInputError`."""
    if not isinstance(sharding, Sharding):
        raise CPInputError(
            f"the batch must be described by a cpref.Sharding, got {type(sharding).__name__} {reprlib.repr(sharding)}; build it "
            f"once per batch, e.g. sharding = cpref.Sharding(cu_seqlens, cp_size={cp_size}, layout='zigzag'), shard q, k, v "
            "with sharding.shard(x, rank) and pass it here (it carries the layout, the CP size and the boundaries)"
        )
    if sharding.cp_size != cp_size:
        raise CPInputError(
            f"the batch is sharded over cp_size={sharding.cp_size} ({sharding!r}) but the communicator has "
            f"{cp_size} ranks; shard it for this group with cpref.Sharding(..., cp_size={cp_size})"
        )
    return sharding


# the "Under torch.compile" section above; the reason is in dynamo's graph-break message and fullgraph=True's error
EAGER_REASON = ("cpref.attention runs eagerly under torch.compile (a graph break: it checks its inputs on the host and "
                "communicates across ranks); the code around it compiles; with fullgraph=True compile the code before "
                "and after it (the layers' projections, MLPs) instead of the whole model")  # fmt: skip


@torch.compiler.disable(reason=EAGER_REASON)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sharding: Sharding,
    *,
    comm: Collectives,
    mode: str | None = None,
    causal: bool = True,
    window: tuple[int, int] = NO_WINDOW,
    softmax_scale: float | None = None,
    kernel: AttentionKernel | None = None,
    deterministic: bool = False,
    softcap: float | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    mask: Mask | None = None,
    check_ranks: bool = True,
    **options: Any,
) -> torch.Tensor:
    """Context-parallel attention over a packed THD batch.

    Args:
        q: `(T / P, Hq, D)` this rank's query shard.
        k: `(T / P, Hkv, D)` this rank's key shard, `Hq % Hkv == 0`.
        v: `(T / P, Hkv, Dv)` this rank's value shard, `Dv <= D`.
        sharding: how the batch is sharded (boundaries, real and padded, CP size, layout): the
            [`Sharding`][cpref.batch.sharding.Sharding] that sharded `q, k, v`. Padding, where the
            sharding has it, is seen by no query, padding queries give 0 and padding rows get
            zero gradients.
        comm: the CP group's collectives, of `sharding.cp_size` ranks.
        mode: the CP algorithm, one of `MODES` (required: left out, a `CPInputError` lists them).
        causal: causal (default) or full attention inside each document.
        window: `(left, right)`, a sliding window inside each document: the query at position
            `p` sees the keys at positions `p - left .. p + right` (the FlashAttention
            convention; -1: unbounded on that side; `causal=True` is `right = 0`, so
            `causal=True, window=(w, 0)` is a causal window of `w + 1` keys). Default `(-1, -1)`:
            no window. Hugging Face's `sliding_window = W` (a window of `W` keys including the
            token itself) is `window=(W - 1, 0)`; the NPU's `pre_tockens` / `next_tockens` are
            `left` / `right`.
        softmax_scale: logit scale, default `D ** -0.5`.
        kernel: the attention kernel, default [`CudaKernel`][cpref.kernels.CudaKernel] for CUDA tensors,
            [`TorchKernel`][cpref.kernels.TorchKernel] otherwise (`cpref.kernels.default_kernel`).
        deterministic: make the backward bit for bit repeatable where it is not by default (CUDA's atomics):
            the backward's row sums in occurrence layers and the kernel's own backward in its deterministic
            algorithm ([`cpref.base.determinism`][cpref.base.determinism]); the kernel must declare `deterministic = True`
            (without a kernel, the default kernel is built so). Default False.
        softcap: logit soft-capping (Gemma 2): every score becomes `softcap * tanh(S / softcap)` before the
            mask and the softmax, in every kernel call, forward and backward. Default None: none.
        chunk: chunked attention (Llama 4's chunked layers): a query sees only the keys of its own chunk of
            `chunk` positions of its document, causal or not, with a window or not; what travels follows
            the chunks ([`cpref.modes.visible`][cpref.modes.visible]); not with all_gather's `overlap=True`
            (refused). Default None: none.
        sinks: learnable sinks (GPT-OSS): `(Hq,)`, one logit per query head that joins every row's softmax
            denominator once and carries no value ([`cpref.kernels.sinks`][cpref.kernels.sinks]); a parameter:
            each rank's gradient is its rows' and heads' share, summed over the CP group as every replicated
            parameter's is; not with `head_groups > 1` (refused). Default None: none.
        mask: which keys each query sees, any mask as a union of slices over the real batch's tokens
            ([`cpref.Mask`][cpref.batch.mask.Mask]: prefix-LM, bidirectional image spans, shared prompts, dense
            masks, FlexAttention `mask_mod`s), in place of `causal`, `window` and `chunk` (given together,
            refused); in every mode and layout, each rank's kernel calls computing only the pairs the mask shows
            ([`cpref.modes.mask_plan`][cpref.modes.mask_plan]). Default None: causal (or full) documents.
        check_ranks: compare the arguments across ranks with one tiny host exchange on every
            call (see `cpref.modes.consistency`); if every rank passes `False` on the first call of a
            communicator, its later calls skip it.
        **options: the mode's own options, as the mode declares them (`MODES[mode].options`,
            each with its default, parser and a line of documentation; the
            [modes' page][cpref.modes.spec] lists them all). An option of another mode, or one
            no mode has, is an error.

    Returns:
        `(T / P, Hq, Dv)` this rank's output shard, in the layout of `q`.

    Raises:
        ValueError: on any invalid input, before any of the mode's communication, on every rank
            alike (a rank whose own shard fails first tells the others in the ranks' comparison).
    """
    check_ranks = as_bool("check_ranks", check_ranks)
    try:
        call = prepare(q, k, v, sharding, comm=comm, mode=mode, causal=causal, window=window,
                       softmax_scale=softmax_scale, kernel=kernel, deterministic=deterministic, softcap=softcap,
                       chunk=chunk, sinks=sinks, mask=mask, **options)  # fmt: skip
    except CPInputError:
        if _usable(comm):  # the others may be entering the comparison: meet them there
            with contextlib.suppress(Exception):  # if that fails too, this rank's own error is still the one to see
                report_invalid_inputs(comm, q)
        raise
    check_ranks_agree(call, mode, comm, check_ranks)  # every call, unless the group agreed on check_ranks=False
    # attention computes in its own precision (float32 sums for bf16/fp16 inputs), autocast or not:
    # CPU and CUDA autocast would lower the kernel's float32 matmuls to bf16 in the forward only,
    # and the backward's recomputed probabilities would no longer match the saved lse
    with _no_autocast(q.device.type):
        return CPAttentionOutput.apply(MODES[mode].run(q, k, v, call, comm))


class CPAttentionOutput(torch.autograd.Function):
    """The output of every mode, handed out as a view of itself: an in-place edit is refused alike in every mode.

    Some modes save the tensor they return for their backward (the ring and the all-gather: it gives
    the backward's `Delta`), so an in-place edit of it would change their gradients, or fail in one
    mode and pass in another. Returned as a view of a custom Function's output, it is refused by
    autograd at the edit, naming this Function ("Output 0 of CPAttentionOutput is a view and is being
    modified inplace"), whatever the mode, layout or batch; the fix is to edit `out.clone()`. Without
    autograd (`torch.no_grad()`) it is an ordinary tensor.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        """`out`, as a view of itself."""
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> torch.Tensor:
        """The identity: the mode's own Function takes `dout`."""
        return dout


def _usable(comm: Any) -> bool:
    """Whether `comm` passed its own validation, so that a failing rank can still reach the others."""
    try:
        check_comm(comm)
    except CPInputError:
        return False
    return True


def _no_autocast(device_type: str):
    """A context in which autocast is off for `device_type` (nothing to do where autocast does not exist)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
