"""Attention forward + backward for training, at real shapes: SDPA's own dispatch (cuDNN on
Hopper; what backend='native' trains with) against the fa3 backend's training path (FA3's
forward kernel, then cuDNN's backward fed with FA3's output and LSE).

    pip install -e ".[hopper]"    # on a CUDA machine: the fa3-fwd wheel (docs/attention.md)
    python -m benchmarks.attention_train

Per shape and kernel: median ms of the forward alone, the backward alone (of one retained
forward) and forward + backward (CUDA events,
warm-up, --runs timed), TFLOP/s of forward + backward (3.5 x the forward's 4*B*H*S*S*D:
the backward is 2.5 forwards of matmul work), and each gradient's relative L2 against an
fp32 SDPA reference on the same inputs (at the Flux shape; the Wan shapes' fp32 reference
would need the math kernel's S^2 memory, so there the columns compare against SDPA bf16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import common

SHAPES = {"wan-1.3b": (1, 32760, 12, 128), "wan-14b": (1, 32760, 40, 128), "flux-1024": (1, 4608, 24, 128)}
KERNELS = ("sdpa", "fa3")


def _rel(a, b) -> float:
    return float(f"{float((a.float() - b.float()).norm() / b.float().norm()):.2e}")


def _time(fn, runs: int) -> float:
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def run(runs: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from magi_zoo.engine.kernels import fa3

    fa3.register()
    rows = []
    for shape, (b, s, h, d) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, go = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

        fns = {"sdpa": sdpa, "fa3": lambda q, k, v: fa3.fa3_attention(q, k, v)}
        ref = None
        if shape == "flux-1024":
            q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
            ref = torch.autograd.grad(sdpa(q32, k32, v32), (q32, k32, v32), go.float())
        grads = {}
        for name in KERNELS:
            fn = fns[name]
            with torch.no_grad():
                fwd = _time(lambda: fn(q, k, v), runs)
            both = _time(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), go), runs)
            o = fn(q, k, v)
            bwd = _time(lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True), runs)
            del o
            grads[name] = torch.autograd.grad(fn(q, k, v), (q, k, v), go)
            flops = 3.5 * 4 * b * h * s * s * d
            rows.append({"shape": shape, "kernel": name, "fwd_ms": round(fwd, 3), "bwd_ms": round(bwd, 3), "fwd_bwd_ms": round(both, 3),
                         "tflops_fwd_bwd": round(flops / both / 1e9, 1)})
        base = ref if ref is not None else grads["sdpa"]
        for r in rows[-len(KERNELS):]:
            r["vs"] = "fp32" if ref is not None else "sdpa bf16"
            r.update({f"rel_d{n}": _rel(a, e) for n, a, e in zip("qkv", grads[r["kernel"]], base)})
        del q, k, v, go, grads, ref
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default=common.results_dir("attention"))
    common.add_commit_argument(p)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    import torch

    rows = run(args.runs)
    env = common.environment(torch.device("cuda"))
    command = "python -m benchmarks.attention_train " + " ".join(sys.argv[1:] if argv is None else argv)
    cols = ["shape", "kernel", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "tflops_fwd_bwd", "vs", "rel_dq", "rel_dk", "rel_dv"]
    md = "\n".join(["# Attention forward + backward (training)", "", common.env_line(env), "",
                    f"command: `{command}`", "", common.results_table(rows, cols)])
    common.publish(Path(args.out), f"attention_train_{common.card_tag(env)}", {"env": env, "command": command,
                                                                                 "rows": rows}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
