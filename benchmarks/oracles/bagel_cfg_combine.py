"""Oracle: BAGEL's guidance combination and Euler step in the dtypes the official code uses.

Usage::

    python benchmarks/oracles/bagel_cfg_combine.py PATH/TO/ByteDance-Seed/Bagel [OUT.json] [COMMIT]

writes (default) tests/data/bagel_cfg_combine_oracle.json, which
tests/models/bagel/test_bagel_cfg_dtype.py checks `flow.cfg_combine` and `flow.euler_sample`
against.

How the values come from the official code: like bagel_guidance_interval.py, this script does
not import the official model (it needs flash-attn, the official Qwen2 / SigLIP forks and a
GPU build). It reads `modeling/bagel/bagel.py` with `ast` and takes two pieces verbatim: from
`Bagel._forward_flow` the last `if cfg_text_scale > 1.0:` statement (the text guidance, the
image guidance and the renormalisation), and from `Bagel.generate_image`'s step loop the
Euler update (`x_t = x_t - v_t.to(x_t.device) * dts[i]`). It evaluates them on recorded
inputs in the dtypes the official inference has: the three velocities in bfloat16 (the
official app loads the model in bf16 and `Inferencer.interleave_inference` runs under
`torch.autocast("cuda", dtype=torch.bfloat16)`: `llm2vae` returns bf16), `x_t` in float32 (the
noise `torch.randn` draws), `dts[i]` a 0-d float32 tensor.

Autocast: on a CUDA machine the statements run on the GPU under that very autocast. On a CPU
(CPU autocast has another op list) the one op the CUDA autocast changes here is emulated:
`torch.norm` (torch.linalg.vector_norm underneath) is in CUDA autocast's
"fp32, set the output dtype" list (ATen's AT_FORALL_FP32_SET_OPT_DTYPE), so the norms of bf16
velocities are computed and returned in float32; every other op of the statements (add, sub,
mul, div, clamp) is on none of autocast's lists and runs in torch's type promotion, exactly as
under autocast. The script passes the official statements a `torch` whose `norm` upcasts its
input to float32 first; nothing else differs. The recorded `device` says which ran.
"""

from __future__ import annotations

import ast
import json
import sys
import types
from pathlib import Path

import torch

BAGEL_PY = "modeling/bagel/bagel.py"
TOKENS, CHANNELS = 8, 16  # a small packed latent: 8 tokens of 16 channels
CASES = [  # (cfg_renorm_type, cfg_text_scale, cfg_img_scale, cfg_renorm_min)
    (renorm, 4.0, img, 0.0) for renorm in ("global", "channel", "text_channel") for img in (1.0, 1.5)
] + [("global", 4.0, 2.0, 0.5)]


def official_statements(repo: Path):
    """(combination, euler update) compiled from the official source, and their text."""
    tree = ast.parse((repo / BAGEL_PY).read_text())
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    combine = [n for n in fns["_forward_flow"].body if isinstance(n, ast.If) and "cfg_renorm_type" in ast.unparse(n)][-1]
    loop = next(n for n in fns["generate_image"].body if isinstance(n, ast.For))
    step = [n for n in loop.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "x_t"][-1]
    return (compile(ast.Module([combine], []), BAGEL_PY, "exec"), compile(ast.Module([step], []), BAGEL_PY, "exec"),
            ast.unparse(combine), ast.unparse(step))


def cuda_autocast_torch() -> types.ModuleType:
    """`torch` with CUDA autocast's policy for norm: reduced-precision inputs reduce in float32."""
    shim = types.ModuleType("torch")
    shim.__dict__.update(torch.__dict__)
    shim.norm = lambda x, *a, **k: torch.norm(x.float() if x.dtype in (torch.bfloat16, torch.float16) else x, *a, **k)
    return shim


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = {name: (torch.randn(TOKENS, CHANNELS, generator=g) * s).to(torch.bfloat16)
         for name, s in (("v_t", 1.0), ("cfg_text_v_t", 0.8), ("cfg_img_v_t", 0.9))}
    # dt = 5/128: 1 - dt is exact in float32, so a two-step schedule [1, 1 - dt] gives this step size
    return dict(v, x_t=torch.randn(TOKENS, CHANNELS, generator=g), dt=torch.tensor(5 / 128, dtype=torch.float32))


def values(t: torch.Tensor) -> list:
    return t.float().tolist()  # bf16 and fp32 values are exact as Python floats


def run(repo: Path, commit: str = "unknown") -> dict:
    combine, step, combine_src, step_src = official_statements(repo)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    x = {k: v.to(dev) for k, v in inputs().items()}
    ns_torch = torch if cuda else cuda_autocast_torch()
    cases = []
    for renorm, st, si, rmin in CASES:
        ns = dict(torch=ns_torch, v_t=x["v_t"], cfg_text_v_t=x["cfg_text_v_t"], cfg_img_v_t=x["cfg_img_v_t"],
                  cfg_text_scale=st, cfg_img_scale=si, cfg_renorm_type=renorm, cfg_renorm_min=rmin)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            exec(combine, ns)
        v = ns["v_t"]
        ns2 = dict(x_t=x["x_t"], v_t=v, dts=x["dt"].reshape(1), i=0)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            exec(step, ns2)
        cases.append(dict(cfg_renorm_type=renorm, cfg_text_scale=st, cfg_img_scale=si, cfg_renorm_min=rmin,
                          dtype=str(v.dtype), v=values(v), x_next_dtype=str(ns2["x_t"].dtype), x_next=values(ns2["x_t"])))
    return dict(source=f"ByteDance-Seed/Bagel {BAGEL_PY} Bagel._forward_flow / Bagel.generate_image", commit=commit,
                combination=combine_src, euler_update=step_src, device=dev, torch=torch.__version__,
                inputs={k: values(v) for k, v in inputs().items() if k != "dt"}, dt=float(x["dt"]), cases=cases)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    repo = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[2] / "tests/data/bagel_cfg_combine_oracle.json"
    if not (repo / BAGEL_PY).is_file():
        raise SystemExit(f"{str(repo)!r} has no {BAGEL_PY}: pass a checkout of ByteDance-Seed/Bagel")
    out.write_text(json.dumps(run(repo, argv[2] if len(argv) > 2 else "unknown"), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
