"""Which attention backend is fastest for a diffusers denoiser at its real shape?

    python -m benchmarks.attention_backends --model wan2.1-t2v-1.3b

Times one eager forward of the adapter's denoiser (random weights, bf16) under each
diffusers attention backend that can run here, and the same regionally compiled
(`fullgraph=True`) to check that the backend survives compilation. Relative error is
against the default ("native") backend. This is the measurement behind a spec's
`attention_backend` choice.
"""

from __future__ import annotations

import argparse
import traceback

from benchmarks import common

BACKENDS = ("native", "_native_cudnn", "_native_flash", "_native_efficient")


def main(argv=None):
    import torch

    import magi_zoo

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="wan2.1-t2v-1.3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--compiled", default="native,_native_cudnn", help="backends also timed compiled")
    p.add_argument("--out", default=common.results_dir("attention"))
    common.add_commit_argument(p)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h = magi_zoo.load(args.model, gpu="auto" if device.type == "cuda" else "cpu", weights="random",
                      dtype=dtype, device=device, compile=False)
    t = h.adapter.denoiser(h.pipe)
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    rows, ref = [], None
    for compiled in (False, True):
        names = args.compiled.split(",") if compiled else args.backends.split(",")
        for name in names:
            row = {"backend": name, "compiled": compiled}
            try:
                t.set_attention_backend(name)
                fn = t
                if compiled:
                    torch.compiler.reset()
                    t.compile_repeated_blocks(fullgraph=True)
                with torch.no_grad():
                    out, first = common.first_call(lambda: fn(**kw)[0], device)
                    row["first_call_s"] = round(first, 2)
                    row.update(common.time_calls(lambda: fn(**kw), device, warmup=2, runs=5))
                out = out.float()
                if ref is None:
                    ref = out
                row["rel_err_vs_native"] = float(f"{float((out - ref).norm() / ref.norm()):.2e}")
                row["status"] = "ok"
            except Exception as e:
                row.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()
            finally:
                if compiled:  # undo the regional compile before the next backend
                    for b in getattr(t, "blocks", []):
                        b._compiled_call_impl = None
            print(row, flush=True)
            rows.append(row)
    env = common.environment(device)
    md = [f"# Attention backends: {args.model} denoiser forward, {dtype}", "",
          common.env_line(env),
          "", common.results_table(rows, ["backend", "compiled", "status", "median_ms", "min_ms", "max_ms",
                                          "first_call_s", "rel_err_vs_native", "error"])]
    card = env["card"].split()[-1].lower() if device.type == "cuda" else "cpu"
    common.write_results(__import__("pathlib").Path(args.out), f"attention_backends_{args.model}_{card}",
                         {"model": args.model, "env": env, "rows": rows}, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
