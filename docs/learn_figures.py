"""Figures of the Learn CP path and the home page, drawn from real runs on the simulated cluster.

Every function runs cpref (`docs/learn_runs.py`: the mode forward and backward on `SimCluster(P)`,
every kernel call and ring shift recorded and identified by its contents) and draws what the run
did; byte counts come from the cluster's trace, costs from cpref's cost model. The functions live
by page: `docs/learn_basics.py` (pages 1 to 4), `docs/learn_ring.py` (page 5, its frames and its
animation) and `docs/learn_modes.py` (pages 6 to 9 and the home page). `FIGURES` maps each site
path to its function; `docs/gen_pages.py` draws them at build time, checks them
(`figures.check_readable`: labels and empty panels) and places each where its page's
`{{ figure PATH }}` marker stands (`HAND_FIGURES`). A path ending in `.gif` is an animation: its
function returns the frames.
"""

from __future__ import annotations

from docs import learn_basics, learn_grid, learn_modes, learn_pays, learn_ring

FIGURES = {
    "figures/learn/movement.png": learn_modes.home_movement,
    "figures/learn/problem.png": learn_basics.problem,
    "figures/learn/collectives.png": learn_basics.collectives,
    "figures/learn/merge.png": learn_basics.merge,
    "figures/learn/all_gather.png": learn_basics.all_gather,
    "figures/learn/ring_frames.png": learn_ring.ring_frames,
    "figures/learn/ring.gif": learn_ring.ring_animation,
    "figures/learn/layouts.png": learn_modes.layouts,
    "figures/learn/ulysses.png": learn_modes.ulysses,
    "figures/learn/hierarchy.png": learn_modes.hierarchy,
    "figures/learn/which_mode.png": learn_modes.which_mode,
    **learn_pays.FIGURES,
    **learn_grid.FIGURES,
}
