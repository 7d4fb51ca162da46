"""A checkpoint loads into a model of its own dtypes, or is refused naming both (issue 56, item 3).

Was: `load_checkpoint` into a bfloat16 or float64 model cast every weight and every Adam moment without a
word, and `meta.json` recorded no dtype. Now `meta.json` records the model's dtypes, and a model of other
dtypes is refused before anything is loaded, naming both and the fix, unless `override` names `"dtype"` (then
the cast is deliberate). Each tensor is compared as the payload is read, so a checkpoint written before the
dtypes were recorded, one of mixed dtypes, and moments of another dtype than their parameter are held to the
same rule, in both formats. Then a fuzz ("dtype on resume") over saved and live dtypes, formats, overrides and
recorded or unrecorded dtypes: every load gives the saved state exactly (cast only where asked), or one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpref.base.errors import CPInputError
from cpref.comm.protocol import SingleRank
from cpref.train.checkpoint import CheckpointMeta, TorchPayload, load_checkpoint, read_meta, save_checkpoint
from tests.training.test_checkpoint_safety import resign

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
META = CheckpointMeta(1, 1, 1, "p2p", "zigzag", 1, {"family": "linear"}, {"lr": 1e-3})
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64, "fp16": torch.float16}


def payload(fmt: str):
    from cpref.train.dcp import DcpPayload

    return DcpPayload(local=True) if fmt == "dcp" else TorchPayload()


def model_of(dtype, seed: int, *, step: bool, mixed: str | None = None):
    """A Linear in `dtype` (its bias in `mixed`, if given) and its AdamW, after one step if `step` (moments made)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2).to(dtype)
    if mixed is not None:
        model.bias.data = model.bias.data.to(mixed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    return model, opt


def saved(tmp_path, dtype, fmt="torch", mixed=None):
    model, opt = model_of(dtype, 0, step=True, mixed=mixed)
    path = save_checkpoint(tmp_path / "ckpt", model, opt, META, SingleRank(), payload(fmt))
    return path, {k: v.clone() for k, v in model.state_dict().items()}, opt


def unrecorded(path):
    """The checkpoint as an earlier cpref wrote it: no `dtype` in meta.json (the sums recomputed)."""
    record = json.loads((path / "meta.json").read_text())
    del record["dtype"], record["fields_sha256"]["dtype"]
    (path / "meta.json").write_text(json.dumps(record))
    resign(path)
    assert read_meta(path).dtype is None


def untouched(model, opt, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not opt.state


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
@pytest.mark.parametrize("live", ["bf16", "fp64"])
def test_a_model_of_another_dtype_is_refused_naming_both_and_cast_only_when_asked(tmp_path, fmt, live):
    path, state, _ = saved(tmp_path, torch.float32, fmt)
    assert read_meta(path).dtype == "float32"
    model, opt = model_of(DTYPES[live], 1, step=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    name = str(DTYPES[live]).removeprefix("torch.")
    with pytest.raises(CPInputError, match=rf"holds float32 tensors, this run's model {name} ones: loading would cast "
                                           r"every weight and every optimizer moment silently.*override=\('dtype',\)"):  # fmt: skip
        load_checkpoint(path, model, opt, expect=META, payload=payload(fmt))
    assert untouched(model, opt, before)
    load_checkpoint(path, model, opt, expect=META, payload=payload(fmt), override=("dtype",))
    assert all(torch.equal(v, state[k].to(DTYPES[live])) for k, v in model.state_dict().items())
    assert {m.dtype for s in opt.state.values() for k, m in s.items() if k != "step"} == {DTYPES[live]}


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_a_checkpoint_without_recorded_dtypes_is_compared_tensor_by_tensor(tmp_path, fmt):
    path, _, _ = saved(tmp_path, torch.float32, fmt)
    unrecorded(path)
    model, opt = model_of(torch.bfloat16, 1, step=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CPInputError, match=r"weight is float32 there, bfloat16 here; .*bias is float32 there, bfloat16 "
                                           "here.*loading would cast them silently"):  # fmt: skip
        load_checkpoint(path, model, opt, expect=META, payload=payload(fmt))
    assert untouched(model, opt, before)


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_mixed_dtypes_are_compared_tensor_by_tensor(tmp_path, fmt):
    """The same set of dtypes, on other tensors: the summary agrees, the tensors do not."""
    path, _, _ = saved(tmp_path, torch.float32, fmt, mixed=torch.bfloat16)
    assert read_meta(path).dtype == "bfloat16+float32"
    model, opt = model_of(torch.bfloat16, 1, step=False, mixed=torch.float32)
    with pytest.raises(CPInputError, match=r"weight is float32 there, bfloat16 here; .*bias is bfloat16 there, float32"):
        load_checkpoint(path, model, opt, expect=META, payload=payload(fmt))


def test_moments_of_another_dtype_than_their_parameter_are_refused(tmp_path):
    """An optimizer that kept float32 moments for bfloat16 weights: torch's AdamW would cast them to bfloat16."""
    model, opt = model_of(torch.bfloat16, 0, step=True)
    for s in opt.state.values():
        s["exp_avg"] = s["exp_avg"].float()
    path = save_checkpoint(tmp_path / "ckpt", model, opt, META, SingleRank())
    fresh, fresh_opt = model_of(torch.bfloat16, 1, step=False)
    with pytest.raises(CPInputError, match=r"the optimizer's exp_avg of weight is float32 there, bfloat16 here"):
        load_checkpoint(path, fresh, fresh_opt, expect=META)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(saved_as=st.sampled_from(sorted(DTYPES)), live=st.sampled_from(sorted(DTYPES)), fmt=st.sampled_from(["torch", "dcp"]),
       cast=st.booleans(), recorded=st.booleans())  # fmt: skip
def test_dtype_on_resume_loads_exactly_or_is_refused_in_one_line(tmp_path_factory, saved_as, live, fmt, cast, recorded):
    """The reliability fuzz's class "dtype on resume": exactly one of two outcomes, decided before the call."""
    path, state, opt_saved = saved(tmp_path_factory.mktemp("dtype"), DTYPES[saved_as], fmt)
    if not recorded:
        unrecorded(path)
    model, opt = model_of(DTYPES[live], 1, step=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refused = saved_as != live and not cast
    try:
        load_checkpoint(path, model, opt, expect=META, payload=payload(fmt), override=("dtype",) if cast else ())
    except CPInputError as err:
        assert refused and "\n" not in str(err) and str(DTYPES[live]).removeprefix("torch.") in str(err), (err, refused)
        assert "float" in str(err).split(" there")[0] or "tensors" in str(err)
        assert untouched(model, opt, before)
        return
    assert not refused, "a load into another dtype passed without override"
    assert all(torch.equal(v, state[k].to(DTYPES[live])) for k, v in model.state_dict().items())
    moments = [s["exp_avg"] for s in opt.state.values()]
    want = [s["exp_avg"].to(DTYPES[live]) for s in opt_saved.state.values()]
    assert len(moments) == 2 and all(torch.equal(a, b) for a, b in zip(moments, want))
