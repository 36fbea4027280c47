"""FP8 attention on FA3: speed and error of each scaling choice, at the Wan attention shapes.

    pip install -e ".[hopper]"    # on a CUDA machine: the fa3-fwd wheel (docs/attention.md)
    python -m benchmarks.fp8_attention
    python -m benchmarks.fp8_attention --smoke --out /tmp/fp8a     # CPU: error columns only

Rows per shape (B, S, H, D) and input kind:
- ``bf16``: the fa3 backend in bf16 (the baseline);
- ``fp8_tensor``: one scale per tensor for Q, K and V (what an outside experiment measured at
  5.4e-2 per call; docs/precision.md#fp8-attention);
- ``fp8_head``: one scale per (batch, head), no smoothing;
- ``fp8_head_smooth``: per-head scales with K and V smoothed over tokens -- what
  `precision attention="fp8"` runs (`magi_zoo.engine.kernels.fa3.fa3_fp8_attention`), timed
  eagerly (quantization as separate kernels) and under `torch.compile` (quantization fused,
  as inside a compiled block);
- ``fp8_kernel_only``: the fp8 kernel on pre-quantized inputs (the floor).

Input kinds: ``gauss`` (i.i.d. N(0, 1)) and ``offset`` (K and V carry a per-channel offset
shared by all tokens, 4x their spread, and Q a few 8x channels: the structure trained models
have, which is what smoothing is for). Error: relative L2 against fp32 SDPA of the same
inputs. TFLOP/s counts 4*B*H*S*S*D. Timing: CUDA events, warm-up, median (docs/methodology.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import common

SHAPES = {"wan-1.3b": (1, 32760, 12, 128), "wan-14b": (1, 32760, 40, 128)}
SMOKE_SHAPES = {"wan-1.3b": (1, 512, 2, 64)}
KINDS = ("gauss", "offset")


def _inputs(kind: str, shape, device):
    import torch

    b, s, h, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=device, generator=g) for _ in range(3))
    if kind == "offset":
        k = k + 4 * torch.randn(1, 1, h, d, device=device, generator=g)
        v = v + 4 * torch.randn(1, 1, h, d, device=device, generator=g)
        q[..., :4] *= 8
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    return q.to(dt), k.to(dt), v.to(dt)


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float(f"{float((a - b).norm() / b.norm()):.3e}")


def _sdpa32(q, k, v):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _per_tensor(t):
    import torch

    s = (t.float().abs().amax() / 448.0).clamp(min=1e-12)
    q8 = (t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q8, s.reshape(1, 1).expand(t.shape[0], t.shape[2]).contiguous()


def _dequant(t8, s):
    return t8.float() * s[:, None, :, None]


def bench(device, shapes, runs: int, warmup: int) -> list[dict]:
    import torch

    from magi_zoo.engine.kernels import fa3, fp8_scales

    cuda = device.type == "cuda"
    if cuda:
        fa3.register()
    rows = []
    for shape_name, shape in shapes.items():
        b, s, h, d = shape
        flops = 4 * b * h * s * s * d
        for kind in KINDS:
            q, k, v = _inputs(kind, shape, device)
            with torch.no_grad():
                ref = _sdpa32(q, k, v)
                scale = d ** -0.5
                qt, qts = _per_tensor(q)
                kt, kts = _per_tensor(k)
                vt, vts = _per_tensor(v)
                qh, qhs, _ = fp8_scales.quantize_per_head(q, smooth=False)
                kh, khs, _ = fp8_scales.quantize_per_head(k, smooth=False)
                vh, vhs, _ = fp8_scales.quantize_per_head(v, smooth=False)
                ks8, kss, _ = fp8_scales.quantize_per_head(k, smooth=True)
                vs8, vss, vm = fp8_scales.quantize_per_head(v, smooth=True)
                variants = {}
                if cuda:
                    fwd = fa3._forward
                    variants = {
                        "bf16": lambda: fa3.fa3_attention(q, k, v),
                        "fp8_tensor": lambda: fwd(qt, kt, vt, q_descale=qts, k_descale=kts, v_descale=vts,
                                                  softmax_scale=scale)[0],
                        "fp8_head": lambda: fwd(qh, kh, vh, q_descale=qhs, k_descale=khs, v_descale=vhs,
                                                softmax_scale=scale)[0],
                        "fp8_head_smooth": lambda: fa3.fa3_fp8_attention(q, k, v),
                        "fp8_head_smooth_compiled": torch.compile(lambda: fa3.fa3_fp8_attention(q, k, v)),
                        "fp8_kernel_only": lambda: fwd(qh, ks8, vs8, q_descale=qhs, k_descale=kss, v_descale=vss,
                                                       softmax_scale=scale)[0],
                    }
                else:  # CPU: the same quantization, dequantized, through fp32 SDPA (error only)
                    variants = {
                        "fp8_tensor": lambda: _sdpa32(_dequant(qt, qts), _dequant(kt, kts), _dequant(vt, vts)),
                        "fp8_head": lambda: _sdpa32(_dequant(qh, qhs), _dequant(kh, khs), _dequant(vh, vhs)),
                        "fp8_head_smooth": lambda: fp8_scales.fp8_reference(q, k, v),
                    }
                for name, fn in variants.items():
                    row = {"shape": shape_name, "inputs": kind, "variant": name, "B": b, "S": s, "H": h, "D": d}
                    try:
                        out = fn()
                        if name == "fp8_kernel_only":
                            out = out.float() + vm
                        row["rel_err_vs_fp32"] = _rel(out, ref)
                        del out
                        if cuda:
                            row.update(common.time_calls(fn, device, warmup=warmup, runs=runs))
                            row["tflops"] = float(f"{flops / (row['median_ms'] / 1e3) / 1e12:.4g}")
                        row["status"] = "ok"
                    except Exception as e:
                        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    rows.append(row)
                    print("[bench]", {k_: v_ for k_, v_ in row.items() if k_ != "times_ms"}, flush=True)
            del q, k, v, ref
            if cuda:
                torch.cuda.empty_cache()
    return rows


def main(argv=None):
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=common.results_dir("attention"))
    common.add_commit_argument(ap)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, error columns only")
    args = ap.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    env = common.environment(device)
    rows = bench(device, SMOKE_SHAPES if device.type == "cpu" else SHAPES, args.runs, args.warmup)
    cols = ["shape", "inputs", "variant", "median_ms", "tflops", "rel_err_vs_fp32", "status"]
    md = f"# FP8 attention on FA3\n\n{common.env_line(env)}\n\n{common.results_table(rows, cols)}\n"
    stem = "fp8_attention_smoke" if device.type == "cpu" else f"fp8_attention_{common.card_tag(env, True)}"
    for p in common.write_results(args.out, stem, {"environment": env, "rows": rows}, md):
        print("wrote", p)


if __name__ == "__main__":
    main()
