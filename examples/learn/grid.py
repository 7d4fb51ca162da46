"""Learn CP, page 11: the DP x CP grid of cpref's training loop, and one step of
DP 2 x CP 2 against the same step on one device.

Run from the repository root: `.venv/bin/python -m examples.learn.grid`.
"""

# --8<-- [start:groups]
from sim import SimCluster
from sim.tools.train import RunSpec, topology

DP, CP = 2, 4


def groups(strided):
    """The CP groups `python -m sim train` makes, and the world they split."""
    spec = RunSpec(dp=DP, cp=CP, strided=strided)
    topos = SimCluster(DP * CP).run(lambda world: topology(world, spec))
    return sorted({t.cp.group for t in topos}), topos[0].world.group


for strided in (False, True):
    cp_groups, world = groups(strided)
    print(f"DP {DP} x CP {CP}, {'strided' if strided else 'consecutive'}: "
          f"CP groups {cp_groups}")
print(f"both: losses and gradients summed over the world {world}")
# --8<-- [end:groups]

# --8<-- [start:step]
import torch

from cpref.models import CausalLM, ModelConfig
from cpref.train import training
from cpref.train.packing import BYTE_VOCAB

MODE = "p2p"  # the CP mode: its collectives run on the CP group
config = ModelConfig(family="llama", vocab_size=BYTE_VOCAB, hidden_size=32,
                     num_layers=2, num_heads=4, num_kv_heads=2)
g = torch.Generator().manual_seed(0)
documents = [torch.randint(0, 256, (n,), generator=g) for n in (40, 70, 25, 90)]


def one_step(topo, micro_batches):
    """The gradients of one training step; no clipping, so they are raw."""
    model = CausalLM(config, seed=0)
    source = training.PackSource(lambda: iter(documents), pack_tokens=64)
    packs = training.step_packs(source, 0, topo, micro_batches)  # this replica's
    train = training.TrainConfig(mode=MODE, micro_batches=micro_batches,
                                 grad_clip=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    training.train_step(model, optimizer, packs, topo, train)
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# DP 2 x CP 2: each replica takes one pack, each rank half of its tokens
cluster = SimCluster(4)
spec = RunSpec(dp=2, cp=2)
grads = cluster.run(lambda world: one_step(topology(world, spec), 1))
# one device: both packs, as two micro-batches
alone = one_step(training.Topology.single(), 2)
diff = max((x - alone).abs().max() for x in grads)
print(f"DP 2 x CP 2 against one device: {len(alone):,} gradients up to "
      f"{alone.abs().max():.1e}, largest difference {diff:.1e}")
# what ran on which group: the world's all-reduces, in train_step's order,
# and the CP groups' ring shifts (attention)
WHAT = ("loss tokens", "gradients", "loss")
reduces = [e for e in cluster.trace if e.op == "all_reduce"]
for what, e in zip(WHAT, reduces, strict=True):
    dtype = str(e.dtype).removeprefix("torch.")
    print(f"all_reduce ({e.param}) on {e.group}: {e.shape[0]:,} {dtype}, "
          f"the {what}")
shifts = {}
for e in cluster.trace:
    if e.op == "send_recv":
        shifts[e.group] = shifts.get(e.group, 0) + 1
for group, n in sorted(shifts.items()):
    print(f"send_recv on {group}: {n} ring shifts, "
          f"{n // config.num_layers} per layer")
# --8<-- [end:step]
