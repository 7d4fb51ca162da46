r"""PyTorch's own ring attention, verified rank by rank: `--peer torch-ring`.

PyTorch ships context parallelism in `torch.distributed.tensor.experimental` (`context_parallel`,
the ring torchtitan trains with). Underneath the DTensor dispatch sit two plain functions of
`torch.distributed.tensor.experimental._context_parallel._attention`, and this adapter calls them,
nothing else: no line of their math is re-written here.

- `_templated_ring_attention(group, seq_dim, op, q, k, v, is_causal)`: the forward. Each of the
  $P$ steps runs the local attention `op` on this rank's queries and one rank's keys and values,
  and its `_SDPAMerger` folds the block into the running output by the blocks' log-sum-exp,
  $o \leftarrow o - \sigma(\mathrm{lse}_b - \mathrm{lse})\,(o - o_b)$,
  $\mathrm{lse} \leftarrow \mathrm{lse} - \log\sigma(\mathrm{lse} - \mathrm{lse}_b)$.
- `_templated_ring_attention_backward(...)`: the backward, the same ring again with the local
  backward `op`, dK and dV travelling round with an all-to-all.

The local op is the one that runs on the CPU and returns an lse,
`aten._scaled_dot_product_flash_attention_for_cpu` (and its `_backward`), called on tensors laid out
as PyTorch's SDPA takes them, `(1, H, T / P, D)` with `seq_dim = 2`; it takes $H_{kv} < H_q$ (GQA)
as it is. PyTorch's settings are its module-level `_cp_options`, set for each call and put back
after it:

| `_cp_options` | here |
| --- | --- |
| `convert_to_f32` (default True) | option `convert_to_f32`: the merge (and the backward's sums) in float32, cast back at the end |
| `rotate_method` (default all-gather) | option `rotate`: `"allgather"` or `"alltoall"`, the names of PyTorch's `set_rotate_method` |
| `enable_load_balance` | from the layout: on for zigzag under causal, off otherwise (PyTorch refuses it without causal) |

## What it runs

PyTorch's ring takes no document boundaries: it is one causal, or one full, attention over the
whole sequence. So the adapter runs what it can run exactly, and refuses everything else with
`NotImplementedError("why")` before any communication, alike on every rank (every check reads what
all ranks share: the sharding, the dtype, the device type, the options):

| supported | refused |
| --- | --- |
| one document (`--docs N`), no padding | several documents; `--padded` (no padding mask) |
| causal or full (`--no-causal`) | `--window`, `--mask`, `--softcap`, `--sinks`, `--chunk` |
| the tokens in PyTorch's order: `contiguous` (rank $r$ holds chunk $r$; `stream` is the same order on one document) or `zigzag` (chunks $r$ and $2P-1-r$: PyTorch's `_HeadTailLoadBalancer`, checked against it on every call; `balanced` is that order on one document) | any other order |
| fp32, bf16, fp16, fp64, on the CPU over gloo | another device (the CPU flash op) |

`mode` is the verifier's label for the case and is ignored (the ring is the ring), and so are the
verifier's mode options (`a2a_size`, `head_groups`, ...); an option neither the ring nor a cpref mode
takes is refused by name (`ValueError`). [`unsupported`][sim.tools.verify.peer_torch_ring.unsupported]
gives the reason without running anything, for a caller that would rather skip the case.

```bash
python -m sim verify --nproc 2 --peer torch-ring --docs 256 --dtype fp32,bf16,fp16
python -m sim verify --nproc 2 --peer torch-ring --docs 256 --dtype fp64 --impl-option convert_to_f32=False
```

(`--peer torch-ring` is `--impl sim.tools.verify.peer_torch_ring:attention --mode p2p --layout
contiguous,zigzag`, over one document of 1024 tokens unless `--docs` says otherwise.)

## What it finds (measured by `tests/backends/test_verify_torch_ring.py`)

- fp32, bf16 and fp16 pass at CP 2 and 4 in both layouts, causal and full, but one row: fp16, full attention,
  zigzag, rank 0, at seed 0 (`vs P=1` 2.16: one `dq` entry; seeds 1 and 2 pass).
- **fp64 comes back at float32 accuracy**: with PyTorch's default `convert_to_f32=True` its merge casts
  every block's output and lse to float32 (and its backward sums the gradients in float32), even at one
  rank with no CP at all, so an fp64 run is about $10^{-7}$ off the FP64 oracle where fp64 attention is
  $10^{-15}$ off; `convert_to_f32=False` gives fp64 its precision back.
- bf16 with `convert_to_f32=False` merges in bf16: the verifier's `vs P=1` column (held to the same
  ring at CP size 1, where there is nothing to merge) fails the contiguous layout's rank 1 at CP 2
  (2.15, where the default gives 1.24). The page "Verify: every option, what it checks and counts" has the table.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as pytorch_cp
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

import cpref

__all__ = ["RingOptions", "TorchRingFunc", "attention", "pytorch_order", "ring_options", "unsupported"]

FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # (out, lse)
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default  # (dq, dk, dv)
SEQ_DIM = 2  # (1, H, T / P, D): SDPA's layout, the one PyTorch's ring chunks
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
ROTATE = {"allgather": pytorch_cp._RotateMethod.ALL_GATHER, "alltoall": pytorch_cp._RotateMethod.ALL_TO_ALL}
VARIANTS = ("softcap", "chunk", "sinks")  # cpref.attention's variants: the ring has none of them
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")  # convert_to_f32 given as text (--impl-option)


@dataclass(frozen=True)
class RingOptions:
    """The ring's settings, PyTorch's `_cp_options` for one call.

    Attributes:
        convert_to_f32: merge the blocks (and sum the backward's gradients) in float32; PyTorch's default True.
        rotate: how keys and values go round, `"allgather"` (PyTorch's default) or `"alltoall"`.
        load_balance: `enable_load_balance`: the zigzag (head-tail) order under causal; set by the adapter.
    """

    convert_to_f32: bool = pytorch_cp._ContextParallelOptions.convert_to_f32
    rotate: str = "allgather"
    load_balance: bool = False

    def __post_init__(self) -> None:
        if self.rotate not in ROTATE:
            raise ValueError(f"rotate={self.rotate!r}: PyTorch's ring rotates by {' or '.join(map(repr, ROTATE))}")

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """PyTorch's global `_cp_options` set to these for the block, and put back after it."""
        opts = pytorch_cp._cp_options
        before = (opts.convert_to_f32, opts.enable_load_balance, opts.rotate_method)
        opts.convert_to_f32, opts.enable_load_balance, opts.rotate_method = (
            self.convert_to_f32, self.load_balance, ROTATE[self.rotate])
        try:
            yield
        finally:
            opts.convert_to_f32, opts.enable_load_balance, opts.rotate_method = before


def ring_options(options: dict[str, Any]) -> RingOptions:
    """The ring's settings from the call's `options`: `convert_to_f32` (a bool, or its text `true`/`false`) and `rotate`;
    the verifier's mode options (`a2a_size`, ...) are ignored.

    Raises:
        ValueError: an option neither the ring nor a cpref mode takes, or a value it cannot take, by name.
    """
    ignored = {key for spec in cpref.MODES.values() for key in spec.defaults()}  # the verifier's keys: not the ring's
    ring = {key: value for key, value in options.items() if key not in ignored and key not in VARIANTS}
    unknown = sorted(set(ring) - {"convert_to_f32", "rotate"})
    if unknown:
        raise ValueError(f"PyTorch's ring takes no option {', '.join(unknown)}; its options are convert_to_f32 "
                         "(true or false) and rotate (allgather or alltoall)")  # fmt: skip
    f32 = ring.get("convert_to_f32", RingOptions.convert_to_f32)
    if isinstance(f32, str) and f32.lower() in TRUE + FALSE:
        f32 = f32.lower() in TRUE
    if not isinstance(f32, bool):
        raise ValueError(f"convert_to_f32={f32!r}: give true or false")
    return RingOptions(convert_to_f32=f32, rotate=str(ring.get("rotate", RingOptions.rotate)))


def pytorch_order(total: int, cp_size: int, head_tail: bool) -> torch.Tensor:
    """The token order PyTorch's ring expects, `(P, T / P)`: row `r` rank `r`'s positions; chunk `r` (`head_tail`
    False) or PyTorch's own `_HeadTailLoadBalancer`'s chunks `r` and `2P - 1 - r` (True)."""
    if not head_tail:
        return torch.arange(total).view(cp_size, -1)  # (P, T / P)
    return _HeadTailLoadBalancer(total, cp_size, "cpu")._generate_indices().long().view(cp_size, -1)  # (P, T / P)


def _order(sharding: cpref.Sharding) -> str:
    """`"contiguous"` or `"head-tail"`: which of PyTorch's orders the sharding's ranks hold; `""` for neither."""
    held = torch.stack([sharding.global_index(r) for r in range(sharding.cp_size)])  # (P, T / P)
    if torch.equal(held, pytorch_order(sharding.total, sharding.cp_size, head_tail=False)):
        return "contiguous"
    if sharding.total % (2 * sharding.cp_size) == 0 and torch.equal(
            held, pytorch_order(sharding.total, sharding.cp_size, head_tail=True)):
        return "head-tail"
    return ""


def unsupported(sharding: cpref.Sharding, dtype: torch.dtype, device_type: str = "cpu", *, causal: bool = True,
                window: tuple[int, int] = (-1, -1), mask: Any = None, **options: Any) -> str:  # fmt: skip
    """Why PyTorch's ring cannot run this case exactly (`""` where it can): what `attention` raises
    `NotImplementedError` with. It reads only what every rank shares, so every rank gives the same answer.

    Examples:
        >>> unsupported(cpref.Sharding([0, 64], cp_size=2, layout="zigzag"), torch.bfloat16)
        ''
        >>> unsupported(cpref.Sharding([0, 24, 64], cp_size=2, layout="zigzag"), torch.float32)[:58]
        "PyTorch's ring attends one document, got 2 (cu_seqlens (0,"
    """
    if len(sharding.cu_seqlens) != 2:
        return (f"PyTorch's ring attends one document, got {len(sharding.cu_seqlens) - 1} (cu_seqlens "
                f"{sharding.cu_seqlens}): it takes no boundaries; run it with --docs N")  # fmt: skip
    if sharding.cu_seqlens_padded != sharding.cu_seqlens:
        return f"PyTorch's ring has no padding mask, got padded boundaries {sharding.cu_seqlens_padded}; leave out --padded"
    if mask is not None or sharding.mask is not None:
        return "PyTorch's ring is causal or full attention, it takes no mask; leave out --mask"
    if tuple(window) != (-1, -1):
        return f"PyTorch's ring has no sliding window, got window={tuple(window)}; leave out --window"
    given = [name for name in VARIANTS if options.get(name) is not None]
    if given:
        return f"PyTorch's ring has no {', '.join(given)}: plain softmax attention only"
    if dtype not in DTYPES:
        return f"dtype {dtype}: the adapter runs {', '.join(str(d) for d in DTYPES)}"
    if device_type != "cpu":
        return f"device {device_type}: the adapter calls PyTorch's CPU flash op (gloo); no {device_type} op is wired"
    if not _order(sharding):
        return (f"layout {sharding.layout!r} holds the tokens in neither of PyTorch's orders (chunk r, or chunks r and "
                f"2P-1-r); use --layout contiguous or zigzag")  # fmt: skip
    return ""


class TorchRingFunc(torch.autograd.Function):
    """PyTorch's ring forward and backward as one autograd node: `_templated_ring_attention` (keys and values
    all-gathered or passed on by all-to-all) / `_templated_ring_attention_backward` (keys and values the same way,
    dK and dV passed on by all-to-all), both under `settings`."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                causal: bool, settings: RingOptions) -> torch.Tensor:  # fmt: skip
        """PyTorch's ring forward over `group`; keeps what its backward takes (q, k, v, out, lse)."""
        # (1, Hq, T / P, D) x (1, Hkv, T / P, D) x (1, Hkv, T / P, Dv) -> (1, Hq, T / P, Dv), and lse (1, Hq, T / P)
        with settings.applied():
            out, lse = pytorch_cp._templated_ring_attention(group, SEQ_DIM, FLASH_CPU, q, k, v, is_causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.settings = group, causal, settings
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """PyTorch's ring backward: `dout (1, Hq, T/P, Dv)` -> `dq, dk, dv`, each its input's shape and dtype."""
        q, k, v, out, lse = ctx.saved_tensors
        with ctx.settings.applied():
            dq, dk, dv = pytorch_cp._templated_ring_attention_backward(
                ctx.group, SEQ_DIM, FLASH_CPU_BACKWARD, grad_out=dout.contiguous(), grad_out_name="grad_out",
                query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=ctx.causal, dropout_p=0.0)
        return dq, dk, dv, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sharding: cpref.Sharding, *, process_group: Any,
              mode: str = "p2p", causal: bool = True, window: tuple[int, int] = (-1, -1), mask: Any = None,
              **options: Any) -> torch.Tensor:  # fmt: skip
    """PyTorch's ring attention on this rank's shard: `(T/P, Hq, D)`, `(T/P, Hkv, D)`, `(T/P, Hkv, Dv)` -> `(T/P, Hq, Dv)`.

    Args:
        q: this rank's shard of one document's queries, in PyTorch's order (contiguous, or zigzag: head-tail).
        k: its keys, in the same order.
        v: its values, in the same order.
        sharding: the batch's `cpref.Sharding`: one document, no padding, this group's CP size.
        process_group: the CP group (None: the world).
        mode: the verifier's label, ignored.
        causal: causal, or full attention.
        window: must be none, `(-1, -1)`.
        mask: must be None.
        **options: `convert_to_f32`, `rotate` (`RingOptions`); the verifier's mode options are ignored.

    Raises:
        NotImplementedError: the case is one the ring cannot run (`unsupported`), before any communication.
        ValueError: an unknown option or value, or a group that is not the sharding's size.
    """
    # 1) everything every rank shares, checked before any communication
    settings = ring_options(options)
    why = unsupported(sharding, q.dtype, q.device.type, causal=causal, window=window, mask=mask, **options)
    if why:
        raise NotImplementedError(why)
    group = dist.group.WORLD if process_group is None else process_group
    if dist.get_world_size(group) != sharding.cp_size:
        raise ValueError(f"the process group has {dist.get_world_size(group)} ranks, the sharding {sharding.cp_size}")
    head_tail = causal and sharding.cp_size > 1 and _order(sharding) == "head-tail"  # full attention needs no order
    settings = RingOptions(settings.convert_to_f32, settings.rotate, load_balance=head_tail)
    # 2) PyTorch's ring, on SDPA's layout
    sdpa = lambda x: x.transpose(0, 1).unsqueeze(0).contiguous()  # noqa: E731  (T/P, H, X) -> (1, H, T/P, X)
    out = TorchRingFunc.apply(sdpa(q), sdpa(k), sdpa(v), group, causal, settings)  # (1, Hq, T/P, Dv)
    return out[0].transpose(0, 1)  # (T/P, Hq, Dv)
