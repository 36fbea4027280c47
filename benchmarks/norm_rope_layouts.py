"""q/k RMSNorm + rope kernels, both ops: the shipped layouts against "flat" tiles.

    pip install -e ".[hopper]"    # on a CUDA machine
    python -m benchmarks.norm_rope_layouts

`norm_rope_heads.py` compared tile layouts for the per-head op at Flux.1's shapes on an H100;
its winner (a (units, head_dim / 2, 2) tile of pairs) ran at ~2.1 TB/s there and ~2.0 on an
H200 inside a Flux forward (3.24 ms for 114 calls). This script asked whether a tile loaded
flat -- (rows, head_dim), contiguous, so each thread's load is 16 bytes instead of one 4-byte
pair -- and split into pairs in registers (`tl.reshape` + `tl.split`) moves more bytes per
second, for the per-head op (Flux, FLUX.2, Qwen-Image) and the all-heads op (Wan: the norm
over heads x head_dim). Also tried: loading cos/sin once per program when its rows share one
token (heads divisible by the rows per program), instead of once per row. It did: both ops now
load flat (`engine/kernels/norm_rope.py`); the previous kernels are kept here as the
"pairs" rows, so the comparison reruns.

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


@functools.cache
def _candidates():
    import triton
    import triton.language as tl

    @triton.jit
    def heads_flat(x_ptr, w_ptr, p_ptr, pw_ptr, cos_ptr, sin_ptr, out_ptr, n_units, heads, joint, text,
                   sxb, sxs, sxh, spb, sps, sph, scs, sss, eps, D: tl.constexpr, HAS_W: tl.constexpr,
                   HAS_P: tl.constexpr, UNITS: tl.constexpr, SAME_TOKEN: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        u = pid * UNITS + tl.arange(0, UNITS)
        live = u < n_units
        h = u % heads
        tok = (u // heads) % joint
        b = u // (heads * joint)
        col = tl.arange(0, D)
        img = tok >= text
        x_off = b * sxb + (tok - text) * sxs + h * sxh
        x = tl.load(x_ptr + x_off[:, None] + col[None, :], mask=(live & img)[:, None], other=0.0).to(tl.float32)
        if HAS_P:
            p_off = b * spb + tok * sps + h * sph
            x += tl.load(p_ptr + p_off[:, None] + col[None, :], mask=(live & (tok < text))[:, None],
                         other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None]
        if HAS_W:
            w = tl.load(w_ptr + col).to(tl.float32)[None, :]
            if HAS_P:
                w = tl.where(img[:, None], w, tl.load(pw_ptr + col).to(tl.float32)[None, :])
            y = y * w
        if SAME_TOKEN:
            t0 = (pid * UNITS // heads) % joint
            c = tl.load(cos_ptr + t0 * scs + col).to(tl.float32)[None, :]
            s = tl.load(sin_ptr + t0 * sss + col).to(tl.float32)[None, :]
            ce, co = tl.split(tl.reshape(c, (1, D // 2, 2)))
            se, so = tl.split(tl.reshape(s, (1, D // 2, 2)))
        else:
            c = tl.load(cos_ptr + tok[:, None] * scs + col[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + tok[:, None] * sss + col[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            ce, co = tl.split(tl.reshape(c, (UNITS, D // 2, 2)))
            se, so = tl.split(tl.reshape(s, (UNITS, D // 2, 2)))
        ye, yo = tl.split(tl.reshape(y, (UNITS, D // 2, 2)))
        out = tl.reshape(tl.join(ye * ce - yo * se, yo * co + ye * so), (UNITS, D))
        tl.store(out_ptr + u[:, None] * D + col[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def rows_flat(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, tokens, heads, sx, scs, sss, eps,
                  D: tl.constexpr, HP: tl.constexpr, HAS_W: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tok = row % tokens
        hh = tl.arange(0, HP)
        col = tl.arange(0, D)
        m = (hh < heads)[:, None]
        offs = hh[:, None] * D + col[None, :]
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (heads * D) + eps)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        ce, _co = tl.split(tl.reshape(tl.load(cos_ptr + tok * scs + col).to(tl.float32), (D // 2, 2)))
        _se, so = tl.split(tl.reshape(tl.load(sin_ptr + tok * sss + col).to(tl.float32), (D // 2, 2)))
        ye, yo = tl.split(tl.reshape(y, (HP, D // 2, 2)))
        out = tl.reshape(tl.join(ye * ce[None, :] - yo * so[None, :], ye * so[None, :] + yo * ce[None, :]), (HP, D))
        tl.store(out_ptr + row * (heads * D) + offs, out.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def pairs_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, tokens, n, half_d, sx, scs, sss, so, eps,
                         HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tok = row % tokens
        p = tl.arange(0, BLOCK)  # pair index within the row
        two = tl.arange(0, 2)
        cols = 2 * p[:, None] + two[None, :]  # (BLOCK, 2): channels 2p, 2p + 1
        mask = cols < n
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / n + eps)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        ye, yo = tl.split(y)
        j = p % half_d  # pair index within the head
        pm = 2 * p < n
        c = tl.load(cos_ptr + tok * scs + 2 * j, mask=pm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok * sss + 2 * j + 1, mask=pm, other=0.0).to(tl.float32)
        out = tl.join(ye * c - yo * s, ye * s + yo * c)
        tl.store(out_ptr + row * so + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def pairs_heads(x_ptr, w_ptr, p_ptr, pw_ptr, cos_ptr, sin_ptr, out_ptr, n_units, heads, joint, text,
                              sxb, sxs, sxh, spb, sps, sph, scs, sss, eps, D: tl.constexpr, HALF: tl.constexpr,
                              HAS_W: tl.constexpr, HAS_P: tl.constexpr, UNITS: tl.constexpr):
        u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
        live = u < n_units
        h = u % heads
        tok = (u // heads) % joint
        b = u // (heads * joint)
        p = tl.arange(0, HALF)
        two = tl.arange(0, 2)
        cols = 2 * p[:, None] + two[None, :]  # (HALF, 2): channels 2j, 2j + 1
        cmask = (cols < D)[None, :, :]
        img = tok >= text
        m_img = (live & img)[:, None, None] & cmask
        x_off = b * sxb + (tok - text) * sxs + h * sxh
        x = tl.load(x_ptr + x_off[:, None, None] + cols[None, :, :], mask=m_img, other=0.0).to(tl.float32)
        if HAS_P:
            m_txt = (live & (tok < text))[:, None, None] & cmask
            p_off = b * spb + tok * sps + h * sph
            x += tl.load(p_ptr + p_off[:, None, None] + cols[None, :, :], mask=m_txt, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / D + eps)
        y = x * rstd[:, None, None]
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :, :]
            if HAS_P:
                pw = tl.load(pw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :, :]
                w = tl.where(img[:, None, None], w, pw)
            y = y * w
        rope = (live[:, None, None] & cmask)
        c = tl.load(cos_ptr + tok[:, None, None] * scs + cols[None, :, :], mask=rope, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok[:, None, None] * sss + cols[None, :, :], mask=rope, other=0.0).to(tl.float32)
        ye, yo = tl.split(y)
        ce, co = tl.split(c)
        se, so = tl.split(s)
        out = tl.join(ye * ce - yo * se, yo * co + ye * so)
        tl.store(out_ptr + u[:, None, None] * D + cols[None, :, :], out.to(out_ptr.dtype.element_ty), mask=rope)

    return heads_flat, rows_flat, pairs_rows, pairs_heads


def launch_pairs_heads(x, w, p, pw, eps, cos, sin, units: int = 4, warps: int = 2):
    """The per-head op's previous kernel: a (units, head_dim / 2, 2) tile of 4-byte pair loads (its
    shipped setting: 4 rows of 128 on 2 warps)."""
    import torch
    import triton

    b, s, h, d = x.shape
    t = 0 if p is None else p.shape[1]
    out = torch.empty((b, t + s, h, d), dtype=x.dtype, device=x.device)
    n = b * (t + s) * h
    pp, ppw = (p, pw) if p is not None else (x, w)
    _candidates()[3][(triton.cdiv(n, units),)](
        x, w, pp, ppw, cos, sin, out, n, h, t + s, t, x.stride(0), x.stride(1), x.stride(2), pp.stride(0),
        pp.stride(1), pp.stride(2), cos.stride(0), sin.stride(0), float(eps), D=d, HALF=triton.next_power_of_2(d // 2),
        HAS_W=True, HAS_P=p is not None, UNITS=units, num_warps=warps)
    return out


def launch_pairs_rows(x, w, eps, cos, sin, heads: int):
    """The all-heads op's previous kernel: one row per program as a (pairs, 2) tile."""
    import torch
    import triton

    b, s, n = x.shape
    x2 = x.reshape(b * s, n)
    cos2, sin2 = cos.reshape(s, -1), sin.reshape(s, -1)
    out = torch.empty((b, s, heads, n // heads), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n // 2)
    _candidates()[2][(b * s,)](x2, w, cos2, sin2, out, s, n, n // heads // 2, x2.stride(0), cos2.stride(0),
                               sin2.stride(0), n, float(eps), HAS_W=True, BLOCK=block,
                               num_warps=4 if block <= 1024 else 8)
    return out


def launch_heads_flat(x, w, p, pw, eps, cos, sin, units: int, warps: int, same_token: bool):
    import torch
    import triton

    b, s, h, d = x.shape
    t = 0 if p is None else p.shape[1]
    out = torch.empty((b, t + s, h, d), dtype=x.dtype, device=x.device)
    n = b * (t + s) * h
    pp, ppw = (p, pw) if p is not None else (x, w)
    _candidates()[0][(triton.cdiv(n, units),)](
        x, w, pp, ppw, cos, sin, out, n, h, t + s, t, x.stride(0), x.stride(1), x.stride(2), pp.stride(0),
        pp.stride(1), pp.stride(2), cos.stride(0), sin.stride(0), float(eps), D=d, HAS_W=True, HAS_P=p is not None,
        UNITS=units, SAME_TOKEN=same_token, num_warps=warps)
    return out


def launch_rows_flat(x, w, eps, cos, sin, heads: int, warps: int):
    import torch
    import triton

    b, s, n = x.shape
    d = n // heads
    out = torch.empty((b, s, heads, d), dtype=x.dtype, device=x.device)
    cos2, sin2 = cos.reshape(s, -1), sin.reshape(s, -1)
    _candidates()[1][(b * s,)](x, w, cos2, sin2, out, s, heads, x.stride(1), cos2.stride(0), sin2.stride(0),
                               float(eps), D=d, HP=triton.next_power_of_2(heads), HAS_W=True, num_warps=warps)
    return out


def _measure(rows, shape, variants, want, nbytes):
    import torch
    import triton.testing

    for variant, fn in variants:
        try:
            with torch.no_grad():
                got = fn()
                err = float(((got.float() - want.float()).norm() / want.float().norm()).item())
                ms = triton.testing.do_bench_cudagraph(fn, rep=40)
        except Exception as e:  # a candidate that does not compile is a row, not a crash
            rows.append({"shape": shape, "variant": variant, "median_ms": None, "gb_per_s": None,
                         "rel_err_vs_definition": f"{type(e).__name__}: {str(e)[:80]}"})
            continue
        rows.append({"shape": shape, "variant": variant, "median_ms": round(ms, 4),
                     "gb_per_s": round(nbytes / (ms * 1e-3) / 1e9), "rel_err_vs_definition": float(f"{err:.3g}")})
        print(rows[-1], flush=True)


def main(argv=None):
    import torch

    from magi_zoo.engine.kernels import norm_rope

    args, dev, env = common.kernel_bench_start(__doc__, argv)
    rows: list[dict] = []
    heads_ref = torch.compile(norm_rope.reference_heads, fullgraph=True, dynamic=False)
    for name, (t, s, h, d) in HEAD_SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(1, s, h, d, device=dev, generator=g).to(torch.bfloat16)
        p = torch.randn(1, t, h, d, device=dev, generator=g).to(torch.bfloat16) if t else None
        w = (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(torch.bfloat16)
        pw = (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(torch.bfloat16) if t else None
        ang = torch.rand(t + s, d // 2, device=dev, generator=g) * 6.28
        cos, sin = torch.cos(ang).repeat_interleave(2, -1), torch.sin(ang).repeat_interleave(2, -1)
        want = norm_rope.reference_heads(x, w, p, pw, 1e-6, cos, sin)
        nbytes = 2 * 2 * (x.numel() + (p.numel() if p is not None else 0))
        variants = [("inductor (definition compiled)", lambda: heads_ref(x, w, p, pw, 1e-6, cos, sin)),
                    ("shipped op", lambda: norm_rope.rms_norm_rope_heads(x, w, p, pw, 1e-6, cos, sin)),
                    ("pairs (the op's previous kernel)", lambda: launch_pairs_heads(x, w, p, pw, 1e-6, cos, sin))]
        for units in (2, 4, 8, 16):
            for warps in (1, 2, 4, 8):
                for same in (True, False):
                    if same and h % units:
                        continue
                    variants.append((f"flat units={units} warps={warps}{' cos once' if same else ''}",
                                     functools.partial(launch_heads_flat, x, w, p, pw, 1e-6, cos, sin, units, warps,
                                                       same)))
        _measure(rows, name, variants, want, nbytes)
    rows_ref = torch.compile(norm_rope.reference, fullgraph=True, dynamic=False)
    for name, (s, h, d) in ROW_SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(1, s, h * d, device=dev, generator=g).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(h * d, device=dev, generator=g)).to(torch.bfloat16)
        ang = torch.rand(s, d // 2, device=dev, generator=g) * 6.28
        cos = torch.cos(ang).repeat_interleave(2, -1).reshape(1, s, 1, d)
        sin = torch.sin(ang).repeat_interleave(2, -1).reshape(1, s, 1, d)
        want = norm_rope.reference(x, w, 1e-6, cos, sin, h)
        variants = [("inductor (definition compiled)", lambda: rows_ref(x, w, 1e-6, cos, sin, h)),
                    ("shipped op", lambda: norm_rope.rms_norm_rope(x, w, 1e-6, cos, sin, h)),
                    ("pairs (the op's previous kernel)", lambda: launch_pairs_rows(x, w, 1e-6, cos, sin, h))]
        for warps in (2, 4, 8, 16):
            variants.append((f"flat warps={warps}", functools.partial(launch_rows_flat, x, w, 1e-6, cos, sin, h,
                                                                      warps)))
        _measure(rows, name, variants, want, 2 * 2 * x.numel())
    md = (f"# q/k RMSNorm + rope: shipped layouts against flat tiles\n\n{common.env_line(env)}\n\n"
          "command: `python -m benchmarks.norm_rope_layouts`\n\n"
          + common.results_table(rows, ["shape", "variant", "median_ms", "gb_per_s", "rel_err_vs_definition"]) + "\n")
    for path in common.write_results(args.out, f"norm_rope_layouts_{common.card_tag(env)}", {"env": env, "rows": rows},
                                     md):
        print("wrote", path)


if __name__ == "__main__":
    main()
