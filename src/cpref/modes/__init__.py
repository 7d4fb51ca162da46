"""CP algorithms, one a file, each written against `cpref.comm.protocol` and `cpref.kernels`.

Each mode's file ends with its declaration, a [`ModeSpec`][cpref.modes.spec.ModeSpec] named
`MODE`; `cpref.api` collects every module's `MODE` into `cpref.MODES`. Beside the modes: their
plans (`all_gather_plan`, `ring_plan`), what they share ([`shared`][cpref.modes.shared]) and
the declaration itself ([`spec`][cpref.modes.spec]).
"""
