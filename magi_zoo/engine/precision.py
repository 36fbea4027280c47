"""The precision step: run a region's linears (and its fa3 attention) in fp8.

`Fp8Linear` replaces an `nn.Linear`: its weight is quantized once, at apply, to float8
e4m3 with one fp32 scale per output row; at run time each activation row gets its own
scale (amax / 448) and the product is one `torch._scaled_mm` with row-wise scales,
accumulated in fp32 and written in the input dtype. Everything is plain aten ops, so a
compiled region traces it whole (fullgraph) and inductor fuses the activation
quantization into the preceding elementwise work; no tensor subclass is traced (the
tensor-subclass path of torchao made the cold compile 119-175 s, DESIGN.md section 6).

With ``attention = "fp8"`` the region's attention layers that the attention step put on
fa3 are switched to FA3's fp8 path (`engine/kernels/fa3.py`: per-head scales, K and V
smoothed over tokens); layers on other backends stay bf16 and the report says so.

Two kernel fusions run in bf16 and fp8 regions alike (same function, fewer passes over memory):
``gelu_epilogue`` turns a bf16 linear + tanh GELU into one cuBLASLt GEMM with the GELU in its
epilogue (`GeluLinear`, `kernels/gelu_linear.py`), and ``fuse_norm_rope`` marks the q/k RMSNorms
of attention layers whose processor computes norm + rotary embedding in one kernel
(`kernels/norm_rope.py`; Wan's and Flux's, installed by their adapters).

The step runs before compile (the graphs must contain the fp8 ops) and its undo puts the
original linears back. To restore them exactly the originals are kept -- on the host, so
the device holds only the fp8 copies (half the bytes of bf16).
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels import fp8_quant, gelu_linear
from .steps import StepContext, StepRecord

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_EPS = 1e-12  # keeps an all-zero row's scale finite


def _rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 tensor, fp32 per-row scale) with x ~= fp8 * scale, row = last dim."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=_EPS)
    scale = amax / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Linear(nn.Module):
    """An `nn.Linear` with fp8 weights (per output row scales) and fp8 activations (per
    token scales), through `torch._scaled_mm`. Forward only (no gradient to the weight)."""

    def __init__(self, linear: nn.Linear, fast_accum: bool = False):
        super().__init__()
        self.fast_accum = fast_accum
        # True: the input is a pre-activation and GELU (tanh) runs inside the one-pass
        # quantization kernel (`fuse_gelu`: the precision step sets it on a FeedForward's down
        # projection after taking the GELU out of the up projection).
        self.input_gelu = False
        self.input_bias: torch.Tensor | None = None  # with input_gelu: the up projection's bias
        # May an adapter hand this linear its input in parts (`forward_parts`)? The precision
        # step sets it from the spec's fuse_gelu; an Fp8Linear built by hand says no.
        self.fuse_gelu = False
        w = linear.weight.detach()
        q, scale = _rowwise_fp8(w)  # (out, in) fp8 and (out, 1) fp32
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # (1, out) for _scaled_mm
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for code that reads `.weight`, e.g. dtype checks)."""
        return self.weight_fp8.float() * self.weight_scale.reshape(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.input_gelu:  # x is the up projection's raw output; its bias joins in the kernel
            xq, xs = fp8_quant.rowwise_fp8_gelu_cat(x2, None, self.input_bias, None, True, False)
        else:
            xq, xs = _rowwise_fp8(x2)
        return self._matmul(xq, xs, x.dtype, shape[:-1])

    def forward_parts(self, a: torch.Tensor, b: torch.Tensor, bias_b: torch.Tensor | None,
                      gelu_a: bool, gelu_b: bool) -> torch.Tensor:
        """`forward(cat([gelu?(a), gelu?(b + bias_b)], -1))` without materializing the
        concatenation or the GELU: one kernel quantizes both parts per row
        (`kernels/fp8_quant.py`). `b` may be another fp8 linear's `raw` output with its bias."""
        lead = a.shape[:-1]
        xq, xs = fp8_quant.rowwise_fp8_gelu_cat(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]),
                                                None, bias_b, gelu_a, gelu_b)
        return self._matmul(xq, xs, a.dtype, lead)

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T without the bias: for a consumer that adds the bias itself (the one-pass
        quantization of the next fp8 linear reads this output once, bias included)."""
        shape = x.shape
        xq, xs = _rowwise_fp8(x.reshape(-1, shape[-1]))
        return self._matmul(xq, xs, x.dtype, shape[:-1], bias=False)

    def _matmul(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype, lead, bias: bool = True) -> torch.Tensor:
        # b must be column-major: the transpose of the row-major (out, in) weight is.
        out_dtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=xs, scale_b=self.weight_scale, out_dtype=out_dtype,
                             use_fast_accum=self.fast_accum)
        if bias and self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 rowwise"
                + (", fast accumulation" if self.fast_accum else "") + (", GELU of the input fused" if self.input_gelu else ""))


class _RawUp(nn.Module):
    """A FeedForward's up projection without its bias, whose output the down projection's
    one-pass quantization reads (adding this bias and the GELU there)."""

    def __init__(self, up: Fp8Linear):
        super().__init__()
        self.up = up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up.raw(x)


def eligible(linear: nn.Module) -> bool:
    """_scaled_mm needs both matrix dims to be multiples of 16."""
    return type(linear) is nn.Linear and linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def _fa3_member():
    """diffusers' member the fa3 backend dispatches through (None if diffusers lacks it)."""
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName
    except ImportError:  # pragma: no cover
        return None
    return AttentionBackendName._FLASH_3


def _fp8_attention(key: str, targets, ctx: StepContext, backends: list) -> str:
    """Switch the region's attention layers to fp8 FA3 (the attention step ran before this
    one and chose the backends). fp8 attention exists only on fa3, so: layers on fa3 switch;
    layers nobody chose a backend for (the library default) switch too when fa3 can run here
    (asking for fp8 attention is asking for its kernel: Flux's plan leaves bf16 attention on
    the library default, where fa3 gains nothing); layers on a backend someone chose stay
    bf16, with a warning, as do all when fa3 cannot run. Returns the report fragment."""
    import warnings

    from .attention import _processors, _unavailable
    from .kernels import fa3

    fa3_member = _fa3_member()
    procs = [p for t in targets for p in _processors(t.module)]
    on_fa3 = [p for p in procs if p._attention_backend == fa3_member]
    default = [p for p in procs if p._attention_backend is None]
    blocked = _unavailable("fa3", ctx.profile) if default else None
    promoted = default if default and blocked is None else []
    if not on_fa3 and not promoted:
        others = sorted({"the library default" if p._attention_backend is None
                         else getattr(p._attention_backend, "value", str(p._attention_backend)) for p in procs})
        why = (f"its attention layers use {', '.join(others)}; fp8 attention runs "
               "on the fa3 backend only (the `hopper` extra on a Hopper card)"
               + (f", and fa3 cannot run here: {blocked}" if blocked else "")) if procs else "it has no attention layer"
        warnings.warn(f"magi_zoo: precision key {key!r}: attention stays bf16: {why}", RuntimeWarning, stacklevel=4)
        return f"attention on {key or '<root>'} stays bf16 ({why})"
    member = fa3.register_fp8()
    for p in on_fa3 + promoted:
        backends.append((p, p._attention_backend))
        p._attention_backend = member
    kept = len(procs) - len(on_fa3) - len(promoted)
    if kept:
        warnings.warn(f"magi_zoo: precision key {key!r}: {kept} attention layer(s) on a backend other than fa3 "
                      "stay bf16 (fp8 attention runs on fa3 only)", RuntimeWarning, stacklevel=4)
    return (f"fp8 attention on {key or '<root>'} ({len(on_fa3) + len(promoted)} layers, fa3 e4m3, per-head scales, "
            f"K/V smoothed{f'; {len(promoted)} from the library default' if promoted else ''}"
            + (f"; {kept} non-fa3 layer(s) kept bf16)" if kept else ")"))


def precision_step(ctx: StepContext) -> StepRecord:
    section = ctx.plan.section("precision")
    swaps: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, attribute, original on the host)
    backends: list[tuple[object, object]] = []  # (attention processor, its backend before)
    fusions: list[tuple[nn.ModuleList, nn.Module, Fp8Linear]] = []  # (FeedForward.net, its GELU, down proj)
    epilogues: list[tuple[nn.Module, str, nn.Module | None]] = []  # (parent, name, GELU module or None: a mark)
    done, skipped = [], 0

    def undo() -> None:
        for parent, name, act in reversed(epilogues):
            if act is None:  # a mark
                parent.__dict__.pop(name, None)
            else:
                setattr(parent, name, act)
        for net, act, down in reversed(fusions):
            net[0] = act
            down.input_gelu, down.input_bias = False, None
        for proc, prior in reversed(backends):
            proc._attention_backend = prior
        for parent, name, original in reversed(swaps):
            device = next(getattr(parent, name).buffers()).device
            setattr(parent, name, original.to(device))

    try:
        for (key, _), targets in section.regions().items():
            spec = targets[0].spec
            if "fp8" in (spec.matmul, spec.attention) and not ctx.profile.fp8:
                raise ValueError(f"precision key {key!r}: fp8 needs a card with fp8 matmuls (Hopper, "
                                 f"Ada, Blackwell); profile {ctx.profile.name!r} has none. Use 'bf16' "
                                 "(drop precision='fp8' / --fp8)")
            if spec.attention == "fp8":
                done.append(_fp8_attention(key, targets, ctx, backends))
            if spec.matmul == "fp8":
                skipped += _fp8_matmuls(key, spec, targets, ctx, swaps, fusions, done)
            if spec.gelu_epilogue:
                counts = [_gelu_epilogues(t.module, epilogues) for t in targets]
                swapped, marked = sum(c[0] for c in counts), sum(c[1] for c in counts)
                if swapped or marked:
                    done.append(f"GELU in the GEMM epilogue on {key or '<root>'} ("
                                + ", ".join(([f"{swapped} GELU module(s)"] if swapped else [])
                                            + ([f"{marked} nn.GELU marked, fused where the adapter's forward reads it"] if marked else []))
                                + ")")
            if spec.fuse_norm_rope:
                marked = sum(_mark_norm_rope(t.module, epilogues) for t in targets)
                if marked:
                    done.append(f"q/k RMSNorm + RoPE in one pass on {key or '<root>'} ({marked} attention layer(s) "
                                "whose processor fuses them)")
    except BaseException:
        undo()
        raise
    did = "; ".join(done) if done else "as built (no fp8 region)"
    if skipped:
        did += f"; {skipped} linear(s) kept (dims not multiples of 16)"
    return StepRecord("precision", did, undo, {"fp8_linears": len(swaps), "skipped": skipped,
                                               "fp8_attention_layers": len(backends),
                                               "gelu_epilogues": sum(a is not None for _, _, a in epilogues)})


def _fp8_matmuls(key: str, spec, targets, ctx: StepContext, swaps: list, fusions: list, done: list) -> int:
    """Swap the region's eligible linears for `Fp8Linear`s (keep_bf16 honoured) and fuse the
    FeedForward GELUs (fuse_gelu). Appends to `swaps`/`fusions` (the caller's undo) and the
    report line to `done`; returns how many linears were kept for their dims."""
    skipped = 0  # (the caller refused fp8 on a profile without it)
    n, kept = 0, 0
    seen: set[int] = set()
    used = {pat: False for pat in spec.keep_bf16}
    for t in targets:
        for parent_path, parent in list(t.module.named_modules()):
            for name, child in list(parent.named_children()):
                if id(child) in seen or not isinstance(child, nn.Linear):
                    continue
                seen.add(id(child))
                path = f"{parent_path}.{name}" if parent_path else name
                hits = [pat for pat in spec.keep_bf16 if fnmatch.fnmatchcase(path, pat)]
                if hits:
                    used.update(dict.fromkeys(hits, True))
                    kept += 1
                    continue
                if not eligible(child):
                    skipped += 1
                    continue
                fp8 = Fp8Linear(child, fast_accum=spec.fast_accum)
                fp8.fuse_gelu = spec.fuse_gelu  # may take its input in parts (an adapter's forward)
                swaps.append((parent, name, child.to("cpu")))
                setattr(parent, name, fp8)
                n += 1
    fused = sum(_fuse_feedforward_gelu(t.module, fusions) for t in targets) if spec.fuse_gelu else 0
    unused = [pat for pat, hit in used.items() if not hit]
    if unused:
        linears = sorted(p for p, m in targets[0].module.named_modules() if isinstance(m, (nn.Linear, Fp8Linear)))
        raise ValueError(f"precision key {key!r}: keep_bf16 pattern(s) {unused} match no linear under "
                         f"{targets[0].cls_name}; its linears: {', '.join(linears)}")
    done.append(f"fp8 matmuls on {key or '<root>'} ({n} linears"
                + (f", {kept} kept bf16 by keep_bf16" if kept else "")
                + (", fast accumulation" if spec.fast_accum else "")
                + (f", {fused} FeedForward GELU(s) quantized in one pass" if fused else "") + ")")
    return skipped


def _fuse_feedforward_gelu(root: nn.Module, fusions: list) -> int:
    """In every diffusers-style FeedForward under `root` whose net is [GELU(tanh) with its `proj`,
    Dropout(0), fp8 linear(, Dropout(0))], move the GELU into the down projection's one-pass
    quantization: net[0] becomes the bare up projection, the down projection's `input_gelu` is
    set (with an fp8 up projection, its bias is added there too: its raw output is read once).
    Same function; the GELU output is quantized from fp32 instead of bf16. Returns how many."""
    n = 0
    for m in root.modules():
        net = getattr(m, "net", None)
        if not isinstance(net, nn.ModuleList) or len(net) not in (3, 4):
            continue
        act, drops, down = net[0], [net[1], *list(net)[3:]], net[2]
        if not (type(act).__name__ == "GELU" and getattr(act, "approximate", None) == "tanh"
                and isinstance(getattr(act, "proj", None), nn.Module) and isinstance(down, Fp8Linear)
                and all(isinstance(d, nn.Dropout) and d.p == 0 for d in drops)):
            continue
        up = act.proj
        fusions.append((net, act, down))
        net[0] = _RawUp(up) if isinstance(up, Fp8Linear) else up
        down.input_gelu = True
        down.input_bias = up.bias if isinstance(up, Fp8Linear) else None
        n += 1
    return n


# Set on a bare GELU(tanh) activation module (nn.GELU) by the precision step: "the linear that
# feeds you may run you in its epilogue". Only an adapter knows which linear feeds a bare
# activation (Flux's single blocks: proj_mlp -> act_mlp), so its forward reads the mark.
GELU_EPILOGUE_MARK = "gelu_epilogue"
# Set on an attention layer's q/k nn.RMSNorms (fuse_norm_rope) that its processor names in
# FUSES_NORM_ROPE: "your output may be computed with the rotary embedding that follows in one
# pass" -- only the processor knows the pairing (Wan's and Flux's, installed by their adapters).
NORM_ROPE_MARK = "norm_rope_fusion"


def marked_norm(norm, width: int) -> bool:
    """Whether `norm` is an nn.RMSNorm over `width` channels that the precision step marked for
    the norm + rope fusion (NORM_ROPE_MARK): what an adapter's processor checks before fusing."""
    return (isinstance(norm, nn.RMSNorm) and bool(getattr(norm, NORM_ROPE_MARK, False))
            and tuple(norm.normalized_shape) == (width,))


class GeluLinear(nn.Module):
    """diffusers' `GELU` module (a linear `proj`, then the tanh GELU) as one
    `magi_zoo::linear_gelu_tanh` call. It holds the same `proj`, so state-dict keys do not change."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.proj = act.proj

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gelu_linear.apply(hidden_states, self.proj)


def _is_tanh_gelu_module(m: nn.Module) -> bool:
    """diffusers' GELU (proj + tanh GELU) over a plain bf16-able linear with a bias."""
    proj = getattr(m, "proj", None)
    return (type(m).__name__ == "GELU" and getattr(m, "approximate", None) == "tanh"
            and type(proj) is nn.Linear and proj.bias is not None)


def _gelu_epilogues(root: nn.Module, epilogues: list) -> tuple[int, int]:
    """Under `root`: swap every diffusers GELU(tanh) module over a plain linear for a `GeluLinear`
    (an fp8 up projection is not one: `fuse_gelu` handles those), and mark every bare
    `nn.GELU(approximate="tanh")` for an adapter's forward (GELU_EPILOGUE_MARK). Appends the
    undo entries; returns (modules swapped, activations marked)."""
    swapped = 0
    marked = _mark(root, nn.GELU, GELU_EPILOGUE_MARK, epilogues, lambda m: m.approximate == "tanh")
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if _is_tanh_gelu_module(child):
                setattr(parent, name, GeluLinear(child))
                epilogues.append((parent, name, child))
                swapped += 1
    return swapped, marked


def _set_mark(m: nn.Module, mark: str, undo: list) -> bool:
    """Set `mark` on `m` unless it is set; record the undo entry (m, mark, None). True if set."""
    if m.__dict__.get(mark):
        return False
    m.__dict__[mark] = True
    undo.append((m, mark, None))
    return True


def _mark(root: nn.Module, cls: type, mark: str, undo: list, where=lambda m: True) -> int:
    """Set `mark` on every `cls` module under `root` (that `where` accepts); an adapter's forward reads
    it. Returns how many."""
    return sum(_set_mark(m, mark, undo) for m in root.modules() if isinstance(m, cls) and where(m))


def _mark_norm_rope(root: nn.Module, undo: list) -> int:
    """Mark the RMSNorms of every attention layer under `root` whose processor declares it fuses
    them with the rotary embedding (class attribute FUSES_NORM_ROPE: the names of the norms, e.g.
    ("norm_q", "norm_k"); Wan's and Flux's processors, installed by their adapters). Returns how
    many layers."""
    n = 0
    for m in root.modules():
        names = getattr(getattr(m, "processor", None), "FUSES_NORM_ROPE", ())
        norms = [x for x in (getattr(m, name, None) for name in names) if isinstance(x, nn.RMSNorm)]
        for x in norms:
            _set_mark(x, NORM_ROPE_MARK, undo)
        n += bool(norms)
    return n


def reference_linear(x: torch.Tensor, linear: Fp8Linear) -> torch.Tensor:
    """What an Fp8Linear computes, in fp32 from the dequantized operands (for tests)."""
    xq, xs = _rowwise_fp8(x.reshape(-1, x.shape[-1]))
    y = F.linear(xq.float() * xs, linear.weight, None if linear.bias is None else linear.bias.float())
    return y.reshape(*x.shape[:-1], -1)
