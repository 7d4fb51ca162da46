"""`torch.compile` of a model that calls cpref: the attention runs eagerly (a graph break), the rest compiles.

Issue 56: compiling a module that called `cpref.attention` failed in `aot_eager` and `inductor` alike
(functionalization refused the kernel's writes into strided views of its outputs). Now `cpref.attention` is
`torch.compiler.disable`d: a small attention block (projections, `cpref.attention`, an output projection and a
ReLU) compiles into two graphs, before and after the call, each holding its projection; its output and every
gradient (the parameters' and the input's) equal the eager module's, bitwise with `aot_eager` (the same ATen
kernels) and within fp32's 1e-5 with `inductor` (its own fused kernels); a second batch, another `Sharding` of
the same shapes, compiles nothing new. At CP 1 (`cpref.SingleRank`) and CP 2 on the simulated cluster; with
`fullgraph=True`, dynamo refuses at the call, naming the reason and the fix.

A Hugging Face model with `attn_implementation="cpref"` compiles too: its model-level checks (the forward
pre-hook) and every layer's attention are the graph breaks, the loss and every gradient equal the eager model's,
and the next batch reuses the graphs (without the checks' graph break, every batch compiled anew).

The block with `aot_eager` runs in the fast tier (a few seconds); with `inductor` (a C++ compiler, tens of seconds),
and the Hugging Face model (15 s), in the full one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

import cpref
import cpref.hf
from cpref.api import EAGER_REASON
from cpref.hf import guard, layer
from sim import SimCluster
from tests.helpers import assert_close

DOCS = ([0, 13, 20, 40], [0, 7, 33, 40])  # two batches of 40 real tokens, padded alike at CP 2 (zigzag: 44)
H, D = 4, 8


class Block(torch.nn.Module):
    """Projections, `cpref.attention`, an output projection and a ReLU: `(T_l, H D) -> (T_l, H D)`."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(H * D, 3 * H * D), torch.nn.Linear(H * D, H * D)
        g = torch.Generator().manual_seed(0)  # the same weights on every rank (their threads share the global seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor, sharding: cpref.Sharding, comm) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, H, D).unbind(1)  # (T_l, H, D) each
        o = cpref.attention(q, k, v, sharding, comm=comm, mode="p2p")  # (T_l, H, D)
        return self.out(o.reshape(-1, H * D)).relu()


def recording(backend: str, graphs: list):
    """`backend`, recording the ATen-level ops of every graph dynamo hands it (`graphs`: one list of names each)."""
    inner = lookup_backend(backend)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")])
        return inner(gm, example_inputs)

    return compile_graph


def steps(comm, P: int, backend: str | None, graphs: list) -> list[tuple]:
    """Both batches through one module, compiled with `backend` (None: eager): `(out, input grad, param grads)` each."""
    block, x = Block(), torch.randn(40, H * D, generator=torch.Generator().manual_seed(1))
    run = block if backend is None else torch.compile(block, backend=recording(backend, graphs))
    results = []
    for cu in DOCS:
        s = cpref.Sharding.eod_padded(cu, cp_size=P)
        xs = s.shard(s.pad(x), comm.rank).requires_grad_()  # (T_l, H D)
        block.zero_grad()
        y = run(xs, s, comm)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), xs.grad, {n: p.grad.clone() for n, p in block.named_parameters()}))
        if backend is not None:
            results[-1] += (len(graphs),)
    return results


def on_ranks(P: int, fn):
    return [fn(cpref.SingleRank())] if P == 1 else SimCluster(P).run(fn)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def check_compiled(P: int, backend: str, exact: bool) -> None:
    graphs: dict[int, list] = {}
    want = on_ranks(P, lambda comm: steps(comm, P, None, []))
    got = on_ranks(P, lambda comm: steps(comm, P, backend, graphs.setdefault(comm.rank, [])))
    for r in range(P):
        # two graphs a rank, compiled for the first batch and reused for the second: the block's code, not the call
        assert [step[3] for step in got[r]] == [2, 2], f"rank {r}: {graphs[r]}"
        before, after = graphs[r]
        assert any("linear" in op for op in before), before
        assert any("linear" in op for op in after) and any("relu" in op for op in after), after
        assert not any("cpref" in op or "attention" in op for op in before + after)
        for i, ((y, dx, grads), (y0, dx0, grads0)) in enumerate(zip((s[:3] for s in got[r]), want[r])):
            for name, a, b in [("out", y, y0), ("dx", dx, dx0), *((f"d{n}", grads[n], grads0[n]) for n in grads0)]:
                what = f"P={P} {backend} rank {r} batch {i}: {name}"
                if exact:
                    assert torch.equal(a, b), what
                else:
                    assert_close(a, b, torch.float32, msg=what)
    breaks = list(counters["graph_break"])  # one kind of graph break, the call's
    assert len(breaks) == 1 and EAGER_REASON in breaks[0], breaks


@pytest.mark.parametrize("P", [1, 2])
def test_a_module_calling_cpref_attention_compiles_with_aot_eager(P):
    check_compiled(P, "aot_eager", exact=True)


@pytest.mark.full
@pytest.mark.parametrize("P", [1, 2])
def test_a_module_calling_cpref_attention_compiles_with_inductor(P):
    check_compiled(P, "inductor", exact=False)


def test_fullgraph_is_refused_at_the_call_naming_the_fix():
    s = cpref.Sharding([0, 8], cp_size=1)
    block = torch.compile(Block(), backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="cpref.attention runs eagerly under torch.compile") as err:
        block(torch.randn(8, H * D), s, cpref.SingleRank())
    assert "with fullgraph=True compile the code before and after it" in str(err.value)


# ---- a Hugging Face model (transformers, a test extra: skipped without it) ---------------------------------------


def hf_steps(comm, P: int, model, backend: str | None) -> list[tuple]:
    """Two flattened batches through `model` (compiled with `backend`, or eager): `(loss, gradients, graphs)` each."""
    run = model if backend is None else torch.compile(model, backend=backend)
    g, results = torch.Generator().manual_seed(2), []
    for cu in DOCS:
        ids = torch.randint(1, 300, (1, 40), generator=g)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
        b = cpref.hf.shard_batch({"input_ids": ids, "position_ids": pos}, cp_size=P, rank=comm.rank)
        model.zero_grad()
        loss = run(b["tokens"][None], position_ids=b["position_ids"][None], shift_labels=b["shift_labels"][None],
                   use_cache=False, cp=cpref.hf.CP(comm, b["sharding"])).loss  # fmt: skip
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, counters["stats"]["unique_graphs"]))
    return results


@pytest.mark.full
@pytest.mark.parametrize("P", [1, 2])
def test_a_hugging_face_model_compiles_around_its_checks_and_attention(P):
    transformers = pytest.importorskip("transformers")
    from tests.models.test_hf_attention import build

    transformers.logging.set_verbosity_error()
    cpref.hf.register()
    base = build("llama3", cpref.hf.NAME)
    want = on_ranks(P, lambda comm: hf_steps(comm, P, copy.deepcopy(base), None))
    got = on_ranks(P, lambda comm: hf_steps(comm, P, copy.deepcopy(base), "aot_eager"))
    for r in range(P):
        (loss0, grads0, _), (loss1, grads1, _) = want[r]
        for i, (loss, grads, _) in enumerate(got[r]):
            assert_close(loss, (loss0, loss1)[i], torch.float32, msg=f"rank {r} batch {i}: loss")
            for n, g in (grads0, grads1)[i].items():
                assert_close(grads[n], g, torch.float32, msg=f"rank {r} batch {i}: gradient of {n}")
    if P == 1:  # (on the simulated cluster, the ranks' threads share dynamo's counters and caches)
        first, second = (step[2] for step in got[0])
        assert first > 0 and second == first  # compiled graphs, none new for the next batch
    reasons = {reason for reason in (guard.EAGER, layer.EAGER) if any(reason in k for k in counters["graph_break"])}
    assert reasons == {guard.EAGER, layer.EAGER}
    assert all(guard.EAGER in k or layer.EAGER in k for k in counters["graph_break"]), list(counters["graph_break"])


def test_a_hugging_face_model_with_fullgraph_is_refused_at_its_checks():
    pytest.importorskip("transformers")
    from tests.models.test_hf_attention import build

    cpref.hf.register()
    model = torch.compile(build("llama3", cpref.hf.NAME), backend="aot_eager", fullgraph=True)
    s = cpref.Sharding([0, 8], cp_size=1)
    with pytest.raises(torch._dynamo.exc.Unsupported) as err:
        model(torch.ones(1, 8, dtype=torch.long), use_cache=False, cp=cpref.hf.CP(cpref.SingleRank(), s))
    assert guard.EAGER in str(err.value)
