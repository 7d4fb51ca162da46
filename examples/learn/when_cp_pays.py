"""Learn CP, page 9: when CP pays, asked of the planner: the ring's step at
P = 16 against one device's step over P, for one long document and for many
short ones.

Run from the repository root: `.venv/bin/python -m examples.learn.when_cp_pays`.
"""

# --8<-- [start:plan]
from sim.plan import plan

heads = (32, 8, 128, 128)  # (Hq, Hkv, D, Dv): a Llama-3-8B-like layer
P = 16  # two H100 nodes of 8 GPUs
batches = {"one document of 131072 tokens": [131072],
           "256 documents of 512 tokens": [512] * 256}
for name, docs in batches.items():
    one = plan(docs, heads=heads, dtype="bfloat16", P=1, profile="h100-sxm",
               modes=["p2p"], layouts=["zigzag"]).kinds["full"].ranked[0]
    print(f"{name}: one device {one.step * 1e3:.1f} ms, over P "
          f"{one.step / P * 1e3:.2f} ms")
    cp = plan(docs, heads=heads, dtype="bfloat16", P=P, profile="h100-sxm",
              modes=["p2p"], layouts=["zigzag", "stream"]).kinds["full"]
    for p in sorted(cp.ranked, key=lambda p: p.name):
        r = p.slowest  # the rank the others wait for
        print(f"  {p.name}: step {p.step * 1e3:.2f} ms, of which waiting "
              f"{r.exposed * 1e3:.2f} ms")
# --8<-- [end:plan]
