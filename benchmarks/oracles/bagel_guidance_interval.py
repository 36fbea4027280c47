"""Oracle: BAGEL's timestep schedule and guidance decisions, from the official source.

Usage::

    python benchmarks/oracles/bagel_guidance_interval.py PATH/TO/ByteDance-Seed/Bagel [OUT.json] [COMMIT]

writes (default) tests/data/bagel_guidance_oracle.json, which tests/models/bagel/test_bagel_guidance.py
checks our sampler against.

How the values come from the official code: importing the official `modeling/bagel/bagel.py`
needs the official environment (flash-attn, its Qwen2/SigLIP forks, a GPU build); this script
does not import it. It reads `Bagel.generate_image` from that file with `ast`, takes the
statements that compute the schedule (`timesteps = torch.linspace(...)`, the shift, `dts`,
the `timesteps[:-1]` cut) and the condition of the `if` inside the step loop that decides
whether a step is guided (`t > cfg_interval[0] and t <= cfg_interval[1]`), and evaluates those
very expressions with torch on the CPU: float32, as the official code computes them (its
`linspace` takes torch's default dtype; `t` is a 0-d float32 tensor compared with Python
floats). Nothing of the official file is copied here; a change to its arithmetic changes
what this script writes. The official code computes on `x_t.device` (a GPU in practice);
the recorded values are the CPU's.

Cases: every combination the official app's sliders allow (num_timesteps 10..100 step 5,
timestep_shift 1.0..5.0 step 0.5, cfg_interval [lo, 1.0] with lo 0.0..1.0 step 0.1, the
end fixed at 1.0 by the app) plus custom interval ends [0.0, hi] (the inferencer accepts
them), each recorded as the half-open range of guided step indices (the schedule falls
monotonically, so the guided steps are one run); and full schedules (float.hex) for the
named boundary cases: the app's defaults, its timestep slider at 45, 11 steps with shift 1.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import torch

BAGEL_PY = "modeling/bagel/bagel.py"
NAMED = {  # name -> (num_timesteps, timestep_shift, cfg_interval)
    "app_text_to_image_defaults": (50, 3.0, [0.4, 1.0]),
    "app_edit_defaults": (50, 3.0, [0.0, 1.0]),
    "app_timestep_slider_45": (45, 3.0, [0.4, 1.0]),
    "steps_11_shift_1": (11, 1.0, [0.4, 1.0]),
}


def official_arithmetic(repo: Path):
    """(schedule statements, guidance condition) compiled from the official generate_image."""
    tree = ast.parse((repo / BAGEL_PY).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "generate_image")
    loop = next(n for n in fn.body if isinstance(n, ast.For))
    sched = [n for n in fn.body[:fn.body.index(loop)] if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id in ("timesteps", "dts") for t in n.targets)]
    cond = next(n.test for n in ast.walk(loop) if isinstance(n, ast.If)
                and "cfg_interval" in ast.unparse(n.test))
    src = "\n".join(ast.unparse(n) for n in sched)
    return compile(src, BAGEL_PY, "exec"), compile(ast.Expression(cond), BAGEL_PY, "eval"), src, ast.unparse(cond)


def run(repo: Path, commit: str = "unknown") -> dict:
    sched, cond, sched_src, cond_src = official_arithmetic(repo)

    def schedule(n: int, shift: float):
        ns = dict(torch=torch, num_timesteps=n, timestep_shift=shift, x_t=torch.zeros(1))
        exec(sched, ns)
        return ns["timesteps"], ns["dts"]

    def guided(ts, interval):
        return [bool(eval(cond, dict(t=t, cfg_interval=interval))) for t in ts]

    def run_of(flags):
        idx = [i for i, g in enumerate(flags) if g]
        assert idx == list(range(idx[0], idx[-1] + 1)) if idx else True
        return [idx[0], idx[-1] + 1] if idx else [0, 0]

    named = {}
    for name, (n, shift, interval) in NAMED.items():
        ts, dts = schedule(n, shift)
        named[name] = dict(num_timesteps=n, timestep_shift=shift, cfg_interval=interval,
                           timesteps=[float(t).hex() for t in ts], dts=[float(d).hex() for d in dts],
                           guided=guided(ts, interval))
    sweep = []
    for n in range(10, 101, 5):
        for k in range(9):
            shift = 1.0 + 0.5 * k
            ts, _ = schedule(n, shift)
            intervals = [[round(0.1 * i, 1), 1.0] for i in range(11)] + [[0.0, round(0.1 * i, 1)] for i in range(1, 10)]
            for interval in intervals:
                sweep.append([n, shift, interval, run_of(guided(ts, interval))])
    return dict(source=f"ByteDance-Seed/Bagel {BAGEL_PY} Bagel.generate_image", commit=commit,
                schedule_statements=sched_src, guidance_condition=cond_src, dtype=str(torch.get_default_dtype()),
                torch=torch.__version__, named=named, sweep=sweep)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    repo = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[2] / "tests/data/bagel_guidance_oracle.json"
    if not (repo / BAGEL_PY).is_file():
        raise SystemExit(f"{str(repo)!r} has no {BAGEL_PY}: pass a checkout of ByteDance-Seed/Bagel")
    data = run(repo, argv[2] if len(argv) > 2 else "unknown")
    sweep = data.pop("sweep")
    # one sweep case a line: [num_timesteps, timestep_shift, cfg_interval, [first guided, end)]
    text = json.dumps(data, indent=1)[:-2] + ',\n "sweep": [\n' + ",\n".join(map(json.dumps, sweep)) + "\n ]\n}\n"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
