"""q/k RMSNorm + rope kernels, both ops: the shipped kernels' launch settings, swept.

    pip install -e ".[hopper]"    # on a CUDA machine
    python -m benchmarks.norm_rope_layouts

Both ops (`magi_zoo::rms_norm_rope`, Wan's norm over all heads; `rms_norm_rope_heads`, the
per-head norm of Flux, FLUX.2 and Qwen-Image) load a row flat -- a (rows, head_dim) tile, so
each thread's load is 16 bytes -- and split it into (2j, 2j + 1) pairs in registers
(`engine/kernels/norm_rope.py`). Until b96aba4 they held (pairs, 2) tiles, one 4-byte pair per
load; this script's run at that commit (results/kernels/norm_rope_layouts_h200.json: its
"shipped op" rows are that layout, its "flat" rows candidate kernels of this one, with a
variant that loaded cos/sin once per program, which did not win) is what moved them. It now
writes norm_rope_settings_<card> and sweeps the shipped kernels' own settings -- rows per program and warps for the per-head op,
warps for the all-heads op -- beside the definition compiled by inductor, at Flux.1, FLUX.2
and Wan shapes.

Times are GPU time from CUDA-graph replays (the host's launch cost is not counted; a compiled
region launches these asynchronously); GB/s counts one read of q or k and one write. Each
variant's result is checked against the op's definition.
"""

from __future__ import annotations

import functools

from benchmarks import common

HEAD_SHAPES = {  # name: (text prefix tokens, tokens, heads, head_dim)
    "flux.1 double (512 + 4096)": (512, 4096, 24, 128),
    "flux.1 single (4608 joint)": (0, 4608, 24, 128),
    "flux.2 double (512 + 4080)": (512, 4080, 48, 128),
    "flux.2 single (4592 joint)": (0, 4592, 48, 128),
}
ROW_SHAPES = {  # name: (tokens, heads, head_dim): Wan at 480x832x81 (21 x 30 x 52 latent patches)
    "wan2.1-1.3b (32760 x 12 heads)": (32760, 12, 128),
    "wan2.1-14b (32760 x 40 heads)": (32760, 40, 128),
}


def heads_inputs(dev, t: int, s: int, h: int, d: int):
    """(x, w, prefix, prefix_w, cos, sin) for the per-head op at (text prefix t, tokens s, heads h,
    head_dim d), bf16 with fp32 rotary tables as Flux's (each pair's angle repeated); no prefix
    where t = 0."""
    import torch

    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, s, h, d, device=dev, generator=g).to(torch.bfloat16)
    p = torch.randn(1, t, h, d, device=dev, generator=g).to(torch.bfloat16) if t else None
    w = (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(torch.bfloat16)
    pw = (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(torch.bfloat16) if t else None
    ang = torch.rand(t + s, d // 2, device=dev, generator=g) * 6.28
    return x, w, p, pw, torch.cos(ang).repeat_interleave(2, -1), torch.sin(ang).repeat_interleave(2, -1)


def measure(rows: list[dict], shape: str, variants, want, nbytes: int) -> None:
    """One row per (name, fn) variant (`common.kernel_row`), its error against the definition."""
    rows.extend(common.kernel_row(fn, want, nbytes, "rel_err_vs_definition", shape=shape, variant=variant)
                for variant, fn in variants)


def main(argv=None):
    import torch

    from magi_zoo.engine.kernels import norm_rope

    args, dev, env = common.kernel_bench_start(__doc__, argv)
    rows: list[dict] = []
    heads_ref = torch.compile(norm_rope.reference_heads, fullgraph=True, dynamic=False)
    for name, (t, s, h, d) in HEAD_SHAPES.items():
        x, w, p, pw, cos, sin = heads_inputs(dev, t, s, h, d)
        want = norm_rope.reference_heads(x, w, p, pw, 1e-6, cos, sin)
        nbytes = 2 * 2 * (x.numel() + (p.numel() if p is not None else 0))
        variants = [("inductor (definition compiled)", lambda: heads_ref(x, w, p, pw, 1e-6, cos, sin)),
                    ("shipped op", lambda: norm_rope.rms_norm_rope_heads(x, w, p, pw, 1e-6, cos, sin))]
        variants += [(f"units={units} warps={warps}",
                      functools.partial(norm_rope._launch_heads, x, w, p, pw, 1e-6, cos, sin, units, warps))
                     for units in (2, 4, 8, 16) for warps in (1, 2, 4, 8)]
        measure(rows, name, variants, want, nbytes)
    rows_ref = torch.compile(norm_rope.reference, fullgraph=True, dynamic=False)
    for name, (s, h, d) in ROW_SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(1, s, h * d, device=dev, generator=g).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(h * d, device=dev, generator=g)).to(torch.bfloat16)
        ang = torch.rand(1, s, 1, d, device=dev, generator=g) * 6.28
        cos, sin = torch.cos(ang), torch.sin(ang)
        want = norm_rope.reference(x, w, 1e-6, cos, sin, h)
        variants = [("inductor (definition compiled)", lambda: rows_ref(x, w, 1e-6, cos, sin, h)),
                    ("shipped op", lambda: norm_rope.rms_norm_rope(x, w, 1e-6, cos, sin, h))]
        variants += [(f"warps={warps}", functools.partial(norm_rope._launch, x, w, 1e-6, cos, sin, h, warps))
                     for warps in (2, 4, 8, 16)]
        measure(rows, name, variants, want, 2 * 2 * x.numel())
    write(args, env, rows, "norm_rope_settings", "q/k RMSNorm + rope: the shipped kernels' settings",
          "python -m benchmarks.norm_rope_layouts")


def write(args, env, rows: list[dict], stem: str, title: str, command: str) -> None:
    """The rows as `<stem>_<card>.json` and `.md` under `--out`."""
    common.write_kernel_rows(args, env, rows, stem, title, command,
                             ["shape", "variant", "median_ms", "gb_per_s", "rel_err_vs_definition"])


if __name__ == "__main__":
    main()
