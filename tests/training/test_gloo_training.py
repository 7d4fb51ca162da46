"""Training over real gloo processes: the same losses as the simulated cluster, and a
`torch.distributed.checkpoint` that resumes at another CP size; and the DCP payload itself in one process."""

from __future__ import annotations

import pytest

from cpref.train.training import TrainConfig
from sim.tools.launch import launch
from sim.tools.train import RunSpec, _gloo_rank, run_sim

pytestmark = pytest.mark.full  # training on gloo processes: make test-all

TINY = {"llama": dict(family="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)}


def spec(cp, steps, **kw) -> RunSpec:
    return RunSpec(model="llama", cp=cp, steps=steps, pack_tokens=64, train=TrainConfig(mode="p2p", micro_batches=2), **kw)


def gloo_rank_tiny(spec: RunSpec):
    """`sim.tools.train._gloo_rank` with the tiny preset (module level: spawned processes import it)."""
    import sim.tools.train

    sim.tools.train.PRESETS = TINY
    return _gloo_rank(spec)


def test_gloo_training_matches_the_simulated_cluster_and_resumes_from_dcp_at_another_cp_size(tmp_path, monkeypatch):
    import sim.tools.train

    monkeypatch.setattr(sim.tools.train, "PRESETS", TINY)
    whole = [(s.loss, s.grad_norm) for s in run_sim(spec(2, 6))]
    first = launch(gloo_rank_tiny, 2, args=(spec(2, 3, save=str(tmp_path / "ckpt")),), timeout=120)
    assert (tmp_path / "ckpt" / "dcp").is_dir() and (tmp_path / "ckpt" / "meta.json").is_file()
    rest = launch(gloo_rank_tiny, 1, args=(spec(1, 6, resume=str(tmp_path / "ckpt")),), timeout=120)
    got = [(s.loss, s.grad_norm) for s in first[0]] + [(s.loss, s.grad_norm) for s in rest[0]]
    assert [s.step for s in rest[0]] == [3, 4, 5]
    for step, ((loss, norm), (loss_ref, norm_ref)) in enumerate(zip(got, whole)):
        assert loss == pytest.approx(loss_ref, rel=1e-5) and norm == pytest.approx(norm_ref, rel=1e-5), step
    # either format resumes under either payload (was: CheckpointException ranks:dict_keys([0, 1]) or a
    # FileNotFoundError): the gloo (DCP) checkpoint on the simulated cluster, a simulated one on gloo
    on_sim = [(s.loss, s.grad_norm) for s in run_sim(spec(2, 6, resume=str(tmp_path / "ckpt")))]
    run_sim(spec(2, 3, save=str(tmp_path / "sim-ckpt")))
    on_gloo = launch(gloo_rank_tiny, 2, args=(spec(2, 6, resume=str(tmp_path / "sim-ckpt")),), timeout=120)
    for what, stats in (("dcp on sim", on_sim), ("torch on gloo", [(s.loss, s.grad_norm) for s in on_gloo[0]])):
        for step, ((loss, norm), (loss_ref, norm_ref)) in enumerate(zip(stats, whole[3:]), start=3):
            assert loss == pytest.approx(loss_ref, rel=1e-5) and norm == pytest.approx(norm_ref, rel=1e-5), (what, step)


def test_the_command_prints_one_line_per_step(capsys, monkeypatch):
    import sim.tools.train
    from sim.__main__ import main

    monkeypatch.setattr(sim.tools.train, "PRESETS", TINY)
    assert main(["train", "--model", "llama", "--cp", "2", "--mode", "a2a+p2p", "--steps", "3", "--pack-tokens", "64"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[:2] for line in lines] == [["step", "0"], ["step", "1"], ["step", "2"]]
    assert all(line.split()[2::2] == ["loss", "grad_norm", "tokens_per_s"] for line in lines)


def test_every_replica_stays_identical(monkeypatch):
    """Summed gradients and the same update on every rank: DP x CP replicas never drift apart."""
    import torch

    import sim.tools.train
    from cpref.models import CausalLM
    from cpref.train.training import PackSource, train
    from sim import SimCluster

    monkeypatch.setattr(sim.tools.train, "PRESETS", TINY)
    run = RunSpec(model="llama", cp=2, dp=2, steps=3, pack_tokens=64, train=TrainConfig(mode="a2a", micro_batches=1))

    def rank_fn(world):
        topo = sim.tools.train.topology(world, run)
        model = CausalLM(run.model_config(), seed=0)
        train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), PackSource(run.documents, run.pack_tokens), topo, run.train, run.steps)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    states = SimCluster(4).run(rank_fn)
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])
    assert not torch.equal(states[0]["embed.weight"], CausalLM(run.model_config(), seed=0).state_dict()["embed.weight"])


# --- the DCP payload itself, in one process (no process group needed) ---


def adamw_after_one_step(lr):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, no group: as intended here
def test_a_dcp_payload_restores_the_weights_the_optimizer_state_and_its_hyperparameters(tmp_path):
    import torch

    from cpref.train.dcp import DcpPayload

    model, opt = adamw_after_one_step(lr=1e-3)
    DcpPayload().save(tmp_path, model, opt, None)
    other = torch.nn.Linear(3, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=5e-2)  # a fresh run, another learning rate
    DcpPayload().load(tmp_path, other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    saved, loaded = opt.state_dict(), other_opt.state_dict()
    assert [loaded["state"][i]["step"].item() for i in (0, 1)] == [1.0, 1.0]  # one step taken
    assert all(torch.equal(saved["state"][i][k], loaded["state"][i][k]) for i in (0, 1) for k in ("exp_avg", "exp_avg_sq"))
    assert other_opt.param_groups[0]["lr"] == 1e-3  # the checkpoint's, as TorchPayload restores it


def test_a_dcp_payload_passes_its_process_group_and_directory_to_dcp(tmp_path, monkeypatch):
    import cpref.train.dcp as backend

    calls = []
    monkeypatch.setattr(backend.dcp, "save", lambda state, **kw: calls.append(("save", kw)))
    monkeypatch.setattr(backend.dcp, "load", lambda state, **kw: calls.append(("load", kw)))
    group = object()  # stands for a process group: only passed through
    model, opt = adamw_after_one_step(lr=1e-3)
    payload = backend.DcpPayload(group)
    payload.save(tmp_path, model, opt, None)
    payload.load(tmp_path, model, opt)
    want = {"checkpoint_id": str(tmp_path / "dcp"), "process_group": group}
    (verb, save), writer = calls[0], backend._ErrnoWriter  # the writer that keeps each rank's errno (a full disk)
    assert verb == "save" and {k: save[k] for k in want} == want and type(save["storage_writer"]) is writer
    assert str(save["storage_writer"].path) == want["checkpoint_id"]
    (verb, load), readers = calls[1], {"storage_reader": backend.SafeReader, "planner": backend.SafePlanner}
    assert verb == "load" and {k: load[k] for k in want} == want  # and the readers that run no code:
    assert {k: type(load[k]) for k in readers} == readers and str(load["storage_reader"].path) == want["checkpoint_id"]
    backend.DcpPayload(group, local=True).load(tmp_path, model, opt)  # one process alone: no group, no collective
    assert "process_group" not in calls[2][1] and calls[2][1]["no_dist"] is True


def test_a_diverged_run_on_gloo_stops_every_process_in_one_line(capsys):
    """`--lr 3e37` on gloo processes (the gpt2 preset: its step 1 is NaN): every process raises alike, the launcher
    reports it, and the command prints the step's one line and exits with status 1, not a traceback."""
    from sim.__main__ import main

    assert main(["train", "--backend", "gloo", "--model", "gpt2", "--lr", "3e37", "--steps", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m sim train: error: step 1: the loss is nan and the gradients' norm nan")
    assert "Traceback" not in "\n".join(err)
