"""The training page's figure: loss curves of the same run at CP = 1 and CP = 4, drawn from real runs.

Both runs train the same small LLaMA-style model on the same packs of standard-library text
(`python -m sim train` on the simulated cluster, ring attention, zigzag); the lower panel is
their relative difference, which the test suite bounds by 1e-5 over 10 steps.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from matplotlib.figure import Figure

from cpref.training import TrainConfig
from sim.tools.train import RunSpec, run_sim


def _base():
    spec = importlib.util.spec_from_file_location("cpref_docs_figures_base2", Path(__file__).with_name("figures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


base = _base()
STEPS, PACK = 30, 256


def parity() -> Figure:
    """`figures/parity.png`: loss per step at CP = 1 and CP = 4, and their relative difference."""
    runs = {}
    for label, cp, mode in (("CP = 1", 1, "all_gather"), ("CP = 4, ring (p2p), zigzag", 4, "p2p")):
        spec = RunSpec(model="llama", cp=cp, steps=STEPS, pack_tokens=PACK, train=TrainConfig(mode=mode, micro_batches=2))
        runs[label] = [s.loss for s in run_sim(spec)]
    fig, (top, bottom) = base.plt.subplots(2, 1, figsize=(base.WIDTH, 5.2), sharex=True, height_ratios=[3, 1.4],
                                           constrained_layout=True)  # fmt: skip
    (one, one_loss), (four, four_loss) = runs.items()
    top.plot(range(STEPS), one_loss, color="0.2", linewidth=3, label=one)
    top.plot(range(STEPS), four_loss, color=base.rank_color(1), linestyle="--", linewidth=1.8, label=four)
    top.set_ylabel("loss (nats per token)")
    top.legend(frameon=False)
    top.set_title(f"The same training run on 1 and on 4 ranks ({PACK}-token packs, 2 per step)", loc="left")
    rel = [abs(a - b) / a for a, b in zip(four_loss, one_loss)]
    bottom.semilogy(range(STEPS), [max(r, 1e-12) for r in rel], color=base.rank_color(1), marker="o", markersize=3)
    bottom.axhline(1e-5, color="0.5", linewidth=1)
    bottom.text(STEPS - 1, 7e-6, "1e-5: the tested bound", va="top", ha="right", color="0.35")
    bottom.set_ylabel("relative difference")
    bottom.set_xlabel("step")
    return fig


FIGURES = {"figures/parity.png": parity}
