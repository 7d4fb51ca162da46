"""Learn CP, page 10: what each mode moves per rank for your own layer, from
cpref's cost model.

Run from the repository root: `.venv/bin/python -m examples.learn.which_mode`.
"""

# --8<-- [start:costs]
import torch

import cpref
from cpref.api import mode_costs

# tokens; (Hq, Hkv, D, Dv): a Llama-3-8B-like layer
T, heads = 131072, (32, 8, 128, 128)
for P in (2, 4, 8):
    cells = []
    for mode, spec in cpref.MODES.items():
        try:
            c = mode_costs(mode, P=P, local_tokens=T // P, heads=heads,
                           dtype=torch.bfloat16, **spec.example_options(P))
        except cpref.CPInputError:  # the heads cannot be split over P ranks so
            continue
        cells.append(
            f"{mode} {(c.forward_bytes + c.backward_bytes) / 2**20:,.0f}")
    print(f"P = {P}, MiB per rank and layer, forward + backward: "
          + ", ".join(cells))
# --8<-- [end:costs]
