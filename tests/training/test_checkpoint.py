"""Checkpoints: resuming at another CP size continues the run exactly; bad checkpoints are refused,
and nothing is overwritten or half-loaded."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from cpref.checkpoint import load_checkpoint, read_meta
from cpref.errors import CPInputError
from cpref.models import CausalLM
from cpref.training import TrainConfig
from sim.train import RunSpec, run_sim

TINY = {"llama": dict(family="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2),
        "gpt2": dict(family="gpt2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, max_positions=128)}  # fmt: skip


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    import sim.train

    monkeypatch.setattr(sim.train, "PRESETS", TINY)


def spec(cp, steps, *, mode="p2p", layout="zigzag", micro=2, **kw) -> RunSpec:
    config = TrainConfig(mode=mode, layout=layout, micro_batches=micro, options={"a2a_size": 2} if mode == "a2a+p2p" else {})
    return RunSpec(model=kw.pop("model", "llama"), cp=cp, steps=steps, pack_tokens=64, train=config, **kw)


def losses(stats):
    return [(s.step, s.loss, s.grad_norm) for s in stats]


@pytest.mark.parametrize("resume_cp, mode", [(1, "all_gather"), (4, "a2a+p2p"), (2, "a2a")])
def test_resuming_at_another_cp_size_continues_the_run_step_for_step(tmp_path, resume_cp, mode):
    whole = losses(run_sim(spec(2, 8)))
    first = losses(run_sim(spec(2, 4, save=str(tmp_path / "ckpt"))))
    rest = losses(run_sim(spec(resume_cp, 8, mode=mode, resume=str(tmp_path / "ckpt"))))
    assert first == whole[:4]  # the same run up to the save
    assert [s for s, *_ in rest] == [4, 5, 6, 7]
    for (step, loss, norm), (_, loss_ref, norm_ref) in zip(rest, whole[4:]):
        assert abs(loss - loss_ref) <= 1e-5 * loss_ref and abs(norm - norm_ref) <= 1e-5 * norm_ref, step
    meta = read_meta(tmp_path / "ckpt")
    assert (meta.step, meta.cp, meta.mode, meta.packs_per_step) == (4, 2, "p2p", 2)


def test_only_rank_0_writes_and_loading_is_weights_only(tmp_path, monkeypatch):
    written = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: written.append(str(f)) or real_save(obj, f, *a, **k))
    run_sim(spec(4, 1, save=str(tmp_path / "ckpt")))
    assert sorted(p.rsplit("/", 1)[1] for p in written) == ["rng.pt", "state.pt"]  # once, not once per rank
    state = torch.load(tmp_path / "ckpt" / "state.pt", weights_only=True)  # no pickled code inside
    assert set(state) == {"model", "optimizer"}


def saved(tmp_path, **kw):
    run_sim(spec(2, 2, save=str(tmp_path / "ckpt"), **kw))
    return tmp_path / "ckpt"


def fresh(model="llama"):
    import sim.train

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
    import cpref.checkpoint

    def broken(self, directory, model, optimizer, world):
        raise OSError("disk full")

    monkeypatch.setattr(cpref.checkpoint.TorchPayload, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        run_sim(spec(2, 3, save=str(path)))
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert read_meta(path).step == 2


def test_meta_json_is_plain_data(tmp_path):
    record = json.loads((saved(tmp_path) / "meta.json").read_text())
    assert record["format"] == "cpref-checkpoint/1" and record["model"]["family"] == "llama"
    assert set(record["sha256"]) == {"state.pt", "rng.pt"}
