"""Learn CP, page 4: two partial softmaxes, each over half of the keys, merged
exactly by their lse.

Run from the repository root: `.venv/bin/python -m examples.learn.merge`.
"""

# --8<-- [start:merge]
import torch

import cpref
from cpref.kernels.merge import merge_partial

torch.manual_seed(0)
Tq, Tk, H, D = 4, 16, 1, 8  # 4 queries, 16 keys, one head
q = torch.randn(Tq, H, D, dtype=torch.float64)
k, v = (torch.randn(Tk, H, D, dtype=torch.float64) for _ in range(2))
kernel, scale = cpref.TorchKernel(), D**-0.5


def attend(keys: slice):
    """Every query against the keys `keys` only (no mask):
    `(out (Tq, H, D), lse (Tq, H))`."""
    n = len(range(Tk)[keys])
    seqs = cpref.Varlen([0, Tq], [0, n])  # one sequence: Tq queries, n keys
    return kernel.forward(q, k[keys], v[keys], seqs, causal=False, scale=scale)


out, lse = attend(slice(0, Tk))  # the whole row: what we want
out_a, lse_a = attend(slice(0, 8))  # keys 0..7, as one rank would see them
out_b, lse_b = attend(slice(8, 16))  # keys 8..15, as another rank would

# the merge, as a formula: lse' = log(e^lse_a + e^lse_b),
# O' = (e^lse_a O_a + e^lse_b O_b) / e^lse'
lse_m = torch.logaddexp(lse_a, lse_b)  # (Tq, H)
out_m = ((lse_a - lse_m).exp()[..., None] * out_a
         + (lse_b - lse_m).exp()[..., None] * out_b)  # (Tq, H, D)
print(f"query 0: lse_a = {lse_a[0, 0]:.4f}, lse_b = {lse_b[0, 0]:.4f}, "
      f"merged {lse_m[0, 0]:.4f}, whole row {lse[0, 0]:.4f}")
print("formula: largest error of the merged output "
      f"{(out_m - out).abs().max():.1e}")

# cpref's merge, the stable form the ring uses: in place, into the running
# (out_a, lse_a)
merge_partial(out_a, lse_a, out_b, lse_b)
print(f"merge_partial: largest error {(out_a - out).abs().max():.1e}, "
      f"of the lse {(lse_a - lse).abs().max():.1e}")
# --8<-- [end:merge]
