"""Checkpoints: resuming at another CP size continues the run exactly; bad checkpoints are refused,
and nothing is overwritten or half-loaded."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from cpref.models import CausalLM
from cpref.train.checkpoint import load_checkpoint, read_meta
from cpref.train.training import TrainConfig
from sim.tools.train import RunSpec, run_sim

TINY = {"llama": dict(family="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2),
        "gpt2": dict(family="gpt2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, max_positions=128)}  # fmt: skip


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    import sim.tools.train

    monkeypatch.setattr(sim.tools.train, "PRESETS", TINY)


def spec(cp, steps, *, mode="p2p", layout="zigzag", micro=2, **kw) -> RunSpec:
    config = TrainConfig(mode=mode, layout=layout, micro_batches=micro, options=cpref.MODES[mode].example_options(cp))
    return RunSpec(model=kw.pop("model", "llama"), cp=cp, steps=steps, pack_tokens=64, train=config, **kw)


def losses(stats):
    return [(s.step, s.loss, s.grad_norm) for s in stats]


@pytest.mark.parametrize("resume_cp, mode, layout", [(1, "all_gather", "zigzag"), (4, "a2a+p2p", "zigzag"),
                                                     (2, "a2a", "zigzag"), (4, "p2p", "stream"), (4, "all_gather", "balanced")])  # fmt: skip
def test_resuming_at_another_cp_size_continues_the_run_step_for_step(tmp_path, resume_cp, mode, layout):
    """Saved at CP = 2 (p2p, zigzag), resumed at another CP size, mode or layout: the same run, step for step."""
    whole = losses(run_sim(spec(2, 8)))
    first = losses(run_sim(spec(2, 4, save=str(tmp_path / "ckpt"))))
    rest = losses(run_sim(spec(resume_cp, 8, mode=mode, layout=layout, resume=str(tmp_path / "ckpt"))))
    assert first == whole[:4]  # the same run up to the save
    assert [s for s, *_ in rest] == [4, 5, 6, 7]
    for (step, loss, norm), (_, loss_ref, norm_ref) in zip(rest, whole[4:]):
        assert abs(loss - loss_ref) <= 1e-5 * loss_ref and abs(norm - norm_ref) <= 1e-5 * norm_ref, step
    meta = read_meta(tmp_path / "ckpt")
    assert (meta.step, meta.cp, meta.mode, meta.packs_per_step) == (4, 2, "p2p", 2)


def test_only_rank_0_writes_and_loading_is_weights_only(tmp_path, monkeypatch):
    written = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: written.append(str(getattr(f, "name", f))) or real_save(obj, f, *a, **k))
    run_sim(spec(4, 1, save=str(tmp_path / "ckpt")))
    assert sorted(p.rsplit("/", 1)[1] for p in written) == ["rng.pt", "state.pt"]  # once, not once per rank
    state = torch.load(tmp_path / "ckpt" / "state.pt", weights_only=True)  # no pickled code inside
    assert set(state) == {"model", "optimizer"}


def saved(tmp_path, **kw):
    run_sim(spec(2, 2, save=str(tmp_path / "ckpt"), **kw))
    return tmp_path / "ckpt"


def fresh(model="llama"):
    m = CausalLM(spec(1, 1, model=model).model_config(), seed=123)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3), {k: v.clone() for k, v in m.state_dict().items()}


def untouched(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_corrupt_checkpoint_is_refused_and_nothing_is_loaded(tmp_path):
    path = saved(tmp_path)
    data = bytearray((path / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "state.pt").write_bytes(bytes(data))
    model, opt, before = fresh()
    with pytest.raises(CPInputError, match="do not match the SHA-256 sums"):
        load_checkpoint(path, model, opt, expect=spec(2, 2).meta(0))
    assert untouched(model, before)


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(tmp_path):
    path = saved(tmp_path)
    model, opt, before = fresh("gpt2")
    with pytest.raises(CPInputError, match=r"holds another model: \(checkpoint, this run\) differ in .*'family': \('llama', 'gpt2'\)"):
        load_checkpoint(path, model, opt, expect=spec(2, 2, model="gpt2").meta(0))
    assert untouched(model, before)


def test_other_packs_per_step_are_refused(tmp_path):
    path = saved(tmp_path)
    model, opt, before = fresh()
    with pytest.raises(CPInputError, match="dp x micro_batches = 1 x 2 packs per step, this run takes 1 x 1"):
        load_checkpoint(path, model, opt, expect=spec(2, 2, micro=1).meta(0))
    assert untouched(model, before)


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = saved(tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    import cpref.train.checkpoint

    def broken(self, directory, model, optimizer, world):
        raise OSError("disk full")

    monkeypatch.setattr(cpref.train.checkpoint.TorchPayload, "save", broken)
    with pytest.raises(CPInputError, match=rf"could not write the checkpoint of step 3 to {path}.tmp: disk full "
                                           rf"\(OSError\); {path} is as it was"):  # fmt: skip
        run_sim(spec(2, 3, save=str(path), resume=str(path)))
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert read_meta(path).step == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial ckpt.tmp


def test_meta_json_is_plain_data(tmp_path):
    record = json.loads((saved(tmp_path) / "meta.json").read_text())
    assert record["format"] == "cpref-checkpoint/2" and record["model"]["family"] == "llama"
    assert set(record["sha256"]) == {"state.pt", "rng.pt"}
    assert record["payload"] == "torch" and record["settings"] == {"lr": 3e-3, "grad_clip": 1.0, "bf16": False, "pack_tokens": 64}
    assert record["dtype"] == "float32"
    fields = {"step", "dp", "cp", "mode", "layout", "micro_batches", "model", "settings", "payload", "dtype"}
    assert set(record["fields_sha256"]) == fields and set(record) == fields | {"format", "sha256", "fields_sha256"}


# --- save and load on one rank: what is checked, restored and left on disk (mutation run) ---


def meta_of(step=1, dp=1, micro=2, **model_changes):
    m = spec(1, 1, micro=micro).meta(step)
    return replace(m, dp=dp, model={**m.model, **model_changes})


def save_one_rank(directory, step=1, dp=1, micro=2, **kw):
    from cpref.comm.protocol import SingleRank
    from cpref.train.checkpoint import save_checkpoint

    model, opt, _ = fresh()
    return save_checkpoint(directory, model, opt, meta_of(step, dp, micro), SingleRank(), **kw)


def test_a_checkpoint_of_another_format_is_refused(tmp_path):
    path = save_one_rank(tmp_path / "ckpt")
    record = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**record, "format": "cpref-checkpoint/1"}))  # an older cpref's
    with pytest.raises(CPInputError, match=r"not a cpref-checkpoint/2 checkpoint \(its meta.json says format 'cpref-checkpoint/1'\)"):
        read_meta(path)
    (path / "meta.json").write_text("")  # cut short: not JSON at all
    with pytest.raises(CPInputError, match=r"no readable meta.json \(JSONDecodeError"):
        read_meta(path)


def test_a_meta_json_missing_or_adding_fields_is_refused_naming_them(tmp_path):
    """meta.json is read into CheckpointMeta: a missing SHA-256 sum is a mismatch, and a missing or
    unknown field is named (not a KeyError or TypeError from deep inside)."""
    path = save_one_rank(tmp_path / "ckpt")
    record = json.loads((path / "meta.json").read_text())
    for broken, match in (
        ({k: v for k, v in record.items() if k != "sha256"}, "meta.json has no SHA-256 sums"),
        ({k: v for k, v in record.items() if k != "fields_sha256"}, "meta.json has no SHA-256 sums"),
        ({k: v for k, v in record.items() if k != "step"}, r"has the fields \['cp', 'dp', .*expected .*'step'"),
        ({**record, "seed": 1}, r"has the fields .*'seed'"),
        ([record], "not a cpref-checkpoint/2 checkpoint"),
    ):
        (path / "meta.json").write_text(json.dumps(broken))
        with pytest.raises(CPInputError, match=match):
            read_meta(path)


def test_the_model_mismatch_names_only_the_settings_that_differ(tmp_path):
    path = save_one_rank(tmp_path / "ckpt")
    model, opt, before = fresh()
    # the checkpoint has num_layers 2 (the tiny llama), this run says 3: the one differing key
    with pytest.raises(CPInputError, match=r"differ in \{'num_layers': \(2, 3\)\}$"):
        load_checkpoint(path, model, opt, expect=meta_of(num_layers=3))
    assert untouched(model, before)


def test_packs_per_step_is_dp_times_micro_batches_whatever_the_split(tmp_path):
    assert meta_of(dp=2, micro=3).packs_per_step == 6
    path = save_one_rank(tmp_path / "ckpt", dp=2, micro=1)  # 2 x 1 = 2 packs per step
    model, opt, before = fresh()
    with pytest.raises(CPInputError, match="dp x micro_batches = 2 x 1 packs per step, this run takes 2 x 2"):
        load_checkpoint(path, model, opt, expect=meta_of(dp=2, micro=2))
    assert untouched(model, before)
    assert load_checkpoint(path, model, opt, expect=meta_of(dp=1, micro=2)).dp == 2  # 1 x 2: the same data position


def test_loading_restores_the_random_number_generator_state_saved(tmp_path):
    from cpref.comm.protocol import SingleRank
    from cpref.train.checkpoint import save_checkpoint

    model, opt, _ = fresh()
    torch.manual_seed(7)
    saved_state = torch.get_rng_state()
    path = save_checkpoint(tmp_path / "ckpt", model, opt, meta_of(), SingleRank())
    torch.rand(100)  # the run goes on drawing
    load_checkpoint(path, model, opt, expect=meta_of())
    assert torch.equal(torch.get_rng_state(), saved_state)


def test_a_parameter_of_another_shape_is_refused_before_anything_is_loaded(tmp_path):
    from cpref.train.checkpoint import TorchPayload

    model, opt, before = fresh()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    last = list(state)[-1]  # the last parameter: every one is checked, not only the first
    state[last] = torch.zeros(3)
    torch.save({"model": state, "optimizer": opt.state_dict()}, tmp_path / "state.pt")
    want = tuple(before[last].shape)
    with pytest.raises(CPInputError, match=re.escape(f"parameter {last} is (3,), the model has {want}")):
        TorchPayload().load(tmp_path, model, opt)
    assert untouched(model, before)


_trap_sprung = []


class _Trap:
    """Unpickling this calls a function: what a weights-only load must refuse to do."""

    def __reduce__(self):
        return (_trap_sprung.append, ("code ran",))


def test_loading_state_pt_runs_no_code_from_the_file(tmp_path):
    from cpref.train.checkpoint import TorchPayload

    model, opt, before = fresh()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": _Trap()}, tmp_path / "state.pt")
    with pytest.raises(CPInputError, match="state.pt cannot be read"):
        TorchPayload().load(tmp_path, model, opt)
    assert _trap_sprung == [] and untouched(model, before)


def test_saving_again_replaces_the_checkpoint_and_leaves_nothing_beside_it(tmp_path):
    save_one_rank(tmp_path / "ckpt", step=1)
    with pytest.raises(CPInputError, match="holds a checkpoint at step 1 that this run does not continue"):
        save_one_rank(tmp_path / "ckpt", step=2)  # another run's checkpoint is never replaced by accident
    save_one_rank(tmp_path / "ckpt", step=2, resumed=tmp_path / "ckpt")  # the run that continues it
    assert read_meta(tmp_path / "ckpt").step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no ckpt.old, no ckpt.tmp


def test_a_save_after_an_interrupted_one_clears_its_leftovers(tmp_path):
    from cpref.train.checkpoint_files import MARK

    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / MARK).write_text("")  # what a killed save leaves: its mark,
    (tmp_path / "ckpt.tmp" / "half-written.pt").write_bytes(b"\0")  # and half of its payload
    save_one_rank(tmp_path / "ckpt")
    assert set(json.loads((tmp_path / "ckpt" / "meta.json").read_text())["sha256"]) == {"state.pt", "rng.pt"}
    assert read_meta(tmp_path / "ckpt").step == 1
