"""diffusers-private names magi_zoo uses, each with why no public API does the job and the
versions checked (diffusers 0.42.1). diffusers is imported lazily: `import magi_zoo` stays
cheap and never imports it."""

from __future__ import annotations

from typing import Any, Callable

# -- attention dispatch: backends and their registry (engine/attention, precision, parallel, kernels/fa3) --
#
# diffusers' attention layers call `dispatch_attention_fn(..., backend=processor._attention_backend)`,
# which looks the function up in `_AttentionBackendRegistry` by an `AttentionBackendName` member.
# The registry class is private and its public surface is `register` / `get_active_backend` /
# `list_backends` only: reading one entry back, putting an earlier entry back and asking which
# backends take context parallelism all need its private dicts.


def _dispatch():
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.models import attention_dispatch

    return attention_dispatch


def fa3_member() -> Any:
    """`AttentionBackendName._FLASH_3`, the slot the engine's fa3 kernel serves (kernels/fa3.py
    says why that slot). Why private: diffusers marks its FA3 backends experimental by the leading
    underscore; there is no public member for them. checked on: diffusers 0.42.1"""
    return _dispatch().AttentionBackendName._FLASH_3


def fa3_hub_member() -> Any:
    """`AttentionBackendName._FLASH_3_HUB`, the slot the engine's fp8 FA3 serves. Why private: as
    `fa3_member`. checked on: diffusers 0.42.1"""
    return _dispatch().AttentionBackendName._FLASH_3_HUB


def fa3_varlen_member() -> Any:
    """`AttentionBackendName._FLASH_VARLEN_3`, diffusers' FlashAttention-3 backend for key-padding
    masks, the slot the engine's fa3_varlen kernel serves (kernels/fa3_varlen.py). Why private: as
    `fa3_member`. checked on: diffusers 0.42.1"""
    return _dispatch().AttentionBackendName._FLASH_VARLEN_3


def varlen_key_mask_function() -> Callable:
    """diffusers' function that reads the (batch, seq_len_k) valid-key mask from a boolean mask of
    any shape its FlashAttention varlen backends take (every query of every head reduced):
    `fn(attn_mask, batch, seq_len_k)`. Returned, not called, so a caller binds it outside a
    compiled region (dynamo cannot import diffusers' lazy modules). The harness's same-kernel
    baseline reads masks with it, so the baseline pays what diffusers pays. Why private:
    `_normalize_attn_mask` is the helper those backends call; no public function exposes it.
    checked on: diffusers 0.42.1"""
    return _dispatch()._normalize_attn_mask


def official_fa3_available() -> bool:
    """Whether diffusers' own `_flash_3` entry works (the official `flash_attn_interface` package is
    installed). Why private: diffusers keeps the answer in the module flag `_CAN_USE_FLASH_ATTN_3`
    (read at each call: tests set it); `diffusers.utils.is_flash_attn_3_available` exists, but the
    flag is what dispatch itself obeys. checked on: diffusers 0.42.1"""
    return bool(getattr(_dispatch(), "_CAN_USE_FLASH_ATTN_3", False))


def check_backend_requirements(member: Any) -> None:
    """Raise RuntimeError naming the package to install when backend `member`'s kernels are missing
    (a no-op where this diffusers lacks the check). Why private: `_check_attention_backend_requirements`
    is the check `set_attention_backend` runs; no public function runs it for one member.
    checked on: diffusers 0.42.1"""
    check = getattr(_dispatch(), "_check_attention_backend_requirements", None)
    if check is not None:
        check(member)


def hub_kernel_loaded(member: Any) -> bool:
    """Whether diffusers has fetched a Hub kernel (the `kernels` package's download) for backend
    `member`: a `set_attention_backend` / `attention_backend` call with that hub member ran in
    this process, so the slot is diffusers' own in use. Having `kernels` installed is not that
    (transformers >= 5.25 installs it for everyone). Why private: `_HUB_KERNELS_REGISTRY` holds the
    fetched functions; no public function says whether one was fetched. checked on: diffusers 0.42.1"""
    config = getattr(_dispatch(), "_HUB_KERNELS_REGISTRY", {}).get(member)
    return config is not None and any(getattr(config, name, None) is not None
                                      for name in ("kernel_fn", "wrapped_forward_fn", "wrapped_backward_fn"))


def registered_backend(member: Any) -> Callable | None:
    """The function diffusers' dispatch calls for backend `member` (None: no entry). Why private:
    the registry's public `get_active_backend` answers for the global default only.
    checked on: diffusers 0.42.1"""
    return _dispatch()._AttentionBackendRegistry._backends.get(member)


def backend_constraints(member: Any) -> list[Callable]:
    """The input checks registered with backend `member` (empty: none or no entry). Why private:
    as `registered_backend`. checked on: diffusers 0.42.1"""
    return list(_dispatch()._AttentionBackendRegistry._constraints.get(member) or [])


def register_backend(member: Any, fn: Callable, *, constraints: list | None = None,
                     context_parallel: bool = False) -> None:
    """Make dispatch call `fn` for backend `member` (diffusers' own `register`, which its backends
    use). Why private: the registry class is private; `register` is its public method.
    checked on: diffusers 0.42.1"""
    _dispatch()._AttentionBackendRegistry.register(member, constraints=constraints,
                                                   supports_context_parallel=context_parallel)(fn)


def backend_entry(member: Any) -> tuple:
    """Everything the registry holds for `member` (opaque), to put back with `restore_backend_entry`. Why
    private: the registry has no unregister; an exact undo reads and writes its dicts.
    checked on: diffusers 0.42.1"""
    r = _dispatch()._AttentionBackendRegistry
    return (member in r._backends, r._backends.get(member), r._constraints.get(member),
            r._supported_arg_names.get(member), member.value in r._supports_context_parallel)


def restore_backend_entry(member: Any, entry: tuple) -> None:
    """Put `member`'s registry entry back as `backend_entry` read it. Why private: as
    `backend_entry`. checked on: diffusers 0.42.1"""
    r = _dispatch()._AttentionBackendRegistry
    present, fn, constraints, names, context_parallel = entry
    if present:
        r._backends[member], r._constraints[member], r._supported_arg_names[member] = fn, constraints, names
    else:
        for table in (r._backends, r._constraints, r._supported_arg_names):
            table.pop(member, None)
    if context_parallel:
        r._supports_context_parallel.add(member.value)
    else:
        r._supports_context_parallel.discard(member.value)


def context_parallel_backends() -> set[str]:
    """The backend names diffusers' context parallelism runs on. Why private: the registry keeps them
    in `_supports_context_parallel` and asks through its private `_is_context_parallel_available`.
    checked on: diffusers 0.42.1"""
    return set(_dispatch()._AttentionBackendRegistry._supports_context_parallel)


def active_backend() -> Any:
    """The member dispatch uses for a processor that names none (the process default). Why
    private: `get_active_backend` is public, on the private registry class.
    checked on: diffusers 0.42.1"""
    return _dispatch()._AttentionBackendRegistry.get_active_backend()[0]


def fa3_constraints(*, bf16_only: bool = True) -> list[Callable]:
    """diffusers' own input checks for an FA3-shaped kernel (CUDA, (B, S, H, D) shapes, and bf16
    when `bf16_only`), run by dispatch under DIFFUSERS_ATTN_CHECKS=1. Why private: the checks are
    module functions `_check_device_cuda` / `_check_shape` / `_check_qkv_dtype_bf16`, which its own
    FA3 entry registers. checked on: diffusers 0.42.1"""
    ad = _dispatch()
    return [ad._check_device_cuda, *([ad._check_qkv_dtype_bf16] if bf16_only else []), ad._check_shape]


def templated_context_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                         return_lse, *, forward_op: Callable, backward_op: Callable,
                                         parallel_config: Any) -> Any:
    """diffusers' Ulysses / ring attention around a kernel given as `forward_op` / `backward_op`
    (its forward-op contract). Why private: `_templated_context_parallel_attention` is how each of
    diffusers' own backends adds context parallelism; there is no public hook for another kernel.
    checked on: diffusers 0.42.1"""
    return _dispatch()._templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
        forward_op=forward_op, backward_op=backward_op, _parallel_config=parallel_config)


# -- attention processors' backend (engine/attention, precision, parallel) ----------------------------
# Why private: a processor keeps its dispatch backend in `_attention_backend`; the public setters
# (`ModelMixin.set_attention_backend`, `AttentionModuleMixin.set_attention_backend`) set it model- or
# layer-wide from a name, and nothing reads it back, which a per-region set with an exact undo needs.

def has_backend_slot(processor: Any) -> bool:
    """Whether `processor` dispatches through diffusers' attention dispatch (it holds a backend).
    checked on: diffusers 0.42.1"""
    return processor is not None and hasattr(processor, "_attention_backend")


def processor_backend(processor: Any) -> Any:
    """The backend `processor` dispatches to (an `AttentionBackendName` member, a name, or None: the
    process default). checked on: diffusers 0.42.1"""
    return processor._attention_backend


def set_processor_backend(processor: Any, backend: Any) -> None:
    """Make `processor` dispatch to `backend` (None: the process default). checked on: diffusers 0.42.1"""
    processor._attention_backend = backend


# -- context parallelism and model hooks (engine/parallel) ---------------------------------------------

PARALLEL_CONFIG_ATTR = "_parallel_config"
"""The attribute `ModelMixin.enable_parallelism` sets on the model and on each attention processor
(what dispatch hands the Ulysses / ring attention). Why private: no public API reads or clears it,
and `remove_context_parallel` leaves it set, so an exact undo restores it by name.
checked on: diffusers 0.42.1"""


def processor_parallel_config(processor: Any) -> Any:
    """The parallel config `processor` hands dispatch (`PARALLEL_CONFIG_ATTR`; None: the processor runs
    on one device), what a processor that dispatches attention itself passes on, as diffusers' own do.
    checked on: diffusers 0.42.1"""
    return getattr(processor, PARALLEL_CONFIG_ATTR, None)

HOOK_REGISTRY_ATTR = "_diffusers_hook"
"""The instance attribute where diffusers keeps a module's `HookRegistry`. Why private:
`HookRegistry.check_if_exists_or_initialize` creates one when asked, and nothing removes an empty
one, so an exact undo tells an existing registry from one it made by this name.
checked on: diffusers 0.42.1"""


def cp_plan(model: Any) -> dict | None:
    """The model's context-parallel plan (which submodule inputs diffusers splits, which outputs it
    gathers), or None when its class declares none. Why private: transformers declare it as the class
    attribute `_cp_plan`, which `enable_parallelism` reads; there is no accessor.
    checked on: diffusers 0.42.1"""
    return getattr(model, "_cp_plan", None)


def cp_split_inputs(model: Any) -> dict[str, list[str]]:
    """{submodule id: the names of its inputs the plan splits along the sequence} for the plan's
    entries that name one submodule (no '*' pattern) and split inputs, not outputs. Why private: the
    entries are `ContextParallelInput`s of the private module `diffusers.models._modeling_parallel`
    (re-exported nowhere public). checked on: diffusers 0.42.1"""
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.models._modeling_parallel import ContextParallelInput

    out = {}
    for mid, entry in (cp_plan(model) or {}).items():
        if not isinstance(entry, dict) or "*" in mid:
            continue
        names = [n for n, cpi in entry.items() if isinstance(n, str) and isinstance(cpi, ContextParallelInput)
                 and not cpi.split_output]
        if names:
            out[mid] = names
    return out


def stateful(hook_cls: type) -> type:
    """Class decorator: mark a `ModelHook` subclass stateful, so `model.cache_context(name)` hands it
    the name of each call (cond / uncond) through its `StateManager`. Why private: diffusers selects
    the hooks it informs by the class flag `_is_stateful`; there is no public way to ask for it.
    checked on: diffusers 0.42.1"""
    hook_cls._is_stateful = True
    return hook_cls


def cache_context_name(state: Any) -> str | None:
    """The name of the `cache_context` a stateful hook's `StateManager` is in now, or None outside
    one. Why private: the public `StateManager.context` raises outside a context, where a hook must
    tell "no context" apart; the context lives in `_context`. checked on: diffusers 0.42.1"""
    context = state._context
    return context.name if context is not None else None


# -- step caching (engine/step_cache) -------------------------------------------------------------

CACHE_CONFIG_ATTR = "_cache_config"
"""Where `CacheMixin.enable_cache` keeps the model's cache config (`disable_cache` sets it back to
None rather than removing it). Why private: the public `is_cache_enabled` says only whether a cache
is on; an exact undo and the message for a cache enabled outside the plan need the attribute.
checked on: diffusers 0.42.1"""

_HOOKED_INSTANCE_ATTRS = ("forward", HOOK_REGISTRY_ATTR, CACHE_CONFIG_ATTR)


def cache_config(model: Any) -> Any:
    """The cache config `enable_cache` stored on this model instance, or None (caching off). Why
    private: as `CACHE_CONFIG_ATTR`. checked on: diffusers 0.42.1"""
    return model.__dict__.get(CACHE_CONFIG_ATTR)


def hook_registry(module: Any) -> Any:
    """The `HookRegistry` diffusers' hooks keep on this instance, or None. Why private: as
    `HOOK_REGISTRY_ATTR` (asking diffusers would create one). checked on: diffusers 0.42.1"""
    return module.__dict__.get(HOOK_REGISTRY_ATTR)


def hook_state(module: Any) -> dict[str, Any]:
    """What registering diffusers hooks and enabling a cache change on one instance, as found: its
    instance `forward` (the registry's wrapper), its hook registry and its cache config, each only
    where the instance holds one. `restore_hook_state` puts exactly this back. Why private:
    `disable_cache` leaves the wrapper `forward`, the registries and a None config behind.
    checked on: diffusers 0.42.1"""
    return {a: module.__dict__[a] for a in _HOOKED_INSTANCE_ATTRS if a in module.__dict__}


def restore_hook_state(module: Any, state: dict[str, Any]) -> None:
    """Put back what `hook_state` read (attributes it did not find are removed). Why private: as
    `hook_state`. checked on: diffusers 0.42.1"""
    for attr in _HOOKED_INSTANCE_ATTRS:
        if attr in state:
            object.__setattr__(module, attr, state[attr])
        else:
            module.__dict__.pop(attr, None)


# -- offload: where a pipeline runs when its weights stream (engine/offload) -----------------------
# diffusers pipelines create prompt ids, latents and timesteps on `_execution_device`, which is the
# first component's parameter device unless the component carries an accelerate-style `_hf_hook`
# with an `execution_device` (the convention accelerate's sequential offload uses). With streamed
# units that parameter device is the host; the offload runtime marks components with the card.

_EXECUTION_HOOK_ATTR = "_hf_hook"


class ExecutionDeviceMark:
    """An accelerate-style hook that only names the execution device; `detach_hook` keeps
    `pipeline.remove_all_hooks()` working with the mark in place."""

    def __init__(self, device: Any):
        self.execution_device = device

    def detach_hook(self, module: Any) -> Any:
        return module


def mark_execution_device(module: Any, device: Any) -> bool:
    """Mark `module` as executing on `device` for diffusers' `_execution_device`, unless it carries
    a hook of its own; True when marked. Why private: `DiffusionPipeline._execution_device` reads
    the instance attribute `_hf_hook` (accelerate's), and no public API sets the device it reports.
    checked on: diffusers 0.42.1"""
    if _EXECUTION_HOOK_ATTR in module.__dict__:
        return False
    module.__dict__[_EXECUTION_HOOK_ATTR] = ExecutionDeviceMark(device)
    return True


def unmark_execution_device(module: Any) -> None:
    """Take off the mark `mark_execution_device` set (a hook someone else set stays). Why private:
    as `mark_execution_device`. checked on: diffusers 0.42.1"""
    if isinstance(module.__dict__.get(_EXECUTION_HOOK_ATTR), ExecutionDeviceMark):
        del module.__dict__[_EXECUTION_HOOK_ATTR]


# -- adapters: Wan, Flux, Self-Forcing (models' own private names) -----------------------------------


def keep_in_fp32_modules(model: Any) -> tuple[str, ...]:
    """The submodule names a diffusers model (or model class) keeps in float32 whatever the load
    dtype (Wan's norms, time embedder, RoPE). Why private: `ModelMixin._keep_in_fp32_modules` is
    what `from_pretrained` obeys, and no public API reads it; a model built from a config (random
    weights) or loaded from another layout must follow the same rule. checked on: diffusers 0.42.1"""
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())


def wan_qkv_projections() -> Callable:
    """diffusers' `(attn, hidden_states, encoder_hidden_states) -> (query, key, value)` of a
    `WanAttention` (fused or separate projections). Returned once, called on every layer: a
    processor that changes what comes after the projections calls the same function
    `WanAttnProcessor` does. Why private: `transformer_wan._get_qkv_projections` has no public
    name. checked on: diffusers 0.42.1"""
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.models.transformers import transformer_wan

    return transformer_wan._get_qkv_projections


def flux_qkv_projections() -> Callable:
    """diffusers' `(attn, hidden_states, encoder_hidden_states) -> (query, key, value,
    encoder_query, encoder_key, encoder_value)` of a `FluxAttention`. Why private: as
    `wan_qkv_projections` (`transformer_flux._get_qkv_projections`). checked on: diffusers 0.42.1"""
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.models.transformers import transformer_flux

    return transformer_flux._get_qkv_projections


def flux2_qkv_projections() -> Callable:
    """diffusers' `(attn, hidden_states, encoder_hidden_states) -> (query, key, value,
    encoder_query, encoder_key, encoder_value)` of a `Flux2Attention` (a double-stream block's),
    fused or separate projections. Why private: as `wan_qkv_projections`
    (`transformer_flux2._get_qkv_projections`). checked on: diffusers 0.42.1"""
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.models.transformers import transformer_flux2

    return transformer_flux2._get_qkv_projections


def flux_latent_image_ids(pipe: Any, batch: int, height: int, width: int, device: Any, dtype: Any) -> Any:
    """The (height * width, 3) position ids [0, row, col] `FluxPipeline` gives the transformer for a
    packed-latent grid of height x width tokens. Why private: `FluxPipeline._prepare_latent_image_ids`
    is the pipeline's own helper, with no public counterpart; a denoiser call built outside the
    pipeline must pass the same ids. checked on: diffusers 0.42.1"""
    return pipe._prepare_latent_image_ids(batch, height, width, device, dtype)


def wan_vae_decode_latent_frame(vae: Any, frame: Any, *, first_chunk: bool) -> Any:
    """Decode one latent frame (B, C, 1, h, w), after `post_quant_conv`, with `AutoencoderKLWan`'s
    causal decoder, reading and updating the VAE's feature cache (one slot per causal conv) as its
    own `_decode` loop does per frame: the slot counter restarts at 0, `first_chunk` only for a
    video's first frame. The cache lives from `vae.clear_cache()` (public) to the next one, so a
    video can be decoded across calls. Why private: `_decode` decodes a whole latent video in one
    call; its per-frame state (`_feat_map`, `_conv_idx`) has no public API. checked on: diffusers 0.42.1"""
    vae._conv_idx = [0]
    return vae.decoder(frame, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=first_chunk)


def wan_causal_conv_padding(conv: Any) -> tuple[int, int, int]:
    """(time before, height, width) zero padding of diffusers' `WanCausalConv3d`: its forward pads
    its input with `F.pad` by `_padding` = (w, w, h, h, 2 * t, 0) -- all of the time padding in
    front (causal), less the frames a cached context supplies -- and convolves with no padding of
    its own. Why private: the padding is kept only as `_padding` (the public `padding` is set to
    zeros); a forward that lets the convolution pad height and width itself must read it.
    checked on: diffusers 0.42.1"""
    w, w_after, h, h_after, t, t_after = conv._padding
    if (w, h, 0) != (w_after, h_after, t_after):
        raise ValueError(f"WanCausalConv3d padding {conv._padding}: expected symmetric height / width and "
                         "time padding in front only")
    return t, h, w
