"""Oracle: Self-Forcing's few-step sampler (schedule, x0 conversion, re-noising), from the official source.

Usage::

    python benchmarks/oracles/self_forcing_sampler.py PATH/TO/guandeh17/Self-Forcing [OUT.json] [COMMIT]

writes (default) tests/data/self_forcing_sampler_oracle.json, which
tests/models/self_forcing/test_self_forcing_sampler.py checks our schedule and the per-step
arithmetic of `SelfForcingPipeline` against.

What runs of the official code (CPU; nothing of it is copied here):
- `utils/scheduler.py` (pure torch) is imported from the checkout: its `FlowMatchScheduler`,
  built and set as `WanDiffusionWrapper.__init__` does (the constructor and `set_timesteps`
  calls are read from `utils/wan_wrapper.py` with `ast` and evaluated, `timestep_shift` from
  `configs/self_forcing_dmd.yaml`), and its `add_noise`, the re-noising between steps;
- the warp of the denoising steps, the `if args.warp_denoising_step:` statements of
  `CausalInferencePipeline.__init__` (`pipeline/causal_inference.py`), evaluated on the
  config's `denoising_step_list`;
- `WanDiffusionWrapper._convert_flow_pred_to_x0` (`utils/wan_wrapper.py`), its source
  compiled and called with the scheduler above (it computes in float64 and returns the flow's
  dtype);
- the step loop's use of them: for each step, x0 from the flow prediction at this step's
  timestep, then `add_noise(x0, fresh noise, next timestep)` as the loop's input for the next.
  The model is replaced by recorded flow predictions (one random tensor per step): the
  sampler's arithmetic is what is checked, the DiT is checked elsewhere.

Importing `utils/wan_wrapper.py` or the pipeline needs the official Wan modules (flash-attn);
neither is imported: only the statements named above are taken from their source.
Recorded for float32 and bfloat16 latents (the published inference runs in bf16).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

WRAPPER_PY, PIPELINE_PY, SCHEDULER_PY = "utils/wan_wrapper.py", "pipeline/causal_inference.py", "utils/scheduler.py"
CONFIG_YAML = "configs/self_forcing_dmd.yaml"
SHAPE = (3, 16, 2, 2)  # three latent frames of one block, 16 channels, 2 x 2


def _yaml_value(text: str, key: str):
    """A top-level scalar or list of the config (the file is plain YAML; no parser needed)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"{key}:"):
            rest = line.split(":", 1)[1].split("#")[0].strip()
            if rest:
                return float(rest) if rest.replace(".", "", 1).isdigit() else rest
            items = []
            for nxt in lines[i + 1:]:
                if not nxt.strip().startswith("-"):
                    break
                items.append(int(nxt.strip()[1:].strip()))
            return items
    raise KeyError(key)


def official_pieces(repo: Path):
    spec = importlib.util.spec_from_file_location("sf_official_scheduler", repo / SCHEDULER_PY)
    sched_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sched_mod)
    cfg = (repo / CONFIG_YAML).read_text()
    shift, steps = _yaml_value(cfg, "timestep_shift"), _yaml_value(cfg, "denoising_step_list")

    wrapper = ast.parse((repo / WRAPPER_PY).read_text())
    cls = next(n for n in wrapper.body if isinstance(n, ast.ClassDef) and n.name == "WanDiffusionWrapper")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    build = [n for n in init.body if "scheduler" in ast.unparse(n) and isinstance(n, (ast.Assign, ast.Expr))]
    ns = dict(FlowMatchScheduler=sched_mod.FlowMatchScheduler, timestep_shift=shift, self=types.SimpleNamespace())
    exec(compile(ast.Module(build, []), WRAPPER_PY, "exec"), ns)
    scheduler = ns["self"].scheduler
    convert = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_convert_flow_pred_to_x0")
    fns: dict = dict(torch=torch)
    exec(compile(ast.Module([convert], []), WRAPPER_PY, "exec"), fns)

    pipe = ast.parse((repo / PIPELINE_PY).read_text())
    pcls = next(n for n in pipe.body if isinstance(n, ast.ClassDef) and n.name == "CausalInferencePipeline")
    pinit = next(n for n in pcls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    warp = [n for n in pinit.body if "denoising_step_list" in ast.unparse(n)]
    pns = dict(torch=torch, self=types.SimpleNamespace(scheduler=scheduler),
               args=types.SimpleNamespace(denoising_step_list=steps, warp_denoising_step=True))
    exec(compile(ast.Module(warp, []), PIPELINE_PY, "exec"), pns)
    return dict(scheduler=scheduler, convert=fns["_convert_flow_pred_to_x0"], steps=pns["self"].denoising_step_list,
                shift=shift, step_list=steps, sources=dict(build="\n".join(ast.unparse(n) for n in build),
                                                           warp="\n".join(ast.unparse(n) for n in warp)))


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(noise=torch.randn(4, *SHAPE, generator=g), flow=torch.randn(4, *SHAPE, generator=g))


def run(repo: Path, commit: str = "unknown") -> dict:
    o = official_pieces(repo)
    sch, convert, steps = o["scheduler"], o["convert"], o["steps"]
    me = types.SimpleNamespace(scheduler=sch)
    x_in = inputs()
    n = SHAPE[0]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        noise, flow = x_in["noise"].to(dtype), x_in["flow"].to(dtype)
        x, x0s, xs = noise[0], [], []
        for i, t in enumerate(steps):
            timestep = torch.ones([n], dtype=torch.int64) * t  # as the loop builds it (batch 1 x frames)
            x0 = convert(me, flow_pred=flow[i], xt=x, timestep=timestep)
            x0s.append(x0.float().flatten().tolist())
            if i < len(steps) - 1:
                x = sch.add_noise(x0, noise[i + 1], steps[i + 1] * torch.ones([n], dtype=torch.long))
                xs.append(x.float().flatten().tolist())
        runs[str(dtype).removeprefix("torch.")] = dict(x0=x0s, renoised=xs, x0_dtype=str(x0.dtype))
    return dict(source=f"guandeh17/Self-Forcing {SCHEDULER_PY} FlowMatchScheduler, {WRAPPER_PY} "
                       f"WanDiffusionWrapper._convert_flow_pred_to_x0, {PIPELINE_PY} warp_denoising_step",
                commit=commit, torch=torch.__version__, config=dict(timestep_shift=o["shift"],
                                                                    denoising_step_list=o["step_list"]),
                statements=o["sources"], shape=list(SHAPE),
                timesteps=[float(t).hex() for t in steps],
                sigmas=[float(sch.sigmas[torch.argmin((sch.timesteps - t).abs())]).hex() for t in steps],
                inputs={k: v.flatten().tolist() for k, v in x_in.items()}, runs=runs)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    repo = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else \
        Path(__file__).resolve().parents[2] / "tests/data/self_forcing_sampler_oracle.json"
    if not (repo / SCHEDULER_PY).is_file():
        raise SystemExit(f"{str(repo)!r} has no {SCHEDULER_PY}: pass a checkout of guandeh17/Self-Forcing")
    out.write_text(json.dumps(run(repo, argv[2] if len(argv) > 2 else "unknown")) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
