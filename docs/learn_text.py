"""What the Learn CP pages and the home page say with numbers, computed at build time from cpref.

A hand-written page names a placeholder, `{{ name }}`, and `docs/gen_pages.py` fills it with
`TEXT[name]()`; `{{ output examples/learn/x.py }}` is what that example printed when the site was
built. Every number these functions write comes from cpref's cost model
([`mode_costs`][cpref.api.mode_costs], forward + backward) or from a run, so a page cannot
contradict the reference tables (`docs/tables.py`'s `which_mode`, whose layers these are).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch

import cpref
from cpref.api import mode_costs
from docs.tables import REFERENCE, REFERENCE_T

P_RANGE = (2, 4, 8, 16, 32)  # the CP sizes the rules are stated over
RULE_HQ, RULE_D = 32, 128  # the layer family of the home page's rule: 32 query heads, D = Dv = 128
RULE_G = (1, 2, 4, 8, 16, 32)


def output(path: str) -> str:
    """What `examples/learn/<name>.py` prints, run now."""
    module = path.removesuffix(".py").replace("/", ".")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runpy.run_module(module, run_name="__main__")
    return buf.getvalue().rstrip()


def traffic(mode: str, P: int, heads: tuple[int, int, int, int], tokens: int = REFERENCE_T) -> int | None:
    """Forward + backward bytes per rank and layer in bf16 (cost model), None where the heads cannot be split so."""
    try:
        c = mode_costs(mode, P=P, local_tokens=tokens // P, heads=heads, dtype=torch.bfloat16,
                       **cpref.MODES[mode].example_options(P))  # fmt: skip
    except cpref.CPInputError:
        return None
    return c.forward_bytes + c.backward_bytes


def saved(mode: str, P: int, heads: tuple[int, int, int, int], tokens: int = REFERENCE_T) -> int | None:
    try:
        c = mode_costs(mode, P=P, local_tokens=tokens // P, heads=heads, dtype=torch.bfloat16,
                       **cpref.MODES[mode].example_options(P))  # fmt: skip
    except cpref.CPInputError:
        return None
    return c.saved_bytes


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def ulysses_from(heads: tuple[int, int, int, int]) -> int | None:
    """The smallest P of P_RANGE from which on Ulysses moves less than all-gather wherever it can split the heads
    (None: at no P of the range)."""
    runs = [P for P in P_RANGE if traffic("a2a", P, heads) is not None]
    less = [traffic("a2a", P, heads) < traffic("all_gather", P, heads) for P in runs]
    for i, P in enumerate(runs):
        if all(less[i:]):
            return P
    return None


def rule_of_thumb() -> str:
    """The home page's rule: from which P on Ulysses moves less than all-gather, per GQA group size, forward +
    backward in bf16 (a table), the reference layers' numbers on either side of it, each layer named with its heads
    (a table), and the ring against all-gather."""
    froms = {G: ulysses_from((RULE_HQ, RULE_HQ // G, RULE_D, RULE_D)) for G in RULE_G}
    text = (f"Forward + backward in bf16, with $H_q = {RULE_HQ}$ query heads and $D = D_v = {RULE_D}$, Ulysses moves "
            "less than all-gather from this $P$ on:\n\n"
            "| $G = H_q / H_{kv}$ | " + " | ".join(str(G) for G in RULE_G) + " |\n| --- |" + " --- |" * len(RULE_G) + "\n"
            "| from $P$ = | " + " | ".join(str(P) if P else f"none up to {P_RANGE[-1]}" for P in froms.values()) + " |\n\n"
            f"Two reference layers, per rank and layer at $T$ = {REFERENCE_T:,} tokens, around the $P$ where Ulysses "
            "starts to move less:\n\n| layer | $P$ | `a2a` MiB | `all_gather` MiB |\n| --- | --- | --- | --- |\n")
    for title, heads in REFERENCE.items():
        P = ulysses_from(heads)
        if P is None:
            raise RuntimeError(f"{title}: Ulysses moves less than all-gather at no P; the rule's table needs one")
        for p in P_RANGE[max(0, P_RANGE.index(P) - 1) : P_RANGE.index(P) + 1]:
            text += f"| {title.replace('D = Dv', 'D')} | {p} | {mib(traffic('a2a', p, heads))} | {mib(traffic('all_gather', p, heads))} |\n"
    # the ring against all-gather: one float32 dK/dV block more, everywhere (checked here, stated below)
    for heads in REFERENCE.values():
        for P in P_RANGE[:-1]:
            block = (REFERENCE_T // P) * heads[1] * (heads[2] + heads[3]) * 4
            assert traffic("p2p", P, heads) - traffic("all_gather", P, heads) == block, (heads, P)
    text += ("\nThe ring moves exactly one block of float32 dK/dV more than all-gather at every $P$: its accumulators "
             "take $P$ shifts, all-gather's reduce-scatter $P - 1$ shares.")
    return text


def which_mode_table() -> str:
    """The Learn path's table: forward + backward traffic per rank of every mode, the least in bold."""
    out = []
    modes = list(cpref.MODES)
    header = [m + "".join(f" ({k} {v})" for k, v in cpref.MODES[m].example_options(2).items()) for m in modes]
    for title, heads in REFERENCE.items():
        out += [f"**{title}**, $T$ = {REFERENCE_T:,}, bf16: MiB per rank and layer, forward + backward "
                "(least in bold; `-`: the heads cannot be split so)", "",
                "| P | " + " | ".join(f"`{h}`" for h in header) + " |", "| --- |" + " --- |" * len(modes)]  # fmt: skip
        for P in P_RANGE[:-1]:
            cells = {m: traffic(m, P, heads) for m in modes}
            least = min(c for c in cells.values() if c is not None)
            row = ["-" if c is None else (f"**{mib(c)}**" if c == least else mib(c)) for c in cells.values()]
            out.append(f"| {P} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def which_mode_memory() -> str:
    """One sentence: what each mode saves for the backward at the GQA reference layer, P = 8."""
    title, heads = next(iter(REFERENCE.items()))
    P = 8
    cells = [f"`{m}` {mib(saved(m, P, heads))}" for m in cpref.MODES if saved(m, P, heads) is not None]
    return (f"At the {title.split(':')[0]} layer and $P = {P}$, each rank saves for the backward (MiB): "
            + ", ".join(cells) + ".")


def least_at(kind: str) -> str:
    """'a2a from P = 4 on' for the reference layer whose title starts with `kind`."""
    heads = next(h for title, h in REFERENCE.items() if title.startswith(kind))
    P = ulysses_from(heads)
    return f"from $P = {P}$ on" if P is not None else f"at no $P$ up to {P_RANGE[-1]}"


def balance_rule() -> str:
    """The one statement of which modes the layout's balance concerns (Learn 6, 7 and 12 show it; the reference links
    to it): the sequence-splitting modes' work follows the queries a rank holds, Ulysses' the heads."""
    from cpref.batch.balanced import TOLERANCE

    return ("In the modes that split the sequence (`all_gather`, `p2p`, and the ring of `a2a+p2p`) a rank's work is "
            "the visible pairs of the queries it holds, so the layout decides the balance and the slowest rank sets "
            "the step. Ulysses (`a2a`) splits the heads instead: over the contiguous and zigzag layouts every rank "
            "attends every query for $H_q / P$ heads, so the ranks' work is equal whatever the mask, and over stream "
            "and balanced it keeps the documents a rank holds whole at home and exchanges more of them until no rank "
            f"works more than {TOLERANCE:.0%} above the mean ([its balance](../ulysses-split.md#balance)).")


VERIFY_EXAMPLE = ".venv/bin/python -m sim verify --nproc 2 --peer torch-ring --docs 256 --no-progress"
VERIFY_ADAPTER = (".venv/bin/python -m sim verify --nproc 2 --impl examples/gather_sdpa.py:attention --mode all_gather "
                  "--docs 256 --no-progress")  # fmt: skip


def verify_run(command: str) -> str:
    """A `sim verify` command and what it printed when the site was built (run now, on 2 gloo processes of this
    machine), as two code blocks; a run that does not pass fails the build."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "src")])}
    done = subprocess.run([sys.executable, *command.split()[1:]], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    if done.returncode != 0 or not done.stdout.rstrip().splitlines()[-1].startswith("verification passed"):
        raise RuntimeError(f"{command} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return f"```bash\n{command}\n```\n\n```text\n{done.stdout.rstrip()}\n```"


TEXT = {
    "verify_example": lambda: verify_run(VERIFY_EXAMPLE),
    "verify_adapter_example": lambda: verify_run(VERIFY_ADAPTER),
    "balance_rule": balance_rule,
    "rule_of_thumb": rule_of_thumb,
    "which_mode_table": which_mode_table,
    "which_mode_memory": which_mode_memory,
    "a2a_less_gqa": lambda: least_at("GQA"),
    "a2a_less_mha": lambda: least_at("MHA"),
}


def _pages_text() -> dict:
    """The numbers of pages 9 and 11, written by their own modules (which may use this one's helpers)."""
    from docs import learn_grid, learn_pays

    return {**learn_pays.TEXT, **learn_grid.TEXT}


TEXT.update(_pages_text())
