"""transformers-private names magi_zoo uses, each with why no public API does the job and
the versions checked (transformers 5.17 on the GPU image, the newest on CI). transformers
is imported lazily: `import magi_zoo` stays cheap and never imports it."""

from __future__ import annotations

import copy
from typing import Any

# -- attention implementation of a layer (engine/attention) ---------------------------------------------
# transformers' attention layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` at call
# time. Why private: the public `PreTrainedModel.set_attn_implementation` sets it model-wide, on the
# model's config and every sub-config; a per-region choice gives one layer its own config copy.


def has_attn_implementation(config: Any) -> bool:
    """Whether `config` names an attention implementation (a transformers `PretrainedConfig`).
    checked on: transformers 5.17, 5.23, 5.24"""
    return config is not None and hasattr(config, "_attn_implementation")


def with_attn_implementation(config: Any, implementation: str) -> Any:
    """A shallow copy of `config` naming `implementation`; the original (and the sub-configs the copy
    shares with it) stay as they are: the attribute itself is written, since the property's setter
    would also set it on the shared sub-configs. checked on: transformers 5.17, 5.23, 5.24"""
    out = copy.copy(config)
    out.__dict__["_attn_implementation_internal"] = implementation
    return out


# -- adapters: Wan (the UMT5 encoder), Qwen3-Omni ------------------------------------------------------


def keep_in_fp32_modules(model: Any) -> tuple[str, ...]:
    """The submodule names a transformers model keeps in float32 on a float16 load (T5's `wo`). Why
    private: `PreTrainedModel._keep_in_fp32_modules` is what `from_pretrained` obeys, and no public
    API reads it; a model filled from another layout must follow the same rule.
    checked on: transformers 5.17, 5.24"""
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())


def install_output_capturing_hooks(model: Any) -> None:
    """Install, now, the output-capturing hooks transformers would install on the first forward of
    each module that records outputs (a no-op on releases without the lazy install). Why private:
    the modules that need them say so in `_can_record_outputs`, read by transformers' own
    `maybe_install_capturing_hooks`; nothing public lists them. checked on: transformers 5.17 (no
    lazy install: nothing to do), 5.24"""
    try:
        # lazy: transformers is heavy; `import magi_zoo` never imports it
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    for module in model.modules():
        if getattr(module, "_can_record_outputs", None):
            maybe_install_capturing_hooks(module)


def qwen3_omni_audio_output_lengths() -> Any:
    """transformers' `_get_feat_extract_output_lengths` of the Qwen3-Omni audio encoder (mel frames ->
    audio tokens; releases differ in whether it takes the window), or None where this release has
    none. Why private: the module-level helper is what the official processor's placeholder count
    uses, with no public name. checked on: transformers 5.17, 5.24"""
    # lazy: transformers is heavy; `import magi_zoo` never imports it
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe

    return getattr(modeling_qwen3_omni_moe, "_get_feat_extract_output_lengths", None)


# A MoE experts module dispatches, at call time, on the `_experts_implementation` of the config it
# holds (transformers' `use_experts_implementation`). Why private: the public setter switches a whole
# model from its top config; switching the experts modules' own configs reaches every MoE part
# (thinker, talker, code predictor) whichever config object each holds.

def has_experts_implementation(config: Any) -> bool:
    """Whether `config` names an experts implementation. checked on: transformers 5.17, 5.24"""
    return config is not None and hasattr(config, "_experts_implementation")


def config_experts_implementation(config: Any) -> Any:
    """The experts implementation `config` names. checked on: transformers 5.17, 5.24"""
    return config._experts_implementation


def set_config_experts_implementation(config: Any, implementation: str) -> None:
    """Make the experts modules holding `config` dispatch to `implementation`.
    checked on: transformers 5.17, 5.24"""
    config._experts_implementation = implementation
