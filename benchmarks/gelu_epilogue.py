"""Up projection + GELU(tanh): separate kernels vs cuBLASLt's GELU epilogue, at the models' shapes.

    pip install -e ".[hopper]"    # on a CUDA machine: the fa3-fwd wheel (docs/attention.md)
    python -m benchmarks.gelu_epilogue

Times, per shape (tokens M, in K, out N) of a FeedForward up projection: eager
``gelu(linear(x))`` (a GEMM with a bias epilogue, then one elementwise pass over the M x N
output), the same under ``torch.compile`` (what a compiled region runs today), and
``torch._addmm_activation(bias, x, W^T, use_gelu=True)``, where the bias and the GELU run in
the GEMM's epilogue and the N-wide output is written once. Also: each variant's max and
relative error against an fp32 reference. CUDA only.
"""

from __future__ import annotations


from benchmarks import common

SHAPES = {  # name: (M tokens, K in, N out)
    "wan-1.3b ffn.net.0 (480x832x81)": (32760, 1536, 8960),
    "wan-14b ffn.net.0 (480x832x81)": (32760, 5120, 13824),
    "flux double ff (1024^2)": (4096, 3072, 12288),
    "flux single proj_mlp (1024^2)": (4608, 3072, 12288),
}


def main(argv=None):
    import torch
    import torch.nn.functional as F

    args, dev, env = common.kernel_bench_start(__doc__, argv)
    rows = []
    sep = lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")  # noqa: E731
    comp = torch.compile(sep, fullgraph=True, dynamic=False)
    epi = lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True)  # noqa: E731
    for name, (m, k, n) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * k ** -0.5)
        b = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
        ref = sep(x.float(), w.float(), b.float())
        for variant, fn in (("gelu(linear) eager", sep), ("gelu(linear) compiled", comp), ("_addmm_activation", epi)):
            with torch.no_grad():
                out = fn(x, w, b)
                t = common.time_calls(lambda: fn(x, w, b), dev, warmup=3, runs=20)
            err = (out.float() - ref).norm() / ref.norm()
            tflops = 2 * m * k * n / (t["median_ms"] * 1e-3) / 1e12
            rows.append({"shape": name, "variant": variant, "median_ms": t["median_ms"], "tflops": round(tflops, 1),
                         "rel_err_vs_fp32": float(f"{err.item():.3g}"),
                         "max_abs_err": float(f"{(out.float() - ref).abs().max().item():.3g}")})
            print(rows[-1], flush=True)
    md = (f"# Up projection + GELU(tanh): separate vs cuBLASLt epilogue\n\n{common.env_line(env)}\n\n"
          "command: `python -m benchmarks.gelu_epilogue`\n\n"
          + common.results_table(rows, ["shape", "variant", "median_ms", "tflops", "rel_err_vs_fp32", "max_abs_err"])
          + "\n")
    print(md)
    for p in common.write_results(args.out, f"gelu_epilogue_{common.card_tag(env, True)}", {"environment": env,
                                                                                          "rows": rows}, md):
        print("wrote", p)


if __name__ == "__main__":
    main()
