"""A CPU test double of `torch.ops.aten._flash_attention_forward` and `_flash_attention_backward`, varlen form only.

Written from the ops' schemas in this torch and FlashAttention-2's documented semantics (its
README and `flash_attn_varlen_func`: bottom-right causal alignment since 2.1, the sliding
window from the same corner, `softmax_lse` of shape `(H, total_q)`; PyTorch's
`torch.nn.attention.varlen` for the argument forms), never from cpref's adapter, so that a
contract test can check how `CudaKernel` builds its arguments and reads the results. It proves
nothing about the CUDA kernel itself: numerics and speed are `bench/gpu_check.sh`'s job.

What it enforces, raising `ValueError` on anything the real op rejects or that the adapter must
not rely on:

* 3-D `query (T, Hq, D)`, `key (T', Hkv, D)`, `value (T', Hkv, D)`: one dtype, float16 or
  bfloat16 (float64 is an extension of the double, so index arithmetic can be checked at
  1e-10), the same head dim `D` for all three (flash has one), a multiple of 8 up to 256,
  `Hq % Hkv == 0`, the last dim contiguous;
* `cum_seq_q`, `cum_seq_k`: 1-D int32 tensors on the query's device, of equal length, starting
  at 0, non-decreasing, ending at `T` and `T'`; `max_q`, `max_k` ints at least the longest
  sequence's lengths (the op sizes its grid with them);
* `dropout_p == 0`, `return_debug_mask=False`, no `seqused_k`, `alibi_slopes`, `block_table`
  (`NotImplementedError`: not modelled);
* `scale` a float: passed explicitly (stricter than the op, whose default is `D^-1/2`);
* `window_size_left` / `window_size_right`: ints >= -1 or None (-1 and None: unbounded); with
  `is_causal=True` the right side is 0, whatever is passed.

Semantics: query `i` of a sequence with `sq` queries and `sk` keys stands at `c = i + sk - sq`
(the bottom-right corner) and sees key `j` iff `c - left <= j <= c + right` (`right = 0` under
causal). A row that sees no key gets `out = 0` and `lse = +inf` (FlashAttention's value for a
row whose softmax sum is 0), except in a sequence without keys, where the documentation is
silent and the double returns NaN (`out`, `lse`, and `dq` in the backward), so an adapter that
relies on those values fails. The backward recomputes `P = exp(S - logsumexp)` from the
`logsumexp` it is given and `Delta = rowsum(dO * O)` from the `out` it is given. Stricter than
the op, to hold the adapter to its own rule: `logsumexp` must be finite (the op would turn a
`-inf` into NaN, `exp(-inf + inf)`), `(Hq, T)`, float32 (float64 for float64), contiguous;
`grad_out` and `out` shaped like `query`, in its dtype.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float64)
MAX_D = 256


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"flash double: {message}")


class FlashOpsDouble:
    """The two ops, on any device, in float64 math; `calls` records what each call was given."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def _flash_attention_forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                 seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):  # fmt: skip
        if seqused_k is not None or alibi_slopes is not None or block_table is not None:
            raise NotImplementedError("flash double: seqused_k, alibi_slopes, block_table are not modelled")
        _require(not return_debug_mask, "return_debug_mask must be False")
        band = self._check("forward", query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           scale, window_size_left, window_size_right)  # fmt: skip
        out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
        lse = torch.full(query.shape[:2], float("inf"), dtype=torch.float64, device=query.device)  # (T, Hq)
        for rows, keys, seen in self._sequences(cum_seq_q, cum_seq_k, band, query.device):
            s = self._scores(query[rows], key[keys], scale, seen)  # (Hq, sq, sk)
            m = torch.logsumexp(s, -1)  # (Hq, sq), -inf where nothing is seen
            p = torch.exp(s - m[..., None]).nan_to_num(0.0)  # rows that see nothing: 0
            out[rows] = torch.einsum("hqk,khd->qhd", p, _per_query_head(value[keys], query.shape[1]))
            lse[rows] = torch.where(seen.any(-1), m, torch.full_like(m, float("inf"))).transpose(0, 1)
            if keys.stop == keys.start:  # a sequence without keys: undocumented, so NaN (the adapter must not rely on it)
                out[rows], lse[rows] = float("nan"), float("nan")
        stats = lse.transpose(0, 1).contiguous().to(_stat_dtype(query.dtype))  # (Hq, T)
        rng, empty = torch.zeros(2, dtype=torch.uint64, device=query.device), torch.empty(0, device=query.device)
        return out.to(query.dtype), stats, rng, empty, empty

    def _flash_attention_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                  max_k, dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                                  window_size_right=None):  # fmt: skip
        band = self._check("backward", query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           scale, window_size_left, window_size_right)  # fmt: skip
        for name, x in (("grad_out", grad_out), ("out", out)):
            _require(x.shape == query.shape and x.dtype == query.dtype and x.stride(-1) == 1,
                     f"{name} must be shaped like query {tuple(query.shape)} in {query.dtype}, got {tuple(x.shape)} {x.dtype}")
        _require(logsumexp.shape == (query.shape[1], query.shape[0]) and logsumexp.dtype == _stat_dtype(query.dtype)
                 and logsumexp.is_contiguous(),
                 f"logsumexp must be contiguous (Hq, T) = {(query.shape[1], query.shape[0])} in {_stat_dtype(query.dtype)}, "
                 f"got {tuple(logsumexp.shape)} {logsumexp.dtype}")  # fmt: skip
        _require(bool(torch.isfinite(logsumexp).all()), "logsumexp must be finite (-inf would give exp(-inf + inf) = NaN)")
        _require(isinstance(rng_state, torch.Tensor) and isinstance(unused, torch.Tensor), "rng_state, unused must be tensors")
        g = query.shape[1] // key.shape[1]
        dq = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
        dk = torch.zeros(key.shape, dtype=torch.float64, device=query.device)
        dv = torch.zeros(value.shape, dtype=torch.float64, device=query.device)
        for rows, keys, seen in self._sequences(cum_seq_q, cum_seq_k, band, query.device):
            s = self._scores(query[rows], key[keys], scale, seen)  # (Hq, sq, sk)
            p = torch.exp(s - logsumexp[:, rows].double()[..., None])  # masked: exp(-inf - lse) = 0
            do, o = grad_out[rows].double(), out[rows].double()  # (sq, Hq, D)
            delta = (do * o).sum(-1).transpose(0, 1)  # (Hq, sq)
            dp = torch.einsum("qhd,khd->hqk", do, _per_query_head(value[keys], query.shape[1]))
            ds = p * (dp - delta[..., None])  # (Hq, sq, sk)
            dq[rows] = scale * torch.einsum("hqk,khd->qhd", ds, _per_query_head(key[keys], query.shape[1]))
            dk_h = scale * torch.einsum("hqk,qhd->khd", ds, query[rows].double())  # (sk, Hq, D)
            dv_h = torch.einsum("hqk,qhd->khd", p, do)
            if keys.stop == keys.start:
                dq[rows] = float("nan")  # undocumented, as in the forward
                continue
            d = key.shape[-1]
            dk[keys] = dk_h.reshape(dk_h.shape[0], key.shape[1], g, d).sum(2)  # the G query heads of a key head
            dv[keys] = dv_h.reshape(dv_h.shape[0], key.shape[1], g, d).sum(2)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)

    def _check(self, op, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale, left, right):
        """Validate the shared arguments; record the call; return the band `(left, right)` (-1: unbounded)."""
        if dropout_p != 0.0:
            raise NotImplementedError("flash double: dropout is not modelled")
        _require(all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in (query, key, value)),
                 "query, key, value must be 3-D (total, heads, head dim): the varlen form")  # fmt: skip
        _require(query.dtype == key.dtype == value.dtype and query.dtype in DTYPES,
                 f"one dtype of {DTYPES}, got {query.dtype}, {key.dtype}, {value.dtype}")
        d = query.shape[-1]
        _require(key.shape[-1] == value.shape[-1] == d, f"one head dim for q, k, v, got {d}, {key.shape[-1]}, {value.shape[-1]}")
        _require(d % 8 == 0 and d <= MAX_D, f"head dim {d} must be a multiple of 8 up to {MAX_D}")
        _require(query.shape[1] % key.shape[1] == 0 and key.shape[:2] == value.shape[:2], "heads: Hkv must divide Hq")
        _require(all(x.stride(-1) == 1 for x in (query, key, value)), "the last dim must be contiguous")
        for name, cu, total in (("cum_seq_q", cum_seq_q, query.shape[0]), ("cum_seq_k", cum_seq_k, key.shape[0])):
            _require(isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.dtype == torch.int32 and cu.device == query.device,
                     f"{name} must be a 1-D int32 tensor on {query.device}")  # fmt: skip
            values = cu.tolist()
            _require(values[0] == 0 and values[-1] == total and all(b >= a for a, b in zip(values, values[1:])),
                     f"{name} = {values} must rise from 0 to {total}")
        _require(len(cum_seq_q) == len(cum_seq_k), "cum_seq_q and cum_seq_k must have one entry per sequence, plus one")
        for name, cu, given in (("max_q", cum_seq_q, max_q), ("max_k", cum_seq_k, max_k)):
            longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
            _require(isinstance(given, int) and given >= longest, f"{name} = {given!r} must be an int >= {longest}")
        _require(isinstance(scale, float), f"scale must be passed as a float, got {scale!r}")
        for name, side in (("window_size_left", left), ("window_size_right", right)):
            _require(side is None or (isinstance(side, int) and side >= -1), f"{name} = {side!r} must be an int >= -1")
        band = (-1 if left is None else left, 0 if is_causal else (-1 if right is None else right))
        self.calls.append({"op": op, "causal": bool(is_causal), "band": band, "scale": scale, "max": (max_q, max_k),
                           "sequences": len(cum_seq_q) - 1})  # fmt: skip
        return band

    @staticmethod
    def _sequences(cum_seq_q, cum_seq_k, band, device):
        """Per sequence: `(rows, keys, seen)`, `seen (sq, sk)` True where query i sees key j."""
        left, right = band
        for (a, b), (c, e) in zip(zip(cum_seq_q.tolist(), cum_seq_q.tolist()[1:]), zip(cum_seq_k.tolist(), cum_seq_k.tolist()[1:])):
            sq, sk = b - a, e - c
            corner = torch.arange(sq, device=device)[:, None] + (sk - sq)  # (sq, 1): where query i stands
            j = torch.arange(sk, device=device)[None, :]
            seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
            if left >= 0:
                seen &= j >= corner - left
            if right >= 0:
                seen &= j <= corner + right
            yield slice(a, b), slice(c, e), seen

    @staticmethod
    def _scores(q, k, scale, seen):
        """Masked scaled logits `(Hq, sq, sk)` in float64 (`-inf` where not seen)."""
        s = scale * torch.einsum("qhd,khd->hqk", q.double(), _per_query_head(k, q.shape[1]).double())
        return s.masked_fill(~seen, float("-inf"))


def _per_query_head(x: torch.Tensor, hq: int) -> torch.Tensor:
    """Key/value heads repeated for their query heads: `(sk, Hkv, D) -> (sk, Hq, D)`, float64."""
    return x.double().repeat_interleave(hq // x.shape[1], dim=1)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
