"""The per-rank programs of the gloo tests: module-level functions, importable by spawned ranks.

`run_all_cases` runs every semantic case of `CASES` (and the structural checks of `EXTRA`) on
one world of 4 processes, so that the whole suite pays for one process start-up. Every
member builds every other member's input from its *global* rank, so the expected tensors are
built independently of the backend, and a group-rank / global-rank mix-up shows.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cpref
from cpref.base.errors import CPInputError
from cpref.comm import TorchComm, TorchPending, unsupported_ops
from cpref.comm.capabilities import NEW_GROUP_PARAMS
from sim.cluster.simcluster import _reduce_scatter

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# a fraction each dtype holds exactly next to integers up to ~40, and that a narrower one loses
FINE = {torch.float64: 2.0**-30, torch.float32: 2.0**-10, torch.float16: 2.0**-3, torch.bfloat16: 2.0**-1}

# the groups every semantic case runs on: name -> how to make it from the world (same on every rank);
# gloo's default exchange is "p2p" (pairwise sends), the "native" groups run its collectives
GROUPS = {
    "world": lambda w, m: w,  # size 4
    "world-native": lambda w, m: TorchComm(exchange="native"),
    "split-02-13-native": lambda w, m: TorchComm(exchange="native").split([[0, 2], [1, 3]]),
    "split-02-13": lambda w, m: w.split([[0, 2], [1, 3]]),  # non-consecutive ranks
    "split-20-31": lambda w, m: w.split([[2, 0], [3, 1]]),  # listed order numbers the ranks
    "split-01-23": lambda w, m: w.split([[0, 1], [2, 3]]),
    "split-012-3": lambda w, m: w.split([[0, 1, 2], [3]]),  # sizes 3 and 1
    "mesh-dp,cp": lambda w, m: TorchComm.from_mesh(m["dp,cp"], "cp"),  # CP ranks {0, 1}, {2, 3}
    "mesh-cp,dp": lambda w, m: TorchComm.from_mesh(m["cp,dp"], "cp"),  # CP ranks {0, 2}, {1, 3}
}
if "sort_ranks" not in NEW_GROUP_PARAMS:  # an older torch refuses a listed order (test_torch_dist checks the error)
    del GROUPS["split-20-31"]


def member_input(comm, s: int, salt: int, rows: int, dtype, *, exact=False, strided=False) -> torch.Tensor:
    """Group rank `s`'s input, from its global rank: `(rows, 3, 2)`; exact sums if `exact`."""
    g = torch.Generator().manual_seed(1000 * comm.group[s] + salt)
    if exact:  # small integers plus a multiple of FINE: every sum is exact, in any order
        ints, steps = torch.randint(-8, 9, (rows, 2, 3), generator=g), torch.randint(0, 4, (rows, 2, 3), generator=g)
        x = ints + steps * FINE[dtype]
    else:
        x = torch.randn(rows, 2, 3, generator=g, dtype=torch.float64)
    x = x.to(dtype)  # (rows, 2, 3)
    return x.transpose(1, 2) if strided else x.transpose(1, 2).contiguous()  # (rows, 3, 2)


def inputs(comm, salt, rows, dtype, **kw) -> list[torch.Tensor]:
    return [member_input(comm, s, salt, rows, dtype, **kw) for s in range(comm.size)]


def call(op, x, *args):
    """Call `op(x, ...)` on a leaf that requires grad; check it stays untouched and out is fresh."""
    x = x.detach().clone().requires_grad_(True)  # keeps x's strides
    before = x.detach().clone()
    out = op(x, *args)
    out = out.wait() if isinstance(out, TorchPending) else out
    assert torch.equal(x.detach(), before), f"{op.__name__} modified its input in place"
    assert not out.requires_grad and out.grad_fn is None, f"{op.__name__} carried autograd history"
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), f"{op.__name__} returned a view of x"
    return out


def expect(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got, want = f"{out.dtype}{tuple(out.shape)}", f"{ref.dtype}{tuple(ref.shape)}"
    assert got == want, f"{what}: {got} != {want}"
    assert torch.equal(out, ref), f"{what}: values differ\n{out}\n!=\n{ref}"


def _sum(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in xs]).sum(0).to(xs[0].dtype)  # exact for exact inputs


def case_all_gather(comm, dtype):
    xs = inputs(comm, 1, 2, dtype)  # P x (2, 3, 2)
    expect(call(comm.all_gather, xs[comm.rank]), torch.cat(xs), "all_gather")  # (2P, 3, 2)


def case_reduce_scatter(comm, dtype):
    xs = inputs(comm, 2, 2 * comm.size, dtype, exact=True, strided=True)  # P x (2P, 3, 2)
    ref = _sum(xs).chunk(comm.size)[comm.rank]  # (2, 3, 2): chunk r of the sum
    expect(call(comm.reduce_scatter, xs[comm.rank]), ref, "reduce_scatter")


def case_all_to_all(comm, dtype):
    xs = inputs(comm, 3, 2 * comm.size, dtype, strided=True)  # P x (2P, 3, 2)
    ref = torch.cat([xs[s].chunk(comm.size)[comm.rank] for s in range(comm.size)])  # chunk r of every x_s
    expect(call(comm.all_to_all, xs[comm.rank]), ref, "all_to_all")


def case_all_reduce(comm, dtype):
    xs = inputs(comm, 4, 3, dtype, exact=True)
    expect(call(comm.all_reduce, xs[comm.rank]), _sum(xs), "all_reduce sum")
    expect(call(comm.all_reduce, xs[comm.rank], "max"), torch.stack(xs).amax(0), "all_reduce max")
    expect(call(comm.all_reduce, xs[comm.rank], "min"), torch.stack(xs).amin(0), "all_reduce min")


def case_all_reduce_agrees(comm, dtype):
    """A rounding sum still gives every rank the same bits, close to the exact sum."""
    xs = inputs(comm, 5, 64, dtype)
    out = comm.all_reduce(xs[comm.rank])
    rows = comm.all_gather(out.unsqueeze(0))  # (P, 64, 3, 2)
    assert all(torch.equal(row, out) for row in rows), "ranks got different all_reduce results"
    tol = {torch.float16: 5e-3, torch.bfloat16: 2.5e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    ref = torch.stack(xs).double().sum(0)
    # |out - ref| <= atol + rtol |ref| (torch.testing.assert_close would import DTensor: 1 s a rank)
    assert ((out.double() - ref).abs() <= tol * comm.size + tol * ref.abs()).all(), f"all_reduce sum far from {ref}"


def case_send_recv(comm, dtype):
    P, r = comm.size, comm.rank
    for shift in (1, -1, 2, P, P + 1, -3):
        xs = inputs(comm, 10 + shift, 2, dtype, strided=True)
        expect(call(comm.send_recv, xs[r], shift), xs[(r - shift) % P], f"send_recv shift={shift}")


def second_wait_raises(handle) -> None:
    try:
        handle.wait()
    except RuntimeError as exc:
        assert "twice" in str(exc)
    else:
        raise AssertionError("a second wait() on one handle did not raise")


def case_send_recv_async(comm, dtype):
    """Post two shifts, work (even a collective) while they travel, wait in reverse order."""
    P, r = comm.size, comm.rank
    xs, ys, zs = inputs(comm, 20, 2, dtype), inputs(comm, 21, 2, dtype), inputs(comm, 22, 2, dtype, exact=True)
    fwd, bwd = comm.send_recv_async(xs[r], 1), comm.send_recv_async(ys[r], -1)
    total = comm.all_reduce(zs[r])  # communication on the same group meanwhile
    work = xs[r].double().flatten() @ ys[r].double().flatten()  # and compute
    comm.barrier()
    expect(bwd.wait(), ys[(r + 1) % P], "send_recv_async shift=-1")
    expect(fwd.wait(), xs[(r - 1) % P], "send_recv_async shift=1")
    expect(total, _sum(zs), "all_reduce between post and wait")
    assert torch.isfinite(work)
    expect(call(comm.send_recv_async, xs[r], 2), xs[(r - 2) % P], "send_recv_async shift=2")
    second_wait_raises(fwd)


def case_posted_collectives(comm, dtype):
    """Post an all-gather, a reduce-scatter and an all-to-all, communicate and compute meanwhile, wait in reverse
    order: the results of the blocking calls, the inputs untouched."""
    r = comm.rank
    xs, ys = inputs(comm, 30, 2, dtype), inputs(comm, 31, 2 * comm.size, dtype, exact=True, strided=True)
    zs = inputs(comm, 32, 2 * comm.size, dtype, strided=True)
    gather, scatter, exchange = comm.all_gather_async(xs[r]), comm.reduce_scatter_async(ys[r]), comm.all_to_all_async(zs[r])
    total = comm.all_reduce(xs[r])  # another collective between post and wait
    work = xs[r].double().flatten() @ xs[r].double().flatten()
    chunks = torch.cat([zs[s].chunk(comm.size)[r] for s in range(comm.size)])  # chunk r of every z_s
    expect(exchange.wait(), chunks, "all_to_all_async")
    expect(scatter.wait(), _sum(ys).chunk(comm.size)[r], "reduce_scatter_async")
    expect(gather.wait(), torch.cat(xs), "all_gather_async")
    assert torch.isfinite(work) and torch.isfinite(total).all()
    expect(call(comm.all_gather_async, xs[r]), torch.cat(xs), "all_gather_async alone")
    expect(call(comm.reduce_scatter_async, ys[r]), _sum(ys).chunk(comm.size)[r], "reduce_scatter_async alone")
    expect(call(comm.all_to_all_async, zs[r]), chunks, "all_to_all_async alone")
    second_wait_raises(gather)
    second_wait_raises(exchange)


CHECKS = {f.__name__[5:]: f for f in (case_all_gather, case_reduce_scatter, case_all_to_all, case_all_reduce,
                                      case_all_reduce_agrees, case_send_recv, case_send_recv_async,
                                      case_posted_collectives)}  # fmt: skip
CASES = [f"{g}/{c}/{str(d)[6:]}" for g in GROUPS for c in CHECKS for d in DTYPES]


def extra_structure(world, comms, meshes):
    """Attributes and split structure: group[rank] is the global rank, listed order renumbers, cached."""
    g = world.global_rank
    assert (world.rank, world.size, world.group, world.backend) == (g, 4, (0, 1, 2, 3), "gloo")
    assert world.unsupported_ops == frozenset()
    expected = {"split-02-13": [(0, 2), (1, 3)], "split-20-31": [(2, 0), (3, 1)], "split-01-23": [(0, 1), (2, 3)],
                "split-012-3": [(0, 1, 2), (3,)], "mesh-dp,cp": [(0, 1), (2, 3)],
                "mesh-cp,dp": [(0, 2), (1, 3)]}  # fmt: skip
    for name, parts in expected.items():
        part = next(p for p in parts if g in p)
        c = comms[name]
        assert (c.group, c.rank, c.size, c.global_rank) == (part, part.index(g), len(part), g), (name, c)
    assert world.split([[0, 2], [1, 3]]) is comms["split-02-13"], "split made a second group for one partition"
    assert TorchComm.from_mesh(meshes["dp,cp"], "dp").group == ((0, 2) if g % 2 == 0 else (1, 3))


def extra_exchange(world, comms, meshes):
    """gloo exchanges pairwise by default (inherited by splits); its reduce-scatter is the simulator's
    rank-order fold in the input dtype, bit for bit (`reduction="native"`), on groups of 4, 2 and 3."""
    assert world.exchange == "p2p" and comms["split-02-13"].exchange == "p2p", (world, comms["split-02-13"])
    assert comms["split-02-13-native"].exchange == "native" and "exchange='p2p'" in repr(world)
    _raises(ValueError, "exchange must be one of", lambda: TorchComm(exchange="nccl"))
    for name in ("world", "split-02-13", "split-012-3"):
        c = comms[name]
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            xs = inputs(c, 30, 64 * c.size, dtype)  # P x (64 P, 3, 2), rounding sums
            expect(c.reduce_scatter(xs[c.rank]), _reduce_scatter(xs, "native")[c.rank], f"{name} fold {dtype}")


def extra_split_errors(world, comms, meshes):
    for bad in ([[0, 1], [1, 2, 3]], [[0, 1, 2]], [[0, 1, 2, 3], []]):
        _raises(ValueError, "partition", world.split, bad)
    mine = [[0, 1], [2, 3]] if world.rank == 0 else [[0, 2], [1, 3]]  # ranks disagree (both cached)
    _raises(ValueError, "different partitions", world.split, mine)
    mine = [[0, 3], [1, 2]] if world.rank == 0 else [[0, 3], [2, 1]]  # (neither made yet)
    _raises(ValueError, "different partitions", world.split, mine)
    _raises(ValueError, "axes", TorchComm.from_mesh, meshes["dp,cp"], "tp")


def extra_validation(world, comms, meshes):
    """Bad calls raise on every rank before any communication (the next collective still works)."""
    _raises(ValueError, "divisible", world.reduce_scatter, torch.ones(6))
    _raises(ValueError, "divisible", world.all_to_all, torch.ones(5, 2))
    _raises(ValueError, "0-d", world.all_gather, torch.tensor(1.0))
    _raises(ValueError, "op must be", world.all_reduce, torch.ones(2), "mean")
    _raises(TypeError, "torch.Tensor", world.all_gather, [1.0])
    expect(world.all_reduce(torch.ones(2)), torch.full((2,), 4.0), "all_reduce after errors")


def extra_hccl_limits(world, comms, meshes):
    """A size-3 group told it is HCCL refuses tensor all-gather / reduce-scatter, naming the fix."""
    c = comms["split-012-3"]
    if c.size != 3:
        return
    c.backend, c.unsupported_ops = "hccl", unsupported_ops("hccl", 3)
    try:
        for op in (c.all_gather, c.reduce_scatter):
            _raises(CPInputError, "hccl backend does not support", op, torch.ones(3))
        expect(c.all_to_all(torch.ones(3)), torch.ones(3), "all_to_all is not limited")
    finally:
        c.backend, c.unsupported_ops = "gloo", frozenset()


def extra_widened_dtype(world, comms, meshes):
    """Where a backend lacks a dtype, it travels wider and comes back in the caller's dtype."""
    world._widen = {torch.float16: torch.float32}
    try:
        for check in CHECKS.values():
            check(world, torch.float16)
    finally:
        world._widen = {}


def extra_one_rank_rejects_its_inputs(world, comms, meshes):
    """Field bug 12 on real processes: rank 2 alone passes a short shard. Every rank raises at once,
    the others in the ranks' comparison naming rank 2, instead of waiting for it in a collective
    until the process group's timeout; the next collective then works."""
    P, g = world.size, torch.Generator().manual_seed(12)
    sharding = cpref.Sharding([0, 8 * P, 16 * P], cp_size=P, layout="zigzag")  # two documents, multiples of 2P
    q, k, v = (torch.randn(16 * P, 2, 4, generator=g) for _ in range(3))
    local = [sharding.shard(t, world.rank) for t in (q, k, v)]
    if world.rank == 2:
        local[0] = local[0][:-2]
    n = sharding.local_tokens  # a shard's tokens
    text = f"q/k/v hold {n - 2}/{n}/{n} tokens" if world.rank == 2 else "the inputs of rank 2 of the CP group failed validation"
    start = time.monotonic()
    _raises(CPInputError, text, lambda: cpref.attention(*local, sharding, comm=world, mode="all_gather"))
    assert time.monotonic() - start < 30, "a rank waited for the failing one"
    expect(world.all_reduce(torch.ones(2)), torch.full((2,), 4.0), "all_reduce after the failure")


def _zigzag(cu, P):
    return cpref.Sharding(cu, cp_size=P, layout="zigzag")


def _two_layers(comm, layer2, first=None):
    """Layer 1 on every rank alike, then layer 2 with `layer2(rank, local, cu, sharding) -> (tensors, sharding, kwargs)`."""
    P, g = comm.size, torch.Generator().manual_seed(18)
    cu = torch.tensor([0, 8 * P, 16 * P])
    sharding = _zigzag(cu, P)
    q, k, v = (torch.randn(16 * P, 2, 4, generator=g) for _ in range(3))
    local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
    outs = [cpref.attention(*local, sharding, comm=comm, mode="p2p", **(first or {}))]
    tensors, sharding2, kw = layer2(comm.rank, local, cu, sharding)
    outs.append(cpref.attention(*tensors, sharding2, comm=comm, mode=kw.pop("mode", "p2p"), **kw))
    return outs


def extra_later_layer_divergence(world, comms, meshes):
    """Issue 18, part 4, on real processes: rank 1 alone differs on layer 2. An argument that differs
    raises the same CPInputError on every rank at once (was: SIGABRT inside gloo, or a hang until the
    timeout); a new tensor with the same values or a cleared cache changes nothing; check_ranks is
    agreed on the first call and named where it differs. Each on a fresh communicator of the world."""
    start = time.monotonic()
    changes = {"causal": ({"causal": False}, "causal: rank 0, rank 2, rank 3: True; rank 1: False"),
               "softmax_scale": ({"softmax_scale": 0.3}, "softmax_scale: rank 0, rank 2, rank 3: 0.5; rank 1: 0.3"),
               "mode": ({"mode": "all_gather"}, "\n  mode: rank 0, rank 2, rank 3: digest"),
               "check_ranks": ({"check_ranks": False}, "check_ranks: rank 0, rank 2, rank 3: True; rank 1: False")}  # fmt: skip
    for kw, text in changes.values():
        comm = TorchComm(world.process_group)
        _raises(CPInputError, text, _two_layers, comm, lambda r, local, cu, s, kw=kw: (local, s, dict(kw) if r == 1 else {}))
    comm = TorchComm(world.process_group)
    _raises(CPInputError, "dtype: rank 0, rank 2, rank 3: torch.float32; rank 1: torch.float64", _two_layers, comm,
            lambda r, local, cu, s: ([t.double() for t in local] if r == 1 else local, s, {}))  # fmt: skip
    plain = _two_layers(TorchComm(world.process_group), lambda r, local, cu, s: (local, s, {}))

    def cleared(r, local, cu, s):  # rank 1 clears the cache and shards the same tensor again: a new cache entry
        if r == 1:
            cpref.clear_cache()
            return local, _zigzag(cu, s.cp_size), {}
        return local, s, {}

    for layer2 in (lambda r, local, cu, s: (local, _zigzag(cu.clone(), s.cp_size) if r == 1 else s, {}), cleared):
        outs = _two_layers(TorchComm(world.process_group), layer2)
        assert all(torch.equal(a, b) for a, b in zip(outs, plain)), "the same values gave other outputs"
    comm = TorchComm(world.process_group)  # the first call: rank 1 alone says check_ranks=False
    _raises(CPInputError, "check_ranks: rank 0, rank 2, rank 3: True; rank 1: False", _two_layers, comm,
            lambda r, local, cu, s: (local, s, {}), {"check_ranks": world.rank != 1})  # fmt: skip
    assert time.monotonic() - start < 30, "a rank waited for another"
    expect(world.all_reduce(torch.ones(2)), torch.full((2,), 4.0), "all_reduce after the failures")


def extra_cp_loss_one_rank_rejects_its_inputs(world, comms, meshes):
    """Field bug 12's pattern in `cp_loss`: rank 2 alone passes a mask one token short; every rank
    raises at once (was: rank 2 raised, the others waited in the count's all-reduce until the timeout)."""
    token_loss, mask = torch.rand(6), torch.ones(6)
    if world.rank == 2:
        mask = mask[:-1]
    text = "token_loss has shape (6,) but loss_mask (5,)" if world.rank == 2 else "loss_mask of rank 2 of the group failed"
    start = time.monotonic()
    _raises(CPInputError, text, cpref.cp_loss, token_loss, mask, world)
    assert time.monotonic() - start < 30, "a rank waited for the failing one"
    expect(world.all_reduce(torch.ones(2)), torch.full((2,), 4.0), "all_reduce after the failure")


def extra_agree_over_a_control_group(world, comms, meshes):
    """Where the group's backend carries no CPU tensors (NCCL, HCCL: told so here), `agree` runs on a
    gloo group of the same ranks made at its first call, and the rows arrive in rank order."""
    comm = TorchComm(comms["split-20-31"].process_group)
    comm.device = torch.device("meta")  # stands for an accelerator: agree must not use this group
    rows = comm.agree([comm.rank, 7 * comm.global_rank])
    assert rows == [[r, 7 * g] for r, g in enumerate(comm.group)], rows
    assert comm._ctl is not None and comm._ctl.process_group is not comm.process_group and comm._ctl.group == comm.group
    assert TorchComm(world.process_group).agree([world.rank]) == [[0], [1], [2], [3]]  # gloo: its own group


EXTRA = {f.__name__[6:]: f for f in (extra_structure, extra_exchange, extra_split_errors, extra_validation, extra_hccl_limits,
                                     extra_widened_dtype, extra_one_rank_rejects_its_inputs, extra_later_layer_divergence,
                                     extra_cp_loss_one_rank_rejects_its_inputs, extra_agree_over_a_control_group)}  # fmt: skip


def _raises(kind, text, fn, *args):
    try:
        fn(*args)
    except kind as exc:
        assert text in str(exc), f"{kind.__name__} without {text!r}: {exc}"
    else:
        raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} did not raise {kind.__name__}")


def run_all_cases(tag: str) -> dict[str, str | None]:
    """Every case of `CASES` and `EXTRA` on this rank: `{name: None or the failure's traceback}`.

    The entry `"whoami"` is `whoami(tag)`, for the launcher's own test.
    """
    world = TorchComm()
    # two 2 x 2 meshes over the world: CP ranks {0, 1}, {2, 3} and {0, 2}, {1, 3}
    meshes = {axes: init_device_mesh("cpu", (2, 2), mesh_dim_names=tuple(axes.split(",")))
              for axes in ("dp,cp", "cp,dp")}  # fmt: skip
    comms = {name: make(world, meshes) for name, make in GROUPS.items()}
    outcome: dict = {"whoami": whoami(tag)}
    for name in CASES:
        group, check, dtype = name.split("/")
        outcome[name] = _outcome(CHECKS[check], comms[group], getattr(torch, dtype))
    for name, extra in EXTRA.items():
        outcome[name] = _outcome(extra, world, comms, meshes)
    return outcome


def _outcome(fn, *args) -> str | None:
    try:
        fn(*args)
    except AssertionError:
        return traceback.format_exc()
    return None


# --- programs for the launcher's own tests ---------------------------------------------------


def whoami(tag: str) -> tuple:
    """Rank, world size, threads and the argument: what launch must return, rank by rank."""
    return dist.get_rank(), dist.get_world_size(), torch.get_num_threads(), tag


def raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 rejects its input")
    TorchComm().barrier()


def killed_mid_collective() -> None:
    comm = TorchComm()
    if comm.rank == 1:  # die while rank 0 waits in the all-reduce
        time.sleep(0.5)
        os.kill(os.getpid(), 9)
    comm.all_reduce(torch.ones(4))


def mismatched_shapes() -> None:
    TorchComm().all_gather(torch.ones(2 + dist.get_rank()))


def grad_mode_and_sinks_divergence() -> list[str]:
    """Issue 56 on real processes, in every mode: rank 1 alone calls attention under `torch.no_grad()` (item 5; was:
    the others' backward waited in its collectives until the process group's timeout), then with sinks of other
    values (item 2; was: no error). Every rank raises the same CPInputError within seconds, naming the column;
    the next collective works. Returns the modes checked."""
    from cpref.modes.consistency import BACKWARD

    world = TorchComm()
    P, g = world.size, torch.Generator().manual_seed(56)
    sharding = cpref.Sharding([0, 8 * P, 16 * P], cp_size=P, layout="zigzag")  # two documents, multiples of 2P
    q, k, v = (torch.randn(16 * P, 4, 4, generator=g) for _ in range(3))
    sinks = torch.randn(4, generator=g)
    others = "rank 0, rank 2, rank 3" if P == 4 else "rank 0"
    start, checked = time.monotonic(), []
    for mode in sorted(cpref.MODES):
        local = [sharding.shard(t, world.rank).requires_grad_() for t in (q, k, v)]
        train = functools.partial(_train, local, sharding, world, mode)
        with torch.no_grad() if world.rank == 1 else contextlib.nullcontext():
            _raises(CPInputError, f"\n  {BACKWARD}: {others}: True; rank 1: False\n", train)
        theirs = torch.nn.Parameter(sinks + (world.rank == 1))
        _raises(CPInputError, f"\n  sinks values: {others}: digest", functools.partial(train, sinks=theirs))
        checked.append(mode)
    assert time.monotonic() - start < 30, "a rank waited for another"
    expect(world.all_reduce(torch.ones(2)), torch.full((2,), float(P)), "all_reduce after the failures")
    return checked


def _train(local, sharding, comm, mode, **kw) -> None:
    """One layer's attention over `local` (q, k, v) and its backward."""
    out = cpref.attention(*local, sharding, comm=comm, mode=mode, **cpref.MODES[mode].example_options(comm.size), **kw)
    out.sum().backward()


def silent_peer() -> None:
    """Rank 1 never calls the barrier and never dies: only the process-group timeout ends it."""
    if dist.get_rank() == 1:
        time.sleep(120)
    TorchComm().barrier()
