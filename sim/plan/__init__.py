"""The planner: which CP mode, layout and options for a batch, a model's heads and a cluster.

* [`sim.plan.dry`][sim.plan.dry]: one rank's step as its mode runs it, counted (the one
  source of every count);
* [`sim.plan.scale`][sim.plan.scale]: the same counts for every rank at once where the plans are
  regular, held to the dry run: a thousand ranks in seconds (measured: `bench/plan.py`);
* [`sim.plan.links`][sim.plan.links]: the bytes of each collective per link level, from the
  ranks' placement on nodes;
* [`sim.plan.profile`][sim.plan.profile]: hardware profiles, one JSON file per machine;
* [`sim.plan.model`][sim.plan.model]: the time model, a rank's counted step priced by a profile;
* [`sim.plan.planner`][sim.plan.planner]: every candidate ranked, the deciding term named;
* [`sim.plan.calibrate`][sim.plan.calibrate]: the `this-machine` profile, measured here;
* [`sim.plan.study`][sim.plan.study]: which mode wins from 8 to 1024 ranks, on the H100 and 910B profiles;
* [`sim.plan.report`][sim.plan.report]: the answer as `python -m sim plan` prints it, with the call to paste.
"""

from sim.plan.planner import Plan, plan
from sim.plan.profile import Profile, load_profile, profile_names

__all__ = ["Plan", "Profile", "load_profile", "plan", "profile_names"]
