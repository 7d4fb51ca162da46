"""A CPU test double of `torch_npu.npu_fusion_attention` and `npu_fusion_attention_grad`, TND only.

Written from the documented semantics (`shared/notes/npu-fusion-attention.md`: the torch_npu /
CANN docs and MindSpeed's use of the op), never from cpref's adapter, so that a contract test
can check how `NpuKernel` builds its arguments and reads the results. It proves nothing about
the NPU kernel itself: numerics, speed and undocumented behaviour are `make test-npu`'s job.

What it enforces, raising `ValueError` (or `TypeError` for a wrong keyword, from the Python
signature, which mirrors the documented one) on anything the real op would reject:

* `input_layout="TND"`: q `(T, Nq, D)`, k `(T', Nkv, D)`, v `(T', Nkv, Dv)`, one float dtype
  (fp16/bf16/fp32; float64 is an extension of the double, so index arithmetic can be checked
  at 1e-10), `Dq == Dk >= Dv`, `1 <= D <= 768`;
* `head_num` is an int equal to q's heads and a multiple of k's heads;
* `actual_seq_qlen` / `actual_seq_kvlen` are host Python lists of ints, cumulative (without a
  leading 0, which it cannot tell from a first empty sequence), of equal length, at most 2048,
  ending at `T` and `T'`;
* `atten_mask=None` means full attention whatever `sparse_mode` says; with a mask only
  `sparse_mode=3` and `sparse_mode=4` are modelled, and both need the compressed 2048 x 2048
  bool mask `triu(ones, 1)` on q's device;
* `sparse_mode=3` (bottom-right causal: query `i` sees key `j` iff `j <= i + Skv - Sq`) needs
  `q_len <= kv_len` for every sequence that has keys (a sequence with `kv_len = 0` is a
  zero-length sequence, which the documentation allows); `pre_tockens` / `next_tockens` are
  ignored, as documented;
* `sparse_mode=4` (band, bottom-right: query `i` sees key `j` iff
  `c - pre_tockens <= j <= c + next_tockens` with `c = i + Skv - Sq`, the same band for every
  sequence of the call) takes `pre_tockens` / `next_tockens` as host ints; a negative one is
  documented only under further conditions and is not modelled (`NotImplementedError`);
* the forward takes `scale`, the grad `scale_value` (the other name is a `TypeError`);
* features the double does not model (pse, dropout, prefix, other masked modes, negative
  tokens) raise `NotImplementedError` instead of computing something else.

Stricter than documented, to hold the adapter to its own rules: the grad op rejects a
`softmax_max` that is not finite (the real op would turn it into inf/NaN) or whose 8 copies
differ. Where the documentation is silent (rows that see no key: a sequence without keys, or
a row outside its band) the double returns NaN, so an adapter that relies on those values
fails: NaN in such a row's `out`, stats and `dq`, and in the `dk` / `dv` of a sequence that has
one.

Outputs follow the documentation: `(out, softmax_max, softmax_sum, softmax_out, seed, offset,
numels)` with max/sum float32 (float64 for float64 inputs), each value repeated 8 times, stored
per sequence head-major (sequence b a block `(Nq, S_b, 8)`, blocks one after another) unless
`softmax_layout="TND"`; the grad op returns `(dq, dk, dv, dpse)` and recomputes the
probabilities as `exp(S - softmax_max) / softmax_sum` from the stats it is given.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# The double's own value checks read tensors on the host. They use the methods captured here,
# so a test that patches `torch.Tensor` to count the *adapter's* host syncs does not count them.
_raw_item = torch.Tensor.item

MAX_SEQS = 2048
MAX_D = 768
MAX_TOKENS = 2147483647  # the default pre_tockens / next_tockens: unbounded
SPARSE_MODES_TND = (0, 1, 2, 3, 4, 6, 7, 8)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"npu_fusion_attention double: {message}")


def _values_readable(t: torch.Tensor) -> bool:
    return t.device.type != "meta"  # meta tensors (shape-only runs) have no values to check


class NpuOpsDouble:
    """The two ops as methods; `calls` records every call's host arguments, in order."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                             actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                             softmax_layout=""):  # fmt: skip
        pairs, band = self._check(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask,
                                  scale, keep_prob, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                                  pre_tockens, next_tockens, softmax_layout)  # fmt: skip
        self._record("forward", atten_mask, scale, head_num, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                     pre_tockens, next_tockens, softmax_layout)  # fmt: skip
        sdt = torch.float64 if query.dtype == torch.float64 else torch.float32
        t, nq = query.shape[:2]
        out = torch.full((t, nq, value.shape[2]), float("nan"), dtype=torch.float64, device=query.device)
        m = torch.full((t, nq), float("nan"), dtype=torch.float64, device=query.device)  # (T, Nq)
        el = torch.full((t, nq), float("nan"), dtype=torch.float64, device=query.device)  # (T, Nq)
        for q0, q1, k0, k1 in pairs:
            if q1 == q0 or k1 == k0:
                continue  # no query, or rows that see no key: left NaN (undocumented)
            s, vk, empty = self._scores(query, key, value, q0, q1, k0, k1, scale, band)  # (Nq, Sq, Skv), .., (Sq,)
            mb = s.amax(-1)  # (Nq, Sq)
            p = torch.exp(s - mb.unsqueeze(-1))  # (Nq, Sq, Skv)
            lb = p.sum(-1)  # (Nq, Sq)
            out[q0:q1] = torch.einsum("hij,jhd->ihd", p / lb.unsqueeze(-1), vk)  # (Sq, Nq, Dv)
            m[q0:q1], el[q0:q1] = mb.T, lb.T  # (Sq, Nq)
            for x in (out, m, el):  # rows outside their band: undocumented
                x[q0:q1].masked_fill_(empty.view(-1, *[1] * (x.dim() - 1)), float("nan"))
        smax, ssum = (_to_storage(x, pairs, softmax_layout).to(sdt) for x in (m, el))
        return out.to(query.dtype), smax, ssum, torch.empty(0, device=query.device), 0, 0, 0

    def npu_fusion_attention_grad(self, query, key, value, dy, head_num, input_layout, *, pse=None,
                                  padding_mask=None, atten_mask=None, softmax_max=None, softmax_sum=None,
                                  softmax_in=None, attention_in=None, scale_value=1.0, keep_prob=1.0,
                                  pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0, seed=0,
                                  offset=0, numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                  sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout=""):  # fmt: skip
        pairs, band = self._check(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask,
                                  scale_value, keep_prob, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                                  pre_tockens, next_tockens, softmax_layout)  # fmt: skip
        self._record("backward", atten_mask, scale_value, head_num, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                     pre_tockens, next_tockens, softmax_layout)  # fmt: skip
        t, nq, dv_dim = query.shape[0], query.shape[1], value.shape[2]
        sdt = torch.float64 if query.dtype == torch.float64 else torch.float32
        for name, x in (("dy", dy), ("attention_in", attention_in)):
            _require(isinstance(x, torch.Tensor) and tuple(x.shape) == (t, nq, dv_dim) and x.dtype == query.dtype,
                     f"{name} must be a {query.dtype} tensor of shape {(t, nq, dv_dim)}")  # fmt: skip
        for name, x in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            _require(isinstance(x, torch.Tensor) and tuple(x.shape) == (t, nq, 8) and x.dtype == sdt,
                     f"{name} must be a {sdt} tensor of shape {(t, nq, 8)}")  # fmt: skip
            if _values_readable(x):
                _require(_raw_item(torch.isfinite(x).all()), f"{name} must be finite (exp(S - max) would be inf/NaN)")
                _require(torch.equal(x, x[..., :1].expand_as(x)), f"{name} must repeat each value 8 times")
        _require(softmax_in is None or softmax_in.numel() == 0, "softmax_in is reserved")
        m, el = (_from_storage(x[..., 0].double(), pairs, softmax_layout) for x in (softmax_max, softmax_sum))  # (T, Nq)
        dout, o = dy.double(), attention_in.double()
        delta = (dout * o).sum(-1)  # (T, Nq) Delta = rowsum(dO o O)
        g = nq // key.shape[1]
        dq = torch.full(query.shape, float("nan"), dtype=torch.float64, device=query.device)
        dk = torch.zeros((key.shape[0], nq, key.shape[2]), dtype=torch.float64, device=query.device)
        dv = torch.zeros((key.shape[0], nq, dv_dim), dtype=torch.float64, device=query.device)
        for q0, q1, k0, k1 in pairs:
            if q1 == q0 or k1 == k0:
                continue  # rows that see no key: dq left NaN (undocumented)
            s, vk, empty = self._scores(query, key, value, q0, q1, k0, k1, scale_value, band)  # (Nq, Sq, Skv), .., (Sq,)
            p = torch.exp(s - m[q0:q1].T.unsqueeze(-1)) / el[q0:q1].T.unsqueeze(-1)  # (Nq, Sq, Skv)
            dv[k0:k1] = torch.einsum("hij,ihd->jhd", p, dout[q0:q1])  # dV = P^T dO
            dp = torch.einsum("ihd,jhd->hij", dout[q0:q1], vk)  # dP = dO V^T
            ds = p * (dp - delta[q0:q1].T.unsqueeze(-1))  # dS = P o (dP - Delta)
            kq = key[k0:k1].double().repeat_interleave(g, dim=1)  # (Skv, Nq, D)
            dq[q0:q1] = scale_value * torch.einsum("hij,jhd->ihd", ds, kq)  # dQ = s dS K
            dk[k0:k1] = scale_value * torch.einsum("hij,ihd->jhd", ds, query[q0:q1].double())  # dK = s dS^T Q
            if _values_readable(empty) and _raw_item(empty.any()):  # a row outside its band: undocumented, for its
                dq[q0:q1].masked_fill_(empty.view(-1, 1, 1), float("nan"))  # dq and for the sequence's dk, dv
                dk[k0:k1], dv[k0:k1] = float("nan"), float("nan")
        hkv = key.shape[1]
        dk = dk.view(key.shape[0], hkv, g, -1).sum(2)  # (T', Nq, D) -> (T', Nkv, D): sum over a group
        dv = dv.view(key.shape[0], hkv, g, -1).sum(2)  # (T', Nkv, Dv)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), torch.empty(0, device=query.device)

    @staticmethod
    def _scores(query, key, value, q0, q1, k0, k1, scale, band):
        """Masked float64 scores `(Nq, Sq, Skv)` of one sequence, its values per query head, and its rows that
        see no key `(Sq,)`; `band` is `(pre, next)` from the bottom-right corner, None: no mask."""
        g = query.shape[1] // key.shape[1]
        kq = key[k0:k1].double().repeat_interleave(g, dim=1)  # (Skv, Nq, D)
        vq = value[k0:k1].double().repeat_interleave(g, dim=1)  # (Skv, Nq, Dv)
        s = scale * torch.einsum("ihd,jhd->hij", query[q0:q1].double(), kq)  # (Nq, Sq, Skv)
        hidden = torch.zeros(q1 - q0, k1 - k0, dtype=torch.bool, device=query.device)  # (Sq, Skv)
        if band is not None:  # bottom-right: query i sees key j iff c - pre <= j <= c + next, c = i + Skv - Sq
            pre, nxt = band
            i = torch.arange(q1 - q0, device=query.device).unsqueeze(1)  # (Sq, 1)
            j = torch.arange(k1 - k0, device=query.device).unsqueeze(0)  # (1, Skv)
            c = i + (k1 - k0) - (q1 - q0)  # (Sq, 1)
            hidden = (j < c - pre) | (j > c + nxt)  # (Sq, Skv)
            s = s.masked_fill(hidden, float("-inf"))  # (Nq, Sq, Skv)
        return s, vq, hidden.all(-1)

    def _record(self, op, atten_mask, scale, head_num, seq_q, seq_kv, sparse_mode, pre, nxt, softmax_layout) -> None:
        self.calls.append(dict(op=op, atten_mask=atten_mask, scale=scale, head_num=head_num, actual_seq_qlen=list(seq_q),
                               actual_seq_kvlen=list(seq_kv), sparse_mode=sparse_mode, pre_tockens=pre,
                               next_tockens=nxt, softmax_layout=softmax_layout))  # fmt: skip

    @staticmethod
    def _check(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob, prefix,
               seq_q, seq_kv, sparse_mode, pre, nxt, softmax_layout):  # fmt: skip
        """Validate as documented; return each sequence's `(q0, q1, k0, k1)` and the band that masks them all
        (`(pre, next)` from each sequence's bottom-right corner; None: no mask)."""
        _require(input_layout == "TND", f"input_layout={input_layout!r}: the double models TND only")
        tensors = (query, key, value)
        _require(all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in tensors), "TND needs 3-d q, k, v")
        _require(query.dtype == key.dtype == value.dtype and query.dtype in DTYPES, f"dtypes {[x.dtype for x in tensors]}")
        _require(query.device == key.device == value.device, "q, k, v on different devices")
        (t, nq, d), (tk, nkv, dk), (tv, nv, dv) = query.shape, key.shape, value.shape
        _require(type(head_num) is int and head_num == nq, f"head_num={head_num!r} must be q's heads {nq}")
        _require(nkv >= 1 and nv == nkv and nq % nkv == 0 and tk == tv, f"heads {nq}/{nkv}/{nv}, tokens {tk}/{tv}")
        _require(d == dk and 1 <= dv <= dk and 1 <= d <= MAX_D, f"head dims q {d}, k {dk}, v {dv} (need Dq == Dk >= Dv, D <= 768)")
        for name, x in (("pse", pse), ("padding_mask", padding_mask), ("prefix", prefix)):
            if x is not None:
                raise NotImplementedError(f"npu_fusion_attention double: {name} is not modelled")
        if keep_prob != 1.0:
            raise NotImplementedError("npu_fusion_attention double: dropout (keep_prob < 1) is not modelled")
        _require(type(scale) in (float, int), f"scale must be a host float, got {type(scale).__name__}")
        _require(softmax_layout in ("", "TND"), f"softmax_layout={softmax_layout!r}")
        for name, cu, total in (("actual_seq_qlen", seq_q, t), ("actual_seq_kvlen", seq_kv, tk)):
            _require(type(cu) is list and all(type(x) is int for x in cu), f"{name} must be a host list of ints, got {cu!r:.80}")
            _require(1 <= len(cu) <= MAX_SEQS, f"{name} has {len(cu)} entries (1..{MAX_SEQS})")
            _require(cu[0] >= 0 and all(b >= a for a, b in zip(cu, cu[1:])), f"{name}={cu[:8]}... must be cumulative")
            _require(cu[-1] == total, f"{name} ends at {cu[-1]}, but the tensor has {total} tokens")
        _require(len(seq_q) == len(seq_kv), f"{len(seq_q)} q lengths but {len(seq_kv)} kv lengths")
        _require(type(sparse_mode) is int and sparse_mode in SPARSE_MODES_TND, f"sparse_mode={sparse_mode!r} for TND")
        pairs = list(zip([0, *seq_q[:-1]], seq_q, [0, *seq_kv[:-1]], seq_kv))
        _require(all(type(x) is int and -MAX_TOKENS <= x <= MAX_TOKENS for x in (pre, nxt)),
                 f"pre_tockens={pre!r}, next_tockens={nxt!r} must be host ints (int32)")  # fmt: skip
        if atten_mask is None:
            return pairs, None  # no mask: full attention, sparse_mode and tokens ignored
        if sparse_mode not in (3, 4):
            raise NotImplementedError(f"npu_fusion_attention double: sparse_mode={sparse_mode} with a mask is not modelled")
        _require(isinstance(atten_mask, torch.Tensor) and atten_mask.dtype == torch.bool
                 and tuple(atten_mask.shape) == (2048, 2048) and atten_mask.device == query.device,
                 f"sparse_mode={sparse_mode} needs the compressed (2048, 2048) bool mask on q's device")  # fmt: skip
        if _values_readable(atten_mask):
            _require(torch.equal(atten_mask, _compressed_mask(atten_mask.device)), "the mask must be triu(ones(2048, 2048), 1)")
        if sparse_mode == 4:  # band, bottom-right: the same pre / next tokens for every sequence
            if pre < 0 or nxt < 0:
                raise NotImplementedError(f"npu_fusion_attention double: sparse_mode=4 with pre_tockens={pre}, "
                                          f"next_tockens={nxt}: a negative side is not modelled")  # fmt: skip
            return pairs, (pre, nxt)
        for q0, q1, k0, k1 in pairs:  # a kv_len = 0 sequence is a zero-length sequence: allowed
            _require(q1 - q0 <= k1 - k0 or k1 == k0, f"sparse_mode=3 needs q_len <= kv_len, got {q1 - q0} > {k1 - k0}")
        return pairs, (MAX_TOKENS, 0)  # bottom-right causal: tokens ignored


@functools.lru_cache(maxsize=None)
def _compressed_mask(device: torch.device) -> torch.Tensor:
    """The documented compressed causal mask, to compare the adapter's with (built once per device)."""
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)  # (2048, 2048)


def _to_storage(x: torch.Tensor, pairs, softmax_layout: str) -> torch.Tensor:
    """Token-major `(T, Nq)` stats as the op returns them: `(T, Nq, 8)`, per sequence head-major by default."""
    t, nq = x.shape
    if softmax_layout == "TND":
        return x.unsqueeze(-1).expand(t, nq, 8).contiguous()  # (T, Nq, 8)
    blocks = [x[q0:q1].T.reshape(-1) for q0, q1, _, _ in pairs]  # sequence b: (S_b, Nq) -> (Nq, S_b) -> (Nq*S_b,)
    flat = torch.cat(blocks) if blocks else x.reshape(-1)  # (T*Nq,) blocks one after another
    return flat.view(t, nq, 1).expand(t, nq, 8).contiguous()  # (T, Nq, 8)


def _from_storage(x: torch.Tensor, pairs, softmax_layout: str) -> torch.Tensor:
    """The inverse of `_to_storage` for `x (T, Nq)` read from `[..., 0]`: token-major `(T, Nq)`."""
    if softmax_layout == "TND":
        return x
    t, nq = x.shape
    flat, out = x.reshape(-1), torch.empty_like(x)  # (T*Nq,), (T, Nq)
    for q0, q1, _, _ in pairs:
        out[q0:q1] = flat[q0 * nq : q1 * nq].view(nq, q1 - q0).T  # (Nq, S_b) -> (S_b, Nq)
    return out
