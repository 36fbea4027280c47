"""Flux's per-head q/k RMSNorm + text/image join + rope: inductor vs Triton kernel layouts.

    pip install -e ".[hopper]"    # on a CUDA machine: the fa3-fwd wheel (docs/attention.md)
    python -m benchmarks.norm_rope_heads

At Flux.1-dev's 1024^2 shapes (512 text + 4096 image tokens, 24 heads x 128; the double blocks
join a text prefix, the single blocks' input is already joint), times: the definition
(`norm_rope.reference_heads`, diffusers' ops) compiled by inductor, the shipped op
(`magi_zoo::rms_norm_rope_heads`), and candidate kernel layouts (below) at several rows per
program / warps, GPU time only (CUDA-graph replays). Each variant's result is checked against
the definition; GB/s counts one read of the inputs and one write of the output. CUDA only.

Candidates (a program takes `units` (token, head) rows of head_dim channels):
- "pairs3d" (in the H100 results): a (units, head_dim / 2, 2) tile, tl.split / tl.join on the
  pair axis -- the op's kernel when this ran, since replaced by a flat tile split in registers
  (`norm_rope_layouts.py`: the "shipped op" rows here are that kernel now);
- "partner": a (units, head_dim) tile, each channel's pair partner (c ^ 1) as a second load (an
  L1 hit), the rotation as y * cos + sign * y_partner * sin: no split, join or reshape;
- "pairs2d": a (units * head_dim / 2, 2) tile as Wan's kernel, the per-row sums through a reshape.
"""

from __future__ import annotations

import functools

from benchmarks import common, norm_rope_layouts

SHAPES = {  # name: (text prefix tokens, tokens, heads, head_dim)
    "flux double (512 + 4096)": (512, 4096, 24, 128),
    "flux single (4608 joint)": (0, 4608, 24, 128),
}


@functools.cache
def _candidates():
    import triton
    import triton.language as tl

    @triton.jit
    def partner(x_ptr, w_ptr, p_ptr, pw_ptr, cos_ptr, sin_ptr, out_ptr, n_units, heads, joint, text,
                sxb, sxs, sxh, spb, sps, sph, scs, sss, eps, D: tl.constexpr, BD: tl.constexpr,
                HAS_P: tl.constexpr, UNITS: tl.constexpr):
        u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
        live = u < n_units
        tok = (u // heads) % joint
        b = u // (heads * joint)
        xo = b * sxb + (tok - text) * sxs + (u % heads) * sxh
        po = b * spb + tok * sps + (u % heads) * sph
        col = tl.arange(0, BD)
        cm = col < D
        mate = col ^ 1
        img = tok >= text
        m = (live & img)[:, None] & cm[None, :]
        x = tl.load(x_ptr + xo[:, None] + col[None, :], mask=m, other=0.0).to(tl.float32)
        xm = tl.load(x_ptr + xo[:, None] + mate[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + col, mask=cm, other=0.0).to(tl.float32)[None, :]
        wm = tl.load(w_ptr + mate, mask=cm, other=0.0).to(tl.float32)[None, :]
        if HAS_P:
            mt = (live & (tok < text))[:, None] & cm[None, :]
            x += tl.load(p_ptr + po[:, None] + col[None, :], mask=mt, other=0.0).to(tl.float32)
            xm += tl.load(p_ptr + po[:, None] + mate[None, :], mask=mt, other=0.0).to(tl.float32)
            w = tl.where(img[:, None], w, tl.load(pw_ptr + col, mask=cm, other=0.0).to(tl.float32)[None, :])
            wm = tl.where(img[:, None], wm, tl.load(pw_ptr + mate, mask=cm, other=0.0).to(tl.float32)[None, :])
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        live2 = live[:, None] & cm[None, :]
        c = tl.load(cos_ptr + tok[:, None] * scs + col[None, :], mask=live2, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok[:, None] * sss + col[None, :], mask=live2, other=0.0).to(tl.float32)
        sign = tl.where(col % 2 == 0, -1.0, 1.0)[None, :]
        out = (x * w * c + sign * xm * wm * s) * rstd
        tl.store(out_ptr + u[:, None] * D + col[None, :], out.to(out_ptr.dtype.element_ty), mask=live2)

    @triton.jit
    def pairs2d(x_ptr, w_ptr, p_ptr, pw_ptr, cos_ptr, sin_ptr, out_ptr, n_units, heads, joint, text,
                sxb, sxs, sxh, spb, sps, sph, scs, sss, eps, D: tl.constexpr, HALF: tl.constexpr,
                HAS_P: tl.constexpr, UNITS: tl.constexpr):
        i = tl.arange(0, UNITS * HALF)
        u = tl.program_id(0).to(tl.int64) * UNITS + i // HALF
        j = i % HALF
        live = u < n_units
        tok = (u // heads) % joint
        b = u // (heads * joint)
        xo = b * sxb + (tok - text) * sxs + (u % heads) * sxh
        po = b * spb + tok * sps + (u % heads) * sph
        two = tl.arange(0, 2)
        cols = 2 * j[:, None] + two[None, :]
        img = tok >= text
        x = tl.load(x_ptr + xo[:, None] + cols, mask=(live & img)[:, None], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols).to(tl.float32)
        if HAS_P:
            mt = (live & (tok < text))[:, None]
            x += tl.load(p_ptr + po[:, None] + cols, mask=mt, other=0.0).to(tl.float32)
            w = tl.where(img[:, None], w, tl.load(pw_ptr + cols).to(tl.float32))
        sq = tl.reshape(tl.sum(x * x, axis=1), (UNITS, HALF))
        rstd_u = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / D + eps)
        rstd = tl.reshape(tl.broadcast_to(rstd_u[:, None], (UNITS, HALF)), (UNITS * HALF,))
        y = x * rstd[:, None] * w
        c = tl.load(cos_ptr + tok[:, None] * scs + cols, mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok[:, None] * sss + cols, mask=live[:, None], other=0.0).to(tl.float32)
        ye, yo = tl.split(y)
        ce, co = tl.split(c)
        se, so = tl.split(s)
        out = tl.join(ye * ce - yo * se, yo * co + ye * so)
        tl.store(out_ptr + u[:, None] * D + cols, out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    return {"partner": partner, "pairs2d": pairs2d}


def launch(name: str, x, w, p, pw, eps, cos, sin, units: int, warps: int):
    """Run candidate `name` (weights required; D a power of two)."""
    import torch
    import triton

    b, s, h, d = x.shape
    t = 0 if p is None else p.shape[1]
    out = torch.empty((b, t + s, h, d), dtype=x.dtype, device=x.device)
    n = b * (t + s) * h
    pp, ppw = (p, pw) if p is not None else (x, w)
    width = dict(BD=d) if name == "partner" else dict(HALF=d // 2)
    _candidates()[name][(triton.cdiv(n, units),)](
        x, w, pp, ppw, cos, sin, out, n, h, t + s, t, x.stride(0), x.stride(1), x.stride(2), pp.stride(0),
        pp.stride(1), pp.stride(2), cos.stride(0), sin.stride(0), float(eps), D=d, HAS_P=p is not None,
        UNITS=units, num_warps=warps, **width)
    return out


def main(argv=None):
    import torch

    from magi_zoo.engine.kernels import norm_rope

    args, dev, env = common.kernel_bench_start(__doc__, argv)
    comp = torch.compile(norm_rope.reference_heads, fullgraph=True, dynamic=False)
    rows = []
    for name, (t, s, h, d) in SHAPES.items():
        x, w, p, pw, cos, sin = norm_rope_layouts.heads_inputs(dev, t, s, h, d)
        want = norm_rope.reference_heads(x, w, p, pw, 1e-6, cos, sin)
        nbytes = 2 * 2 * (x.numel() + (p.numel() if p is not None else 0))
        variants = [("inductor (definition compiled)", lambda: comp(x, w, p, pw, 1e-6, cos, sin)),
                    ("shipped op", lambda: norm_rope.rms_norm_rope_heads(x, w, p, pw, 1e-6, cos, sin))]
        variants += [(f"{cand} units={units} warps={warps}",
                      functools.partial(launch, cand, x, w, p, pw, 1e-6, cos, sin, units, warps))
                     for cand in ("partner", "pairs2d") for units in (2, 4, 8, 16, 32) for warps in (2, 4, 8)]
        norm_rope_layouts.measure(rows, name, variants, want, nbytes)
    norm_rope_layouts.write(args, env, rows, "norm_rope_heads", "Flux q/k per-head RMSNorm + join + rope: kernel layouts",
                            "python -m benchmarks.norm_rope_heads")


if __name__ == "__main__":
    main()
