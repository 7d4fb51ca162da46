"""Every kind of bad input gets a clear error: the right type, a message naming the value and the
fix, raised before any of the mode's communication and alike on every rank (run() re-raises it
unchanged only when every rank raised the same message).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from cpref.batch.balanced import balanced_pieces
from cpref.batch.seqlens import Boundaries
from cpref.kernels import TorchKernel, Varlen
from examples import stream_ulysses
from sim import SimCluster
from sim.cluster.simcluster import SimComm
from tests.helpers import only_the_comparison, random_qkv

P = 2
CU = torch.tensor([0, 8, 32])
SHARDING = cpref.Sharding(CU, cp_size=P)  # zigzag
Q, K, V = random_qkv(32, 4, 2, 8)
BATCH = ("cu_seqlens", "cu_seqlens_padded", "layout")  # where they enter now: the Sharding each rank builds


def attention_call(**change):
    """Run `cpref.attention` on 2 simulated ranks with the valid base call changed by `change`: the
    tensors are always `SHARDING`'s shards; `cu_seqlens`, `cu_seqlens_padded` and `layout` change the
    Sharding every rank builds for the call, `sharding` replaces it, anything else is an argument."""
    batch = {name: change.pop(name) for name in BATCH if name in change}
    sharding = change.pop("sharding", SHARDING)
    tensors = change.pop("tensors", None)
    kwargs = {"mode": "all_gather", **change}

    def rank_fn(comm):
        local = [SHARDING.shard(t, comm.rank) for t in (Q, K, V)]
        q, k, v = tensors(*local) if tensors else local
        given = cpref.Sharding(**{"cu_seqlens": CU, "cp_size": P, **batch}) if batch else sharding
        return cpref.attention(q, k, v, given, **{"comm": comm, **kwargs})

    cluster = SimCluster(P, timeout=30.0)
    try:
        cluster.run(rank_fn)
    finally:
        # an error comes before any of the mode's communication: at most the ranks' comparison, in
        # which a rank that failed tells the others (cpref.modes.consistency), ran
        assert only_the_comparison(cluster.trace), cluster.trace


def FP32(q, k, v):
    return q.float(), k.float(), v.float()


def BF16(q, k, v):
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def attn(**change):
    return lambda: attention_call(**change)


def twelve_and_three_heads(q, k, v):
    """The local shards with Hq = 12 (q's 4 heads thrice) and Hkv = 3 (k's and v's 2 heads and the first again)."""
    return q.repeat(1, 3, 1), torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)


def comm_is(value):
    return attn(comm=value)


ATTENTION_CASES = [
    # boundaries (and below, the layout): they enter at cpref.Sharding(...), which every rank builds before the call
    ("cu None", attn(cu_seqlens=None), r"cu_seqlens is NoneType None; pass document boundaries like \[0, 8, 20\]"),
    ("cu with None", attn(cu_seqlens=[0, None, 32]), r"cu_seqlens\[1\] is None \(NoneType\)"),
    ("cu nested", attn(cu_seqlens=[[0, 8], [8, 32]]), r"cu_seqlens\[0\] is \[0, 8\] \(list\)"),
    ("cu string", attn(cu_seqlens="0,8,32"), r"cu_seqlens is str '0,8,32'"),
    ("cu NaN", attn(cu_seqlens=[0, math.nan, 32]), r"cu_seqlens\[1\] is nan \(float\), not an int"),
    ("cu float", attn(cu_seqlens=[0, 8.0, 32]), r"cu_seqlens\[1\] is 8.0 \(float\), not an int"),
    ("cu complex", attn(cu_seqlens=[0, 8 + 0j, 32]), r"cu_seqlens\[1\] is \(8\+0j\) \(complex\)"),
    ("cu bool entry", attn(cu_seqlens=[0, True, 32]), r"cu_seqlens\[1\] is True \(bool\)"),
    ("cu float tensor", attn(cu_seqlens=CU.double()), r"1-D integer tensor, got shape \(3,\) dtype torch.float64"),
    ("cu complex tensor", attn(cu_seqlens=CU.to(torch.complex64)), r"1-D integer tensor, got .* torch.complex64"),
    ("cu bool tensor", attn(cu_seqlens=CU.bool()), r"1-D integer tensor, got .* torch.bool"),
    ("cu 2-D tensor", attn(cu_seqlens=CU[None]), r"1-D integer tensor, got shape \(1, 3\)"),
    ("cu 0-D tensor", attn(cu_seqlens=torch.tensor(32)), r"1-D integer tensor, got shape \(\) dtype torch.int64"),
    ("cu empty document", attn(cu_seqlens=[0, 8, 8, 32]), r"document 1 spans \[8, 8\), length 0; drop empty documents"),
    ("cu no leading 0", attn(cu_seqlens=[1, 8, 32]), r"must start with 0"),
    ("cu decreasing", attn(cu_seqlens=[0, 32, 16]), r"strictly increasing: document 1 spans \[32, 16\)"),
    ("cu no document", attn(cu_seqlens=[0]), r"at least one document"),
    ("cu not divisible", attn(cu_seqlens=[0, 6, 32]),
     r"document 0 has length 6, not a multiple of 4 .*Sharding\.eod_padded.*cu_seqlens_padded"),
    ("cu other total", attn(cu_seqlens=[0, 8, 40]), r"q/k/v hold 16/16/16 tokens but this rank's shard of 40 tokens"),
    ("padded other count", attn(cu_seqlens_padded=[0, 32]), r"cu_seqlens has 2 documents but cu_seqlens_padded 1"),
    ("padded shorter", attn(cu_seqlens=[0, 12, 32], cu_seqlens_padded=[0, 8, 32]), r"document 0 has 12 real tokens but only 8 padded"),
    ("padded not divisible", attn(cu_seqlens=[0, 5, 26], cu_seqlens_padded=[0, 6, 32]), r"document 0 has length 6, not a multiple of 4"),
    ("padded string", attn(cu_seqlens_padded="x"), r"cu_seqlens_padded is str"),
    # the sharding: a cpref.Sharding, over the communicator's size
    ("sharding a tensor", attn(sharding=CU), r"the batch must be described by a cpref.Sharding, got Tensor .*cp_size=2"),
    ("sharding None", attn(sharding=None), r"the batch must be described by a cpref.Sharding, got NoneType None"),
    ("sharding other cp_size", attn(sharding=cpref.Sharding(CU, cp_size=4)),
     r"the batch is sharded over cp_size=4 .*but the communicator has 2 ranks; .*cpref.Sharding\(\.\.\., cp_size=2\)"),
    # the communicator, the mode and the flags
    ("comm None", comm_is(None), r"comm must be the CP group's collectives .*got NoneType"),
    ("comm string", comm_is("world"), r"comm must be .*got str"),
    ("comm class", comm_is(SimComm), r"comm must be .*got type"),
    ("mode list", attn(mode=["all_gather"]), r"unknown mode \['all_gather'\] \(list\); choose one of"),
    ("mode unknown", attn(mode="nope"), r"unknown mode 'nope' \(str\); choose one of \['a2a', 'a2a\+p2p', 'all_gather', 'p2p'\]"),
    ("mode case", attn(mode="All_Gather"), r"unknown mode 'All_Gather'"),
    ("mode None", attn(mode=None), r"cpref.attention needs mode=, the CP algorithm: one of \['a2a', 'a2a\+p2p', 'all_gather', 'p2p'\]"),
    ("layout unknown", attn(layout="striped"), r"unknown layout 'striped' \(str\); choose one of \['balanced', 'contiguous', 'stream', 'zigzag'\]"),
    ("stream batch not divisible", attn(cu_seqlens=[0, 5, 33], layout="stream"),
     r"the batch has 33 tokens, not a multiple of cp_size=2: .*Sharding\.eod_padded\(cu_seqlens, cp_size=2, layout='stream'\)"),
    ("stream padded not divisible", attn(cu_seqlens=[0, 5, 31], cu_seqlens_padded=[0, 5, 33], layout="stream"),
     r"the batch has 33 tokens, not a multiple of cp_size=2"),
    ("layout None", attn(layout=None), r"unknown layout None"),
    ("causal string", attn(causal="False"), r"causal must be True or False, got 'False' \(str\)"),
    ("causal int", attn(causal=1), r"causal must be True or False, got 1 \(int\)"),
    ("causal None", attn(causal=None), r"causal must be True or False, got None"),
    # the window: (left, right) ints >= -1 (cpref.kernels.contract.check_window), right = 0 or -1 under causal
    ("window int", attn(window=3), r"window=3 is not a pair; pass window=\(left, right\) with ints >= -1 \(-1: unbounded\)"),
    ("window None", attn(window=None), r"window=None is not a pair; pass window=\(left, right\)"),
    ("window triple", attn(window=(3, 0, 0)), r"window=\(3, 0, 0\) is not a pair"),
    ("window string", attn(window="3,0"), r"window='3,0' is not a pair"),
    ("window below -1", attn(window=(-2, 0)), r"window=\(-2, 0\): left=-2 is not an int >= -1; pass window=\(left, right\)"),
    ("window right below -1", attn(causal=False, window=(4, -3)), r"window=\(4, -3\): right=-3 is not an int >= -1"),
    ("window float", attn(window=(3.0, 0)), r"window=\(3.0, 0\): left=3.0 is not an int >= -1"),
    ("window NaN", attn(causal=False, window=(3, math.nan)), r"window=\(3, nan\): right=nan is not an int >= -1"),
    ("window bool", attn(window=(True, 0)), r"window=\(True, 0\): left=True is not an int >= -1"),
    ("window right under causal", attn(window=(3, 2)),
     r"window=\(3, 2\) with causal=True: a causal query sees no later key, so right must be 0 or -1; pass causal=False"),
    ("check_ranks string", attn(check_ranks="no"), r"check_ranks must be True or False, got 'no'"),
    ("save_gathered_kv string", attn(save_gathered_kv="yes"), r"save_gathered_kv must be True or False, got 'yes'"),
    ("a2a_size on all_gather", attn(a2a_size=2), r"a2a_size=2 is only used by mode a2a\+p2p, not mode='all_gather'"),
    ("a2a_size on p2p", attn(mode="p2p", a2a_size=2), r"a2a_size=2 is only used by mode a2a\+p2p, not mode='p2p'"),
    ("save_gathered_kv on a2a", attn(mode="a2a", save_gathered_kv=True), r"save_gathered_kv=True is only used by mode all_gather"),
    ("a2a+p2p without a2a_size", attn(mode="a2a+p2p"), r"mode 'a2a\+p2p' needs a2a_size, the all-to-all group size dividing P = 2"),
    ("a2a_size not dividing P", attn(mode="a2a+p2p", a2a_size=3), r"a2a_size=3 does not divide the CP size P = 2; choose one of \[1, 2\]"),
    ("a2a_size zero", attn(mode="a2a+p2p", a2a_size=0), r"a2a_size=0 is outside \[1, inf\)"),
    ("a2a_size string", attn(mode="a2a+p2p", a2a_size="2"), r"a2a_size must be an int, got '2' \(str\)"),
    ("a2a heads not splittable", attn(mode="a2a", tensors=lambda q, k, v: (q[:, :3], k[:, :1], v[:, :1])),
     r"mode 'a2a' splits heads over 2 ranks \(P = 2\), but Hq = 3, Hkv = 1 cannot be split so.*sizes that work: \[1, 3\]"),
    ("a2a+p2p heads not splittable", attn(mode="a2a+p2p", a2a_size=2, tensors=lambda q, k, v: (q[:, :3], k[:, :1], v[:, :1])),
     r"mode 'a2a\+p2p' with a2a_size=2 splits heads over 2 ranks"),
    # field bug 8: Hq splits over 2 ranks but Hkv = 3 neither splits (3 % 2) nor replicates (2 % 3);
    # the sizes that work divide 12 and are multiples or divisors of 3: 1, 3, 6, 12
    ("a2a kv heads not splittable", attn(mode="a2a", tensors=twelve_and_three_heads),
     r"mode 'a2a' splits heads over 2 ranks \(P = 2\), but Hq = 12, Hkv = 3 cannot be split so: it needs Hq % 2 == 0 "
     r"and Hkv % 2 == 0 or 2 % Hkv == 0; sizes that work: \[1, 3, 6, 12\]$"),
    ("a2a+p2p kv heads not splittable", attn(mode="a2a+p2p", a2a_size=2, tensors=twelve_and_three_heads),
     r"mode 'a2a\+p2p' with a2a_size=2 splits heads over 2 ranks \(P = 2\), but Hq = 12, Hkv = 3 .*sizes that work: \[1, 3, 6, 12\]$"),
    # the scale
    ("scale bool", attn(softmax_scale=True), r"softmax_scale must be None or a positive number, got True \(bool\)"),
    ("scale string", attn(softmax_scale="0.1"), r"softmax_scale must be None or a positive number, got '0.1' \(str\)"),
    ("scale negative", attn(softmax_scale=-1.0), r"positive finite number, got -1.0"),
    ("scale zero", attn(softmax_scale=0), r"positive finite number, got 0.0"),
    ("scale NaN", attn(softmax_scale=math.nan), r"positive finite number, got nan"),
    ("scale inf", attn(softmax_scale=math.inf), r"positive finite number, got inf"),
    ("scale 10**400", attn(softmax_scale=10**400), r"softmax_scale \(an int of 401 digits\) overflows a float"),
    ("scale overflows fp32", attn(softmax_scale=1e39, tensors=FP32), r"softmax_scale=1e\+39 is outside the normal range of torch.float32"),
    ("scale underflows fp32", attn(softmax_scale=1e-40, tensors=FP32), r"softmax_scale=1e-40 is outside the normal range"),
    ("scale overflows bf16 compute", attn(softmax_scale=1e39, tensors=BF16), r"outside the normal range of torch.float32"),
    ("scale tensor", attn(softmax_scale=torch.tensor(0.1)), r"softmax_scale must be None or a positive number, got tensor"),
    # the kernel
    ("kernel object", attn(kernel=object()), r"kernel must be an attention kernel instance .*got an instance of object \(without backward, forward\)"),
    ("kernel class", attn(kernel=TorchKernel), r"kernel must be an attention kernel instance .*got the class TorchKernel \(an instance is needed\)"),
    ("kernel string", attn(kernel="torch"), r"kernel must be an attention kernel instance .*got 'torch'"),
    # the tensors
    ("q list", attn(tensors=lambda q, k, v: (q.tolist(), k, v)), r"q must be a THD tensor \(tokens, heads, dim\), got list"),
    ("q 2-D", attn(tensors=lambda q, k, v: (q[:, 0], k, v)), r"q must be a THD tensor \(tokens, heads, dim\), got \(16, 8\)"),
    ("q BSHD", attn(tensors=lambda q, k, v: (q[None], k, v)), r"q must be a THD tensor .*got \(1, 16, 4, 8\)"),
    ("q integer", attn(tensors=lambda q, k, v: (q.long(), k.long(), v.long())), r"q has dtype torch.int64; use one of"),
    ("dtypes differ", attn(tensors=lambda q, k, v: (q, k, v.float())), r"q, k, v must share dtype and device"),
    ("devices differ", attn(tensors=lambda q, k, v: (q, k, v.to("meta"))), r"must share dtype and device.*on cpu/cpu/meta"),
    ("heads not divisible", attn(tensors=lambda q, k, v: (q[:, :3], k, v)), r"heads: q has 3, k 2, v 2; .*Hq % Hkv == 0"),
    ("Hkv zero", attn(tensors=lambda q, k, v: (q, k[:, :0], v[:, :0])), r"heads: q has 4, k 0, v 0"),
    ("k and v heads differ", attn(tensors=lambda q, k, v: (q, k, v[:, :1])), r"heads: q has 4, k 2, v 1; need k and v alike"),
    ("D zero", attn(tensors=lambda q, k, v: (q[..., :0], k[..., :0], v)), r"head dims: q 0, k 0, v 8"),
    ("Dv zero", attn(tensors=lambda q, k, v: (q, k, v[..., :0])), r"head dims: q 8, k 8, v 0; need Dq == Dk >= Dv >= 1"),
    ("Dv above D", attn(tensors=lambda q, k, v: (q, k, torch.cat([v, v], -1))), r"head dims: q 8, k 8, v 16"),
    ("Dq differs from Dk", attn(tensors=lambda q, k, v: (q[..., :4], k, v[..., :4])), r"head dims: q 4, k 8, v 4"),
    ("k and v tokens differ", attn(tensors=lambda q, k, v: (q, k, v[:-1])), r"k has 16 tokens but v has 15"),
    ("q token short", attn(tensors=lambda q, k, v: (q[:-1], k, v)), r"q/k/v hold 15/16/16 tokens but this rank's shard of 32"),
]

OTHER_CASES = [
    ("metadata cp_size float", lambda: cpref.get_thd_load_balanced_cp_metadata([0, 8], 2.0, 0), r"cp_size must be an int, got 2.0 \(float\); pass 2"),
    ("metadata rank numpy out of range", lambda: cpref.get_thd_load_balanced_cp_metadata([0, 8], 2, np.int64(2)), r"rank=2 is outside \[0, 2\)"),
    ("metadata rank bool", lambda: cpref.get_thd_load_balanced_cp_metadata([0, 8], 2, True), r"rank must be an int, got True \(bool\)"),
    ("metadata cp_size string", lambda: cpref.get_thd_load_balanced_cp_metadata([0, 8], "2", 0), r"cp_size must be an int, got '2' \(str\)"),
    ("metadata device", lambda: cpref.get_thd_load_balanced_cp_metadata([0, 8], 2, 0, "gpu0"), r"device 'gpu0' is not a torch device"),
    ("group not dividing", lambda: cpref.batch.layout.group_chunks([0, 8], cp_size=4, group=3, g=0, layout="stream"),
     r"group=3 does not divide cp_size=4"),
    ("group index out of range", lambda: cpref.batch.layout.group_chunks([0, 8], cp_size=4, group=2, g=2, layout="stream"),
     r"g=2 is outside \[0, 2\)"),
    ("balanced plan of a batch P does not divide", lambda: balanced_pieces(Boundaries.parse([0, 9]), 2),
     r"the batch has 9 tokens, not a multiple of cp_size=2: the balanced layout"),
    ("stream peer on another layout", lambda: stream_ulysses.attention(Q, K, V, SHARDING, process_group=None),
     r"this Ulysses shards the packed batch as one stream; got layout 'zigzag': run it with --layout stream"),
    ("metadata layout stream", lambda: cpref.get_thd_load_balanced_cp_metadata([0, 8], 2, 0, layout="stream"),
     r"layout 'stream': the RFC's metadata indexes per-document chunks.*mode='all_gather'"),
    ("metadata causal string", lambda: cpref.get_thd_load_balanced_cp_metadata([0, 8], 2, 0, causal="yes"), r"causal must be True or False"),
    ("shard length", lambda: cpref.Sharding([0, 8], cp_size=2).shard(torch.zeros(10), 0),
     r"x has shape \(10,\) but the sharded stream has 8 tokens"),
    ("shard real stream of a padded batch", lambda: cpref.Sharding.eod_padded([0, 7], cp_size=2).shard(torch.zeros(7), 0),
     r"x has shape \(7,\) but the sharded stream has 8 tokens: .*; pad it first with sharding.pad\(x\)"),
    ("shard rank float", lambda: cpref.Sharding([0, 8], cp_size=2).shard(torch.zeros(8), 0.5), r"rank must be an int, got 0.5"),
    ("shard not a tensor", lambda: cpref.Sharding([0, 8], cp_size=2).shard([0.0] * 8, 0), r"x has shape list"),
    ("pad multiple zero", lambda: cpref.batch.layout.pad_to_multiple(torch.zeros(8), [0, 8], 0), r"multiple=0 is outside \[1, inf\)"),
    ("eod_padded cp_size zero", lambda: cpref.Sharding.eod_padded([0, 8], cp_size=0), r"cp_size=0 is outside \[1, inf\)"),
    ("batch without labels", lambda: cpref.get_batch_on_this_cp_rank({"tokens": torch.zeros(8)}, [0, 8], cp_size=2, rank=0), r"batch needs 'tokens' and 'labels'"),
    ("kernel block_size zero", lambda: TorchKernel(block_size=0), r"block_size=0 must be a positive int, or None"),
    ("kernel budget float", lambda: TorchKernel(max_block_elements=1.5), r"max_block_elements=1.5 must be a positive int"),
    ("varlen unequal lists", lambda: Varlen([0, 2, 4], [0, 4]), r"cu_q has 3 entries, cu_kv 2"),
    ("varlen decreasing", lambda: Varlen([0, 4, 2]), r"cu_q=\[0, 4, 2\] must start at 0 and never decrease"),
    ("kernel int inputs", lambda: TorchKernel().forward(*(torch.ones(4, 2, 4, dtype=torch.int32),) * 3, Varlen([0, 4]), causal=True, scale=0.5), r"q has dtype torch.int32"),
    ("kernel seqs mismatch", lambda: TorchKernel().forward(Q, K, V, Varlen([0, 30]), causal=True, scale=0.5), r"seqs cover 30 queries and 30 keys, but q has 32 rows"),
    ("kernel plain tensor seqs", lambda: TorchKernel().forward(Q, K, V, CU, causal=True, scale=0.5), r"seqs must be a cpref.kernels.Varlen"),
    ("cp_loss shapes", lambda: SimCluster(2).run(lambda c: cpref.cp_loss(torch.ones(4), torch.ones(4, 1), c)), r"token_loss has shape \(4,\) but loss_mask \(4, 1\)"),
    ("cp_loss list loss", lambda: SimCluster(2).run(lambda c: cpref.cp_loss([1.0, 2.0], torch.ones(2), c)), r"token_loss must be a tensor, got list"),
    ("cp_loss integer loss", lambda: SimCluster(2).run(lambda c: cpref.cp_loss(torch.ones(4, dtype=torch.long), torch.ones(4), c)), r"token_loss has dtype torch.int64; it must be floating"),
    ("cluster timeout inf", lambda: SimCluster(2, timeout=math.inf), r"timeout must be a finite number of seconds > 0, got inf"),
]

CASES = ATTENTION_CASES + OTHER_CASES


def test_the_table_holds_at_least_sixty_kinds():
    assert len({name for name, _, _ in CASES}) == len(CASES) >= 60


@pytest.mark.parametrize("name, call, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_value_error(name, call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert isinstance(info.value, (CPInputError, ValueError))
    if name in dict((n, 1) for n, _, _ in ATTENTION_CASES):
        assert isinstance(info.value, CPInputError), "attention's errors are CPInputError (also AssertionError)"


class _Forwarding:
    """A wrapper that forwards every attribute to the object it wraps (a user's logging proxy, say)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_forwarding_wrappers_conform_on_every_python():
    """`isinstance` against a runtime-checkable protocol looks members up statically from
    Python 3.12 on and would refuse these wrappers there; cpref checks with `hasattr`."""
    from cpref.base.checks import missing_members
    from cpref.comm.protocol import Collectives, SingleRank
    from cpref.kernels import AttentionKernel

    assert missing_members(_Forwarding(SingleRank()), Collectives) == []
    assert missing_members(_Forwarding(TorchKernel()), AttentionKernel) == []
    q = k = v = torch.randn(8, 2, 4)
    sharding = cpref.Sharding(torch.tensor([0, 8]), cp_size=1)
    out = cpref.attention(q, k, v, sharding, comm=_Forwarding(SingleRank()), mode="p2p", kernel=_Forwarding(TorchKernel()))
    assert torch.equal(out, cpref.attention(q, k, v, sharding, comm=SingleRank(), mode="p2p"))


def test_a_comm_missing_members_is_refused_naming_them():
    class HalfComm:
        rank, size, unsupported_ops = 0, 1, frozenset()

        def all_gather(self, x):
            return x

    with pytest.raises(ValueError, match=r"got HalfComm \(without all_gather_async, all_reduce, all_to_all, all_to_all_async, barrier, reduce_scatter, reduce_scatter_async, send_recv, send_recv_async, split\)"):
        cpref.attention(*[torch.randn(8, 2, 4)] * 3, cpref.Sharding(torch.tensor([0, 8]), cp_size=1), comm=HalfComm(), mode="p2p")


@pytest.mark.parametrize("check_ranks", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize(
    "mode, extra, hkv, match",
    [
        # Hkv = 3 over a2a groups of 2: 3 % 2 and 2 % 3 are both nonzero
        ("a2a+p2p", {"a2a_size": 2}, 3, r"mode 'a2a\+p2p' with a2a_size=2 splits heads over 2 ranks \(P = 4\), but Hq = 12, "
                                       r"Hkv = 3 cannot be split so: .*sizes that work: \[1, 3, 6, 12\]$"),
        # Hkv = 3 over 4 ranks: 3 % 4, 4 % 3; Hkv = 6 over 4 ranks: more heads than ranks, yet 6 % 4 and 4 % 6
        ("a2a", {}, 3, r"mode 'a2a' splits heads over 4 ranks \(P = 4\), but Hq = 12, Hkv = 3 .*sizes that work: \[1, 3, 6, 12\]$"),
        ("a2a", {}, 6, r"mode 'a2a' splits heads over 4 ranks \(P = 4\), but Hq = 12, Hkv = 6 .*sizes that work: \[1, 2, 3, 6, 12\]$"),
    ],
    ids=["a2a+p2p-a2-hkv3", "a2a-hkv3", "a2a-hkv6"],
)
def test_kv_heads_the_a2a_group_can_neither_split_nor_replicate_are_refused_before_the_mode_communicates(
    mode, extra, hkv, match, check_ranks
):
    """Field bug 8 at P = 4: Hq = 12 splits over the group (12 % 2 == 12 % 4 == 0), so only the
    key/value-head condition can refuse these. Nothing but the ranks' comparison is communicated
    (the first call on a communicator is compared whatever check_ranks says), never a tensor of
    the mode."""
    P = 4
    sharding = cpref.Sharding(torch.tensor([0, 8, 32]), cp_size=P, layout="zigzag")
    q, k, v = random_qkv(32, 12, hkv, 8)

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        return cpref.attention(*local, sharding, comm=comm, mode=mode, check_ranks=check_ranks, **extra)

    cluster = SimCluster(P, timeout=30.0)
    with pytest.raises(CPInputError, match=match):
        cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace), cluster.trace


@pytest.mark.parametrize("P", [3, 6])
def test_three_kv_heads_run_under_ulysses_where_the_group_size_is_a_multiple_of_three(P):
    """The Ulysses docstring allows Hkv < P when P % Hkv == 0, replicating each key/value head
    P / Hkv times (P = 6: twice; P = 3 splits them one per rank): the heads refused at P = 2 and 4
    run at P = 3 and 6 and match the FP64 oracle, gradients of the replicas summed back."""
    from sim.cluster.harness import oracle_shards, run_attention
    from tests.helpers import assert_close

    sharding = cpref.Sharding(torch.tensor([0, 12, 48]), cp_size=P, layout="zigzag")  # documents of multiples of 2P = 12
    q, k, v = random_qkv(48, 12, 3, 8)
    dout = random_qkv(48, 12, 12, 8, seed=1)[0]
    results, _ = run_attention(q, k, v, dout, sharding, mode="a2a", cluster=SimCluster(P, timeout=30.0))
    refs = oracle_shards(q, k, v, dout, sharding)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"P={P} rank {r} {name}")
