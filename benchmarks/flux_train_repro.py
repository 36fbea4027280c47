"""Flux.1-dev eager + full checkpointing: where the "CUDA error: an illegal memory access" comes from.

The training benchmark's `eager_full` row for flux.1-dev (blocks eager, full checkpointing,
attention through torch SDPA's own dispatch) died with an illegal memory access, while
`regional_full` -- the same blocks and attention, compiled -- ran. An illegal access poisons
the CUDA context, so every case below runs in a fresh process and is reported on its own:

    python -m benchmarks.flux_train_repro                 # all stages, on one CUDA card
    python -m benchmarks.flux_train_repro --stages sdpa   # one stage

Stages, smallest first (each case: ok, or the error's first line and the op it names, with
CUDA_LAUNCH_BLOCKING=1 so the failing kernel is the one reported):

- sdpa: `F.scaled_dot_product_attention` alone at Flux's joint shape (1 x 24 heads x 4,608
  tokens x 128, bf16), q/k/v in the layout diffusers' native backend hands it (a
  (batch, tokens, heads, dim) tensor transposed: not contiguous), the gradient coming back
  through `transpose(1, 2).flatten(2)` and a linear as in the block; once per SDPA backend
  (default dispatch, cuDNN, flash, efficient) and once more under a non-reentrant
  checkpoint (the backward then runs on the recomputed output);
- block: one diffusers FluxTransformerBlock and one FluxSingleTransformerBlock at Flux.1-dev's
  size, random bf16 weights, eager, under `torch.utils.checkpoint` (non-reentrant), forward +
  backward; with SDPA's default dispatch and with cuDNN attention switched off;
- model: the benchmark's own `eager_full` build of flux.1-dev (`benchmarks.train.build`), one
  step; with the default dispatch, with cuDNN attention off, and with the default dispatch in a
  process whose caching allocator may take at most 90% of the card
  (`torch.cuda.set_per_process_memory_fraction(0.9)`: the rest stays free for what allocates
  outside it);
- pressure: the `sdpa` case on cuDNN, its forward run with the card free, then PyTorch's caching
  allocator made to hold all but N GiB of the card (one tensor allocated and freed: it stays
  reserved in the cache, as a large model's activations do) before the backward, for several N;
  and once with the card held before the forward. A failure only at small N says cuDNN's
  attention needs device memory outside PyTorch's allocator, which a full cache starves;
- mix: what the model has and one block alone has not -- both block kinds in one step: a
  double-stream block feeding a single-stream block (each under a checkpoint, as in the model),
  and at the SDPA level two attentions of the same shape in one backward, one whose output goes
  on alone (`flatten` -> linear: a dense gradient) and one whose output is concatenated with an
  MLP branch first, as the single-stream block does (its gradient a strided slice), each also
  alone.

Reading the result: a failing `sdpa` case is upstream (torch / cuDNN), with this file's case
as the minimal reproduction; `sdpa` clean but `block` failing points at diffusers' block in
eager mode (or an op of ours in `model` only: the plan's rewrites); a case that passes with
cuDNN off and fails with it on names cuDNN's attention kernel; `pressure` failing where the
card is nearly all reserved, and `model` passing under the 90% cap, name the card's free memory. Writes
benchmarks/results/train/flux_train_repro_<stages>_<card>.json/.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from benchmarks import common

STAGES = ("sdpa", "block", "model", "pressure", "mix")
HEADS, HEAD_DIM, IMAGE_TOKENS, TEXT_TOKENS = 24, 128, 4096, 512  # Flux.1-dev at 1024^2
BACKENDS = ("default", "cudnn", "flash", "efficient")
PRESSURE_LEAVE_GIB = (0.25, 1, 4, 16)  # what the caching allocator leaves free on the card
GIB = 1 << 30


def _cases(stages: list[str]) -> list[tuple[str, str]]:
    out = []
    if "sdpa" in stages:
        out += [("sdpa", b) for b in BACKENDS] + [("sdpa", f"{b}+checkpoint") for b in BACKENDS]
    if "block" in stages:
        out += [("block", f"{kind}/{sdpa}") for kind in ("double", "single") for sdpa in ("default", "no-cudnn")]
    if "model" in stages:
        out += [("model", sdpa) for sdpa in ("default", "no-cudnn", "default+cap0.9")]
    if "mix" in stages:
        out += [("mix", v) for v in ("blocks/double+single", "sdpa/dense+strided", "sdpa/strided", "sdpa/dense")]
    if "pressure" in stages:
        out += [("pressure", f"backward/leave{n}") for n in PRESSURE_LEAVE_GIB] + [("pressure", "forward/leave0.25")]
    return out


def _hold_all_but(leave_gib: float) -> None:
    """PyTorch's caching allocator takes all of the card's free memory but `leave_gib` and keeps
    it reserved (allocated, then freed into its cache): the state a large model's step leaves."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    held = torch.empty(max(0, free - int(leave_gib * GIB)), dtype=torch.uint8, device="cuda")
    del held  # back to PyTorch's cache, not to the card


def _free_gib() -> float:
    import torch

    return common.gib(torch.cuda.mem_get_info()[0])


def _pressure_case(variant: str) -> dict[str, Any]:
    where, _, leave = variant.partition("/leave")
    return _sdpa_case("cudnn", hold_before_forward=float(leave) if where == "forward" else None,
                      hold_before_backward=float(leave) if where == "backward" else None)


def _sdpa_case(variant: str, *, hold_before_forward: float | None = None,
               hold_before_backward: float | None = None) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint

    backend, _, ckpt = variant.partition("+")
    dev, dt = torch.device("cuda"), torch.bfloat16
    tokens, dim = IMAGE_TOKENS + TEXT_TOKENS, HEADS * HEAD_DIM
    g = torch.Generator(device=dev).manual_seed(0)
    # (batch, tokens, heads, dim) as the projections make them, transposed for SDPA (diffusers' native backend)
    q, k, v = (torch.randn(1, tokens, HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g).requires_grad_(True)
               for _ in range(3))
    out_proj = torch.nn.Linear(dim, dim, device=dev, dtype=dt)
    chosen = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
              "efficient": [SDPBackend.EFFICIENT_ATTENTION]}.get(backend)

    def attend(q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out_proj(o.transpose(1, 2).flatten(2))

    ctx = sdpa_kernel(chosen) if chosen else contextlib.nullcontext()
    row: dict[str, Any] = {}
    with ctx:
        if hold_before_forward is not None:
            _hold_all_but(hold_before_forward)
        y = checkpoint(attend, q, k, v, use_reentrant=False) if ckpt else attend(q, k, v)
        loss = y.float().pow(2).mean()
        if hold_before_backward is not None:
            torch.cuda.synchronize()
            _hold_all_but(hold_before_backward)
        row["free_gib_before_backward"] = _free_gib()
        loss.backward()
    torch.cuda.synchronize()
    return {**row, "grad_finite": bool(all(t.grad.isfinite().all() for t in (q, k, v)))}


def _mix_case(variant: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint

    what, _, kinds = variant.partition("/")
    if what == "blocks":
        return _block_case("double+single/default")
    dev, dt = torch.device("cuda"), torch.bfloat16
    tokens, dim = IMAGE_TOKENS + TEXT_TOKENS, HEADS * HEAD_DIM
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, tokens, HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g).requires_grad_(True)
    mlp = torch.randn(1, tokens, 4 * dim, device=dev, dtype=dt, generator=g).requires_grad_(True)
    dense_out = torch.nn.Linear(dim, dim, device=dev, dtype=dt)
    strided_out = torch.nn.Linear(5 * dim, dim, device=dev, dtype=dt)  # single-stream: [attention, MLP] -> dim

    def attend(h, kind):
        q, k, v = ((h * s).transpose(1, 2) for s in (1.0, 0.5, 0.25))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return dense_out(o) if kind == "dense" else strided_out(torch.cat([o, mlp], dim=-1))

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        h = x
        for kind in kinds.split("+"):
            h = checkpoint(attend, h, kind, use_reentrant=False).unflatten(-1, (HEADS, HEAD_DIM))
        h.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return {"grad_finite": bool(x.grad.isfinite().all())}


def _block_case(variant: str) -> dict[str, Any]:
    import torch
    from diffusers.models.transformers.transformer_flux import (FluxPosEmbed, FluxSingleTransformerBlock,
                                                                FluxTransformerBlock)
    from torch.utils.checkpoint import checkpoint

    kind, _, sdpa = variant.partition("/")
    if sdpa == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    dim = HEADS * HEAD_DIM
    classes = {"double": FluxTransformerBlock, "single": FluxSingleTransformerBlock}
    blocks = [classes[k](dim=dim, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM).to(dev, dt).train()
              for k in kind.split("+")]  # "double+single": one feeding the other, as in the model
    hidden = torch.randn(1, IMAGE_TOKENS, dim, device=dev, dtype=dt, requires_grad=True)
    text = torch.randn(1, TEXT_TOKENS, dim, device=dev, dtype=dt, requires_grad=True)
    temb = torch.randn(1, dim, device=dev, dtype=dt)
    ids = torch.zeros(TEXT_TOKENS + IMAGE_TOKENS, 3, device=dev)
    ids[TEXT_TOKENS:, 1] = torch.arange(IMAGE_TOKENS, device=dev) // 64
    ids[TEXT_TOKENS:, 2] = torch.arange(IMAGE_TOKENS, device=dev) % 64
    rope = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)
    h, t = hidden, text
    for block in blocks:  # each block returns (text, image) streams
        t, h = checkpoint(block, h, t, temb, rope, use_reentrant=False)
    outs = [x for x in (t, h) if x is not None]
    sum(t.float().pow(2).mean() for t in outs).backward()
    torch.cuda.synchronize()
    return {"grad_finite": bool(hidden.grad.isfinite().all())}


def _model_case(variant: str) -> dict[str, Any]:
    import torch

    from benchmarks import train

    if variant == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    if variant.endswith("+cap0.9"):  # before anything touches the card
        torch.cuda.set_per_process_memory_fraction(0.9)
    h = train.build("flux.1-dev", "eager_full", gpu="auto", device="cuda", backend=None, optimizer="none")
    inputs = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    loss = train.make_step(h, inputs, "none")()
    torch.cuda.synchronize()
    return {"loss": float(loss), "recompute": h.report().step("recompute").did}


def run_case(stage: str, variant: str) -> dict[str, Any]:
    """One case in this process: ok with what it measured, or the error and its last frames."""
    import torch

    row: dict[str, Any] = {"stage": stage, "variant": variant}
    try:
        row.update(status="ok", **{"sdpa": _sdpa_case, "block": _block_case, "model": _model_case,
                                   "pressure": _pressure_case, "mix": _mix_case}[stage](variant))
        row["peak_gib"] = common.gib(torch.cuda.max_memory_allocated())
    except Exception as e:  # the point of this script: record it
        try:  # what the card had left when it failed (cuDNN allocates outside PyTorch's cache)
            row.update(free_gib_at_error=_free_gib(), reserved_gib_at_error=common.gib(torch.cuda.memory_reserved()))
        except Exception:  # a poisoned context answers nothing more
            pass
        frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)]
        row.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", frames=frames[-6:])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    p.add_argument("--timeout", type=float, default=900, help="seconds per case")
    p.add_argument("--out", default=common.results_dir("train"))
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # stage:variant, run in this process
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    common.add_commit_argument(p)
    args = p.parse_args(argv)
    stages = args.stages.split(",")
    if any(s not in STAGES for s in stages):
        p.error(f"--stages: choices are {', '.join(STAGES)}; got {args.stages!r}")
    import torch

    if args.case:
        stage, _, variant = args.case.partition(":")
        Path(args.result_file).write_text(json.dumps(run_case(stage, variant)))
        return 0
    if not torch.cuda.is_available():
        p.error("needs a CUDA card (the failure is a CUDA kernel's)")
    common.measured_commit()
    rows = []
    for stage, variant in _cases(stages):
        result_file = Path(args.out) / f".flux_repro_{stage}_{variant.replace('/', '_')}.json"
        result_file.parent.mkdir(parents=True, exist_ok=True)
        result_file.unlink(missing_ok=True)
        row = common.run_isolated("benchmarks.flux_train_repro", ["--case", f"{stage}:{variant}", "--result-file",
                                                                   str(result_file)],
                                  env={"CUDA_LAUNCH_BLOCKING": "1"}, result_file=result_file, timeout=args.timeout)
        row.setdefault("stage", stage)
        row.setdefault("variant", variant)
        result_file.unlink(missing_ok=True)
        print(f"[bench] {stage} {variant}: {row.get('status')} {row.get('error', '')}", flush=True)
        rows.append(row)
    env = common.environment(torch.device("cuda"))
    rec = {"kind": "flux_train_repro", "env": env, "results": rows}
    md = ["# Flux.1-dev eager + full checkpointing: the illegal memory access, case by case", "",
          common.env_line(env), "", "Each case in a fresh process with CUDA_LAUNCH_BLOCKING=1.", "",
          common.results_table(rows, ["stage", "variant", "status", "error", "grad_finite", "peak_gib",
                                      "free_gib_before_backward", "free_gib_at_error", "reserved_gib_at_error"])]
    common.publish(Path(args.out), f"flux_train_repro_{'_'.join(stages)}_{common.card_tag(env)}", rec, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
