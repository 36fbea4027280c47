"""The ``fa3`` attention backend: FlashAttention-3's forward kernel (the `fa3-fwd` wheel, the
``hopper`` extra) behind diffusers' attention dispatch.

How it reaches the model: diffusers' attention layers call
``dispatch_attention_fn(..., backend=processor._attention_backend)``, which looks the
function up in ``_AttentionBackendRegistry._backends`` by an `AttentionBackendName` member.
`register()` puts `fa3_attention` in that registry through diffusers' own
``_AttentionBackendRegistry.register`` under the existing member ``_FLASH_3``; the
attention step then sets that member on the region's processors. Model code is untouched.

Why the ``_FLASH_3`` slot and not a new member: `AttentionBackendName` is an `Enum`, which
cannot gain members after its class is built (only by editing enum internals), and
dispatch turns anything that is not a member into one with ``AttentionBackendName(x)``,
which rejects unknown names. ``_FLASH_3`` already means "FlashAttention-3 forward, inputs
(B, S, H, D), no mask" -- the same kernel family and contract. Diffusers fills that slot
only from the official ``flash_attn_interface`` package: when that package is installed
(``attention_dispatch._CAN_USE_FLASH_ATTN_3``) its entry works and is left alone (a working
library backend is never replaced); when it is absent the entry calls ``None`` and cannot
run, so taking the slot for fa3-fwd loses nothing. The registration is process-wide and
stays (like a custom-op registration); undoing a plan restores the processors' backends.

Why it stays one graph under ``fullgraph=True``: dispatch is plain Python over a dict that
dynamo traces (diffusers' native backends compile the same way), and the kernel is the
``torch.library`` custom op ``fa3_fwd::_flash_attn_forward`` with a fake implementation,
so dynamo records it as one opaque node. It is called directly, not through
``flash_attn_func``'s `autograd.Function`, whose backward this build does not have.

Training: fa3-fwd ships FlashAttention-3's forward kernel only. A call that needs gradients
goes through the custom op ``magi_zoo::fa3_attention`` (`fa3_attention_trainable`): FA3's
forward, which returns the output and its log-sum-exp, and cuDNN's fused attention backward
(``aten._scaled_dot_product_cudnn_attention_backward``, what torch's own SDPA runs on
Hopper) fed with that output and LSE -- both are the softmax's natural-log LSE per (batch,
head, query), so the backward is the one SDPA would run, after a faster forward. Where
cuDNN's backward cannot run (CPU, no cuDNN attention), the backward is the attention
gradient written out in tensor ops from the same LSE (P = exp(scale * QK^T - LSE)),
which is exact and slow. The recompute step counts the op in its "attention" group.

A call with an attention mask or dropout, which FA3's forward cannot compute, runs on torch's
SDPA with them (`sdpa_bshd`), as transformers' layers and this project's own do. What is
refused, with an error that says what to use instead: dtypes other than bf16 (this build has
fp16 off; fp32 is not an FA3 dtype; fp8 needs descales no diffusers caller passes), context
parallelism (Ulysses and ring reach FA3 through `engine/parallel/fa3_cp.py`), an LSE for a
masked call; and, with gradients, fewer key/value heads than query heads and returning the LSE.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..compat import diffusers as diffusers_compat
from ..compat import torch as torch_compat
from ..custom_ops import register_custom_op
from .fp8_scales import quantize_qkv

NAME = "fa3"
MODULE = "fa3_fwd_interface"  # what the fa3-fwd wheel installs
EXTRA = "hopper"
INSTALL = f"pip install 'magi-zoo[{EXTRA}]'"

# The kernel's forward op, set by `register()` from `wheel_forward()`: the custom op
# `fa3_fwd::_flash_attn_forward` (q, k, v, ..., softmax_scale=, causal=) ->
# (out (B, S, H, D), softmax_lse (B, H, S) fp32, out_accum, lse_accum).
_forward: Any = None


def official_fa3() -> bool:
    """Whether diffusers' own ``_flash_3`` entry works (official ``flash_attn_interface``)."""
    return diffusers_compat.official_fa3_available()


def _import_kernel():
    return importlib.import_module(MODULE)


def wheel_forward():
    """The fa3-fwd wheel's forward op, ``fa3_fwd_interface._flash_attn_forward`` (raises ImportError
    when the wheel does not load; `missing_reason()` says why first). Why that private function: it is
    the wheel's ``torch.library`` custom op with a fake implementation (dynamo records one opaque node)
    and takes ``seqused_k`` (Self-Forcing's KV-cache prefix); the public ``flash_attn_func`` wraps it in
    an `autograd.Function` whose backward calls a kernel this forward-only build lacks (training pairs
    this op with cuDNN's backward instead, below) and has no ``seqused_k``."""
    return _import_kernel()._flash_attn_forward


def missing_reason() -> str | None:
    """None when fa3 can run here, else why not and what to install (one line)."""
    return None if official_fa3() else wheel_missing_reason()


def wheel_missing_reason() -> str | None:
    """None when the fa3-fwd wheel's module loads here, else why not and what to install."""
    try:
        _import_kernel()
    except ModuleNotFoundError as e:
        if e.name in (MODULE, None):
            return f"the FlashAttention-3 kernel ({MODULE}, wheel fa3-fwd) is not installed: {INSTALL}"
        return f"{MODULE} is installed but incomplete ({e}); reinstall it: {INSTALL}"
    except (ImportError, OSError, RuntimeError) as e:  # installed, but its CUDA library does not load here
        return f"{MODULE} is installed but does not load here ({type(e).__name__}: {e}); it needs a CUDA build of torch"
    return None


def available() -> bool:
    return missing_reason() is None


def transformers_missing_reason() -> str | None:
    """None when transformers' attention layers can run fa3 here, else why not: they call the
    fa3-fwd wheel's op (`transformers_attention`), which the official package alone does not
    provide, so `auto` can pick fa3 for diffusers' layers and still not for these."""
    return wheel_missing_reason()


def describe() -> str:
    """Which implementation the ``_flash_3`` slot dispatches to (for the report)."""
    if official_fa3():
        return "flash_attn_interface, diffusers' own _flash_3"
    return (f"{MODULE} in diffusers' _flash_3 slot; with gradients, cuDNN's attention backward; "
            "calls with a mask or dropout on SDPA")


def load_forward() -> None:
    """Set `_forward` to the fa3-fwd wheel's forward op (idempotent); RuntimeError naming the
    extra when the wheel does not load (the official package alone does not do: its forward has
    another signature)."""
    global _forward
    if _forward is not None:
        return
    why = wheel_missing_reason()
    if why is not None:
        raise RuntimeError(f"attention backend {NAME!r}: {why}; or choose backend='native'")
    _forward = wheel_forward()


def register():
    """Make diffusers' ``_FLASH_3`` dispatch to FA3 and return that member. Idempotent.
    Raises RuntimeError naming the extra when the kernel is missing."""
    return take_slot(diffusers_compat.fa3_member(), fa3_attention)


def take_slot(member, function):
    """Point diffusers' FlashAttention-3 registry slot `member` at `function` (this kernel's, in
    diffusers' dispatch signature) and return `member`. Idempotent. Where the official
    ``flash_attn_interface`` package is installed, diffusers' own entry in the slot works and is
    left alone (a working library backend is never replaced). Raises RuntimeError naming the
    extra when the kernel is missing."""
    if official_fa3():
        return member
    load_forward()
    if diffusers_compat.registered_backend(member) is not function:
        # The constraints run only with DIFFUSERS_ATTN_CHECKS=1 (diffusers' debug checks);
        # the refusals that matter are in the function itself, which always runs them.
        diffusers_compat.register_backend(member, function,
                                          constraints=diffusers_compat.fa3_constraints(bf16_only=True))
    return member


def registered_forward():
    """The FA3 forward op `register()` set, or an error saying to register first."""
    if _forward is None:
        raise RuntimeError(f"attention backend 'fa3' was dispatched before its kernel was registered; "
                           f"call magi_zoo.engine.kernels.fa3.register() first ({INSTALL})")
    return _forward


def refuse_context_parallel(backend: str, parallel_config: Any) -> None:
    """ValueError for a call with diffusers' context-parallel config: these dispatch functions compute
    one device's attention (Ulysses and ring reach FA3 through `engine/parallel/fa3_cp.py`)."""
    if parallel_config is not None:
        raise ValueError(f"attention backend {backend!r} does not support diffusers' context parallelism; "
                         "use backend='native' or a backend that supports it")


def require_bf16(backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """TypeError unless q, k and v are bf16, the one dtype this build of the kernel computes in."""
    if not (query.dtype == key.dtype == value.dtype == torch.bfloat16):
        raise TypeError(f"attention backend {backend!r} computes in bfloat16 only (got {query.dtype}): load the "
                        "model in bf16, or use backend='native'")


def softmax_scale(query: torch.Tensor, scale: float | None) -> float:
    """The scale the kernel is passed: the call's, else 1/sqrt(head_dim) (SDPA's default). Passed
    explicitly, as flash_attn_func does, rather than relying on the C++ default."""
    return scale if scale is not None else query.shape[-1] ** -0.5


def run_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, causal: bool,
                return_lse: bool, **kernel_kwargs):
    """The registered forward op (no gradients) in diffusers' return convention: the output, and
    with `return_lse` its LSE as (B, S, H), as diffusers' own _flash_3 and its context-parallel
    merge take it. `kernel_kwargs` go to the op (``seqused_k``)."""
    out, lse, *_ = registered_forward()(query, key, value, softmax_scale=softmax_scale(query, scale), causal=causal,
                                        **kernel_kwargs)
    return (out, lse.permute(0, 2, 1)) if return_lse else out


def sdpa_bshd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """torch's SDPA on diffusers' (B, S, H, D) layout, in the inputs' dtype (what diffusers'
    native backend computes): the calls FA3's forward cannot compute, handed back by
    `fa3_attention` and `fa3_fp8_attention`."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask,
        dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


def fa3_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
) -> torch.Tensor:
    """Diffusers' dispatch signature (q, k, v as (batch, seq, heads, head_dim)) on the FA3
    forward kernel. `enable_gqa` is accepted: FA3 handles fewer K/V heads natively.

    A call with an attention mask or dropout, which FA3's forward has neither of, runs on
    torch's SDPA (`sdpa_bshd`), as transformers' layers and this project's own do on `fa3`: a
    model may mask some of its calls and not others (a batch of Qwen-Image prompts of different
    lengths masks the padding; LTX-2 masks only its text cross-attentions), and the plan's
    backend must not make such a call fail mid-generation. Whether a call is masked is fixed per
    traced graph, so this costs no graph break."""
    refuse_context_parallel(NAME, _parallel_config)
    if attn_mask is not None or dropout_p:
        if return_lse:
            raise ValueError("attention backend 'fa3': this call has a mask or dropout, which runs on SDPA, and "
                             "SDPA returns no LSE; use backend='_native_cudnn' or 'flash' where an LSE is needed")
        return sdpa_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    require_bf16(NAME, query, key, value)
    registered_forward()  # the error that says to register first, before either path below
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        if return_lse or key.shape[2] != query.shape[2] or (is_causal and key.shape[1] != query.shape[1]):
            # FA3 aligns a causal mask bottom-right when the lengths differ, cuDNN's backward
            # top-left: only equal lengths mean the same mask to both
            raise ValueError("attention backend 'fa3' with gradients takes equal query and key/value head "
                             "counts, equal lengths when causal, and returns no LSE (its backward is cuDNN's); "
                             "use backend='native' here")
        out, _ = fa3_attention_trainable(query, key, value, softmax_scale(query, scale), is_causal)
        return out
    return run_forward(query, key, value, scale, is_causal, return_lse)


# -- training: FA3's forward, cuDNN's backward ---------------------------------------------------

def _trainable_fake(query, key, value, scale, causal):
    b, s, h, _ = query.shape
    return query.new_empty(b, s, h, value.shape[-1]), query.new_empty(b, h, s, dtype=torch.float32)


@register_custom_op("fa3_attention", fake=_trainable_fake)
def fa3_attention_trainable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3's forward as a differentiable op: (out (B, S, H, D), LSE (B, H, S) fp32) from q, k, v
    (B, S, H, D). Its backward is `attention_backward` (cuDNN's kernel where it runs)."""
    out, lse, *_ = registered_forward()(query, key, value, softmax_scale=scale, causal=causal)
    return out, lse


def cudnn_backward_available(device: torch.device) -> bool:
    """Whether cuDNN's fused attention backward can run on `device` (CUDA, cuDNN attention on)."""
    return (device.type == "cuda" and torch.backends.cudnn.is_available()
            and torch.backends.cuda.cudnn_sdp_enabled())


def attention_backward(grad_out, query, key, value, out, lse, scale: float, causal: bool):
    """dq, dk, dv of softmax(scale * q k^T) v given its output and LSE; all (B, S, H, D)."""
    if cudnn_backward_available(query.device):
        t = lambda x: x.transpose(1, 2)  # noqa: E731 -- cuDNN takes (B, H, S, D) views
        # unused without dropout, but part of the op's signature (SDPA passes its own)
        philox = torch.empty((), dtype=torch.int64, device=query.device)
        dq, dk, dv = torch_compat.cudnn_attention_backward(
            t(grad_out.contiguous()), t(query), t(key), t(value), t(out), lse.unsqueeze(-1), philox, philox,
            query.shape[1], key.shape[1], causal, scale)
        return t(dq), t(dk), t(dv)
    return reference_backward(grad_out, query, key, value, out, lse, scale, causal)


def reference_backward(grad_out, query, key, value, out, lse, scale: float, causal: bool):
    """The attention gradient in plain tensor ops (fp32), from the same output and LSE the
    cuDNN kernel takes: P = exp(scale q k^T - LSE), dV = P^T dO, dS = P (dO v^T - rowsum(dO * O)),
    dQ = scale dS k, dK = scale dS^T q. Exact; memory O(S^2): CPU and small shapes."""
    f = lambda x: x.transpose(1, 2).float()  # noqa: E731 -- (B, H, S, D)
    q, k, v, o, do = f(query), f(key), f(value), f(out), f(grad_out)
    logits = scale * q @ k.transpose(-1, -2)
    if causal:
        sq, sk = logits.shape[-2:]
        logits = logits.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.exp(logits - lse.float().unsqueeze(-1))
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq, dk = scale * ds @ k, scale * ds.transpose(-1, -2) @ q
    back = lambda g, like: g.transpose(1, 2).to(like.dtype)  # noqa: E731
    return back(dq, query), back(dk, key), back(dv, value)


def _setup_context(ctx, inputs, output):
    query, key, value, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse)
    ctx.scale, ctx.causal = scale, causal


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad_out, query, key, value, out, lse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


fa3_attention_trainable.register_autograd(_backward, setup_context=_setup_context)


# -- fp8 attention (its operands' scales: fp8_scales.py) -----------------------------------
#
# The diffusers member whose registry slot carries fp8 FA3 (`diffusers_compat.fa3_hub_member()`).
# `AttentionBackendName` cannot gain members; ``_FLASH_3_HUB`` means "FlashAttention-3 fetched
# from the kernels hub at run time", which this project never does (no network at run time). It
# is taken unless diffusers' own Hub kernel already serves it in this process (`register_fp8`).


def fa3_fp8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
) -> torch.Tensor:
    """`fa3_attention` with QK^T and PV in fp8: per-head scales, K and V smoothed (exact
    rewrites, see above). bf16 in, bf16 out; forward only, no LSE (the smoothing changes the
    logits by a per-query constant, so an LSE would not be the bf16 one).

    A call with an attention mask or dropout, which FA3's forward cannot compute, runs in bf16
    on torch's SDPA instead (`sdpa_bshd`: what diffusers' native backend computes). `precision=
    "fp8"` switches whole regions, and one block often holds both kinds of call: LTX-2's
    self-attentions are unmasked while its text cross-attentions take the prompt mask; every
    HunyuanVideo-1.5 attention is masked; Qwen-Image's joint attention is masked only when
    prompts of different lengths share a batch. Whether a call is masked is fixed per traced
    graph (the mask is an argument or None), so the choice costs no graph break. The precision
    step's report states this rule."""
    if attn_mask is not None or dropout_p:
        return sdpa_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if _parallel_config is not None or return_lse:
        raise ValueError("fp8 attention (fa3) takes no context parallelism and returns no LSE; "
                         "for fp8 matmuls with bf16 attention, load without precision='fp8' and pass "
                         "overrides={'precision': {<region>: {'matmul': 'fp8'}}}")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        raise RuntimeError("fp8 attention (fa3) is forward-only: use precision attention='bf16' and an "
                           "attention backend with a backward for training")
    if _forward is None:
        raise RuntimeError(f"fp8 attention was dispatched before the fa3 kernel was registered ({INSTALL})")
    q8, qs, k8, ks, v8, vs, vm = quantize_qkv(query, key, value)
    out, *_ = _forward(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs,
                       softmax_scale=softmax_scale(query, scale), causal=is_causal)
    return (out.float() + vm).to(query.dtype)


def register_fp8():
    """Make diffusers' ``_FLASH_3_HUB`` slot dispatch to `fa3_fp8_attention` and return that
    member. Idempotent. Raises when the fa3 kernel is missing or the slot is in use."""
    member = diffusers_compat.fa3_hub_member()
    if diffusers_compat.registered_backend(member) is fa3_fp8_attention:
        return member
    # In use only where diffusers fetched its Hub FA3 here (set_attention_backend("_flash_3_hub")).
    # `kernels` installed is not use (transformers >= 5.25 installs it); the engine sets each
    # processor's backend itself, so nothing is fetched from here.
    if diffusers_compat.hub_kernel_loaded(member):
        raise RuntimeError("fp8 attention uses diffusers' _flash_3_hub registry slot, which diffusers' Hub FA3 "
                           "kernel already serves in this process (set_attention_backend('_flash_3_hub')); "
                           "use another backend there, or keep precision attention='bf16'")
    global _forward
    if _forward is None and not official_fa3():
        register()  # sets _forward, or raises naming the extra
    elif _forward is None:  # diffusers' official FA3 serves _flash_3; fp8 needs fa3-fwd's op
        try:
            _forward = wheel_forward()
        except Exception as e:
            raise RuntimeError(f"fp8 attention needs the fa3-fwd kernel ({INSTALL}): {e}") from e
    diffusers_compat.register_backend(member, fa3_fp8_attention,
                                      constraints=diffusers_compat.fa3_constraints(bf16_only=False))
    return member


# -- transformers' attention interface (Qwen3-Omni and other transformers models) --------------
# transformers' attention layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
# with q (B, H, S, D), k/v (B, H_kv, S_k, D), a mask (or None) and flags. The engine registers
# this function under TRANSFORMERS_NAME (no "flash" in it: transformers would then hand the
# encoders flash-attn's varlen arguments; without it they call per chunk, unmasked) and gives a
# layer a config copy naming it (engine/attention/). FA3 serves the calls it computes exactly
# as SDPA would; every other call is transformers' own SDPA function, so the layer's semantics
# never depend on the backend.
TRANSFORMERS_NAME = "magi_zoo_fa3"


_NOT_SERVED = ("sliding_window", "softcap", "position_bias", "s_aux", "cu_seq_lens_q", "cu_seq_lens_k")


def serves(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, causal: bool, kwargs: dict) -> bool:
    """Whether FA3 computes this transformers attention call as SDPA would: no mask, no dropout,
    attention weights, or argument that changes the scores or packing (`_NOT_SERVED`: sliding
    window, softcap, relative position bias, sinks, varlen offsets); bf16 on CUDA; causal only with equal query and
    key lengths (FA3 aligns a causal mask bottom-right, SDPA top-left); with gradients, equal head
    counts (its training path's limits, `fa3_attention`)."""
    if attention_mask is not None or dropout or kwargs.get("output_attentions"):
        return False
    # what changes the scores or the packing (T5's relative bias, sinks, varlen offsets): SDPA's
    if any(kwargs.get(k) is not None for k in _NOT_SERVED):
        return False
    if not (query.is_cuda and query.dtype == key.dtype == torch.bfloat16):
        return False
    if causal and query.shape[2] != key.shape[2]:
        return False
    grads = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)
    return not (grads and query.shape[1] != key.shape[1])


def transformers_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                           dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                           **kwargs):
    """transformers' attention-interface signature on FA3 where `serves` says so, else
    transformers' SDPA function. Returns (out (B, S, H, D), None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = causal and query.shape[2] > 1  # one query token attends every cached key (SDPA's rule too)
    if not serves(query, key, attention_mask, dropout, causal, kwargs):
        # lazy: transformers is heavy; `import magi_zoo` never imports it
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    t = lambda x: x.transpose(1, 2)  # noqa: E731 -- FA3 takes (B, S, H, D)
    return fa3_attention(t(query), t(key), t(value), is_causal=causal, scale=scaling), None


def register_transformers() -> str:
    """Register `transformers_attention` in transformers' attention interface (idempotent) and
    load the kernel it calls; returns the implementation name. Raises RuntimeError naming the
    extra when the kernel is missing."""
    from transformers import AttentionInterface  # lazy: transformers is heavy; only a transformers model asks

    load_forward()
    AttentionInterface.register(TRANSFORMERS_NAME, transformers_attention)
    return TRANSFORMERS_NAME
