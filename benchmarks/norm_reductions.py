"""LayerNorm + modulation reductions as inductor writes them: its looped reduction against its
persistent one.

    pip install -e ".[hopper]"    # on a CUDA machine
    python -m benchmarks.norm_reductions

Why: a DiT block normalises its residual stream three times (Wan: norm1 + modulation before
self-attention, the residual add + norm2 before cross-attention, the residual add + norm3 +
modulation before the FFN), each a reduction over the model width per token. Inductor keeps a
row in registers (a persistent reduction) only up to 1,024 elements (`choices.py`,
`should_use_persistent_reduction`); wider rows -- 1,536 (Wan-1.3B), 3,072 (Flux.1), 5,120
(Wan-14B), 6,144 (FLUX.2) -- get a looped reduction that reads each row twice (statistics, then
the normalised write). In the shipped Wan-1.3B profile on an H200 the first LayerNorm kernel took
182 us a call, ~1.1 TB/s if it moves only its input and output
(benchmarks/results/profiles/profile_wan2.1-t2v-1.3b_shipped_h200.json). Inductor's multi-kernel
mode (`triton.multi_kernel`) compiles both kinds up to 16x the threshold and picks the faster at
the first call by timing them; `triton.multi_kernel=2` forces the persistent one. A whole-model
profile with multi-kernel on (Wan-1.3B bf16 on an H100, 6d35eab:
benchmarks/results/profiles/profile_wan2.1-t2v-1.3b_bf16_mk_h100.md, beside ..._bf16_h100.md of
fe0bfa1) shows norm1's kernel turned persistent, 5.37 -> 3.18 ms per forward, while the two
kernels that also write the residual stayed looped (5.5 and 5.6 ms); this script times each
pattern under each kind on its own, at every width. A hand-written
Triton kernel (one program per row, the row in registers) is the candidate beside them: what a
fused op of the engine's own would do if inductor's persistent kind falls short.

Each pattern is diffusers' WanTransformerBlock arithmetic (0.42) at 480x832x81 (32,760 tokens),
and the same at Flux.1's and FLUX.2's widths and token counts; bf16 activations, fp32
modulation. Times are GPU time from CUDA-graph replays; GB/s counts each tensor read or written
once (the floor a fused kernel must move). Each variant is checked against eager.
"""

from __future__ import annotations

import functools

from benchmarks import common

SHAPES = {  # name: (tokens, width)
    "wan2.1-1.3b (32760 x 1536)": (32760, 1536),
    "wan2.1-14b (32760 x 5120)": (32760, 5120),
    "flux.1 (4608 x 3072)": (4608, 3072),
    "flux.2 (4592 x 6144)": (4592, 6144),
}
VARIANTS = {  # name: inductor options for the compiled pattern
    "inductor default (looped above 1,024)": {},
    "inductor multi-kernel (timed pick)": {"triton.multi_kernel": 1},
    "inductor persistent (multi-kernel forced)": {"triton.multi_kernel": 2},
}


def patterns():
    """name: (function, number of token-width tensors it reads + writes), as WanTransformerBlock."""
    import torch.nn.functional as F

    def norm_modulate(x, scale, shift):  # norm1 (no affine) + the self-attention's modulation
        n = F.layer_norm(x.float(), (x.shape[-1],), eps=1e-6)
        return (n * (1 + scale) + shift).type_as(x)

    def gate_add_norm(x, a, gate, w, b):  # residual + gated attention output, then norm2 (affine)
        h = (x.float() + a * gate).type_as(x)
        return h, F.layer_norm(h.float(), (x.shape[-1],), w, b, eps=1e-6).type_as(x)

    def add_norm_modulate(x, a, scale, shift):  # residual + cross-attention output, norm3 + modulation
        h = x + a
        n = F.layer_norm(h.float(), (x.shape[-1],), eps=1e-6)
        return h, (n * (1 + scale) + shift).type_as(x)

    return {"norm1 + modulation": (norm_modulate, 2), "gated add + norm2": (gate_add_norm, 4),
            "add + norm3 + modulation": (add_norm_modulate, 4)}


def main(argv=None):
    import torch

    args, dev, env = common.kernel_bench_start(__doc__, argv)
    rows: list[dict] = []
    g = torch.Generator(device=dev).manual_seed(0)
    for shape, (tokens, width) in SHAPES.items():
        x = torch.randn(1, tokens, width, device=dev, generator=g).to(torch.bfloat16)
        a = torch.randn(1, tokens, width, device=dev, generator=g).to(torch.bfloat16)
        vec = lambda: 0.1 * torch.randn(1, 1, width, device=dev, generator=g)  # noqa: E731 -- fp32, as temb
        scale, shift, gate = vec(), vec(), vec()
        w, b = 1 + vec().flatten(), vec().flatten()
        inputs = {"norm1 + modulation": (x, scale, shift), "gated add + norm2": (x, a, gate, w, b),
                  "add + norm3 + modulation": (x, a, scale, shift)}
        for pattern, (fn, tensors) in patterns().items():
            args_ = inputs[pattern]
            with torch.no_grad():
                want = fn(*args_)
            nbytes = tensors * x.numel() * x.element_size()
            for variant, options in VARIANTS.items():
                torch.compiler.reset()  # each variant compiles afresh with its options
                compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options or None)
                rows.append(common.kernel_row(lambda: compiled(*args_), want, nbytes, "rel_err_vs_eager",
                                              shape=shape, pattern=pattern, variant=variant))
            rows.append(common.kernel_row(lambda: hand_kernel(pattern, *args_), want, nbytes, "rel_err_vs_eager",
                                          shape=shape, pattern=pattern,
                                          variant="hand Triton kernel (one row in registers)"))
    common.write_kernel_rows(args, env, rows, "norm_reductions",
                             "LayerNorm + modulation reductions: inductor's looped against its persistent kind",
                             "python -m benchmarks.norm_reductions",
                             ["shape", "pattern", "variant", "median_ms", "gb_per_s", "rel_err_vs_eager"])


@functools.cache
def _row_kernel():
    """A candidate beside inductor's kinds: one program per token row, the whole row in
    registers -- read once, the residual (if any) written once, the normalised row written once."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_norm_kernel(x_ptr, a_ptr, gate_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, h_ptr, out_ptr, width, eps,
                        HAS_A: tl.constexpr, HAS_GATE: tl.constexpr, AFFINE: tl.constexpr, MOD: tl.constexpr,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < width
        x = tl.load(x_ptr + row * width + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_A:
            a = tl.load(a_ptr + row * width + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_GATE:
                a = a * tl.load(gate_ptr + cols, mask=m, other=0.0)
            h = (x + a).to(h_ptr.dtype.element_ty)  # the residual in the activations' dtype, as diffusers' type_as
            tl.store(h_ptr + row * width + cols, h, mask=m)
            x = h.to(tl.float32)
        mean = tl.sum(x, axis=0) / width
        d = tl.where(m, x - mean, 0.0)
        y = d / tl.sqrt(tl.sum(d * d, axis=0) / width + eps)
        if AFFINE:
            y = y * tl.load(w_ptr + cols, mask=m, other=0.0) + tl.load(b_ptr + cols, mask=m, other=0.0)
        if MOD:
            y = y * (1.0 + tl.load(scale_ptr + cols, mask=m, other=0.0)) + tl.load(shift_ptr + cols, mask=m, other=0.0)
        tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=m)

    return row_norm_kernel


def hand_kernel(pattern: str, x, *rest):
    """`patterns()[pattern]` on `_row_kernel`: the same outputs, from one launch."""
    import torch
    import triton

    tokens, width = x.shape[1], x.shape[2]
    a = gate = w = b = scale = shift = None
    if pattern == "norm1 + modulation":
        scale, shift = rest
    elif pattern == "gated add + norm2":
        a, gate, w, b = rest
    else:
        a, scale, shift = rest
    out = torch.empty_like(x)
    h = torch.empty_like(x) if a is not None else out
    block = triton.next_power_of_2(width)
    _row_kernel()[(tokens,)](x, a if a is not None else x, gate if gate is not None else x,
                             w if w is not None else x, b if b is not None else x,
                             scale if scale is not None else x, shift if shift is not None else x, h, out, width,
                             1e-6, HAS_A=a is not None, HAS_GATE=gate is not None, AFFINE=w is not None,
                             MOD=scale is not None, BLOCK=block, num_warps=max(4, min(16, block // 512)))
    return (h, out) if a is not None else out


if __name__ == "__main__":
    main()
