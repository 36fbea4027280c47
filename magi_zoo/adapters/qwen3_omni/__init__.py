"""Qwen3-Omni (30B-A3B) over transformers' `Qwen3OmniMoeForConditionalGeneration`.

Parts: the *thinker* (audio encoder + vision encoder + a 48-layer MoE text decoder), the
*talker* (a 20-layer MoE decoder that turns thinker states into codec tokens, with a
small code predictor) and *Code2Wav* (the vocoder, codes -> 24 kHz speech).

Works with transformers 5.17 and 5.24: sub-configs are passed as dicts (configs.py), and
module paths that moved between versions are reached through helpers here and through
class-name keys in the spec (5.24 has `thinker.model.language_model`, 5.17 `thinker.model`).
The thinker's decoder gets `prefill` / `decode_step` methods (ops.py) so the spec can
compile the variable-length prompt pass and the fixed-shape one-token step differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..base import Adapter, Variant, init_on
from .configs import PUBLISHED, TINY, build_config
from .ops import (EXPERTS_CHOICES, EXPERTS_OP_IMPL, experts_implementation, install_prefill_decode,
                  register_experts_impl, set_experts_implementation)
from .pipeline import OmniOutput, Qwen3OmniPipeline, audio_tower, thinker_text_model, vision_tower, write_wav

HUB_ID = "Qwen/Qwen3-Omni-30B-A3B-Instruct"

VARIANTS = {
    v.name: v
    for v in [
        Variant(name="qwen3-omni-30b-a3b", family="qwen3_omni", config=PUBLISHED, hub_id=HUB_ID,
                description="thinker 48L MoE 128x top-8 (3B active) + audio/vision encoders + talker + Code2Wav",
                call_defaults=dict(max_new_tokens=64, talker_max_new_tokens=256)),
        Variant(name="qwen3-omni-tiny", family="qwen3_omni", config=TINY, tiny=True,
                description="2-layer thinker (H=64, 4 experts), talker, vocoder; random, offline, for CPU tests",
                call_defaults=dict(max_new_tokens=8, talker_max_new_tokens=12)),
    ]
}


def finish(model: nn.Module) -> nn.Module:
    """What every build path does after the model exists: eval mode, the experts op
    registered as an implementation, and the thinker decoder's prefill/decode split."""
    model.eval()  # a freshly built model is in training mode (dropout on); from_pretrained evals
    register_experts_impl()
    install_prefill_decode(thinker_text_model(model.thinker))
    _install_output_hooks(model)
    return model


def _install_output_hooks(model: nn.Module) -> None:
    """Install transformers' output-capturing hooks now rather than on the first forward.

    transformers 5.24 installs them lazily, under a `threading.Lock`, inside the decorated
    forward; dynamo cannot enter a lock, so a compiled region that is a model's *first*
    call would break there (a hard error under fullgraph=True). Installed at build time,
    the first-call branch is never taken. Older versions have no lazy install: nothing to do."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    for mod in model.modules():
        if getattr(mod, "_can_record_outputs", None):
            maybe_install_capturing_hooks(mod)


def _init_fused_experts(model: nn.Module, std: float = 0.02) -> None:
    """Initialise every fused expert tensor (3-D gate_up_proj / down_proj).

    transformers' `_init_weights` (seen in 5.24) skips the talker's
    Qwen3OmniMoeTalkerTextExperts, whose tensors are created with `torch.empty`: they
    would hold whatever memory held before (seen: values up to 1e38, sometimes inf).
    std 0.02 is the configs' `initializer_range`.
    """
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__.endswith("Experts"):
                for p in mod.parameters(recurse=False):
                    p.normal_(0.0, std)


class Qwen3OmniAdapter(Adapter):
    """Adapter for Qwen3-Omni: builds the model + an offline (or shipped) tokenizer."""

    family = "qwen3_omni"
    spec_file = "qwen3_omni.toml"
    variants = VARIANTS
    aliases = {"qwen3-omni": "qwen3-omni-30b-a3b", "qwen3_omni": "qwen3-omni-30b-a3b"}

    def build(self, variant: Variant, *, weights: Any, dtype: torch.dtype, device: torch.device,
              config: dict | None = None) -> Qwen3OmniPipeline:
        """`config` replaces the variant's dict recipe for random init (the benchmark uses
        the published config with fewer thinker layers)."""
        from transformers import Qwen3OmniMoeForConditionalGeneration

        from .tokenizer import build_tokenizer

        source = self.weights_source(variant, weights)
        if source == "random":
            torch.manual_seed(0)  # random weights are reproducible run to run
            cfg = build_config(config if config is not None else variant.config)
            with init_on(device, dtype):
                model = Qwen3OmniMoeForConditionalGeneration(cfg)
            _init_fused_experts(model)
            return Qwen3OmniPipeline(finish(model), build_tokenizer())
        local = Path(source).is_dir()
        # A path loads strictly offline; anything else is a hub id, fetched by transformers.
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            source, dtype=dtype, local_files_only=local).to(device)
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
        except (OSError, ValueError):  # a checkpoint saved without its tokenizer
            tokenizer = build_tokenizer()
        return Qwen3OmniPipeline(finish(model), tokenizer)

    def components(self, pipe: Qwen3OmniPipeline) -> dict[str, nn.Module]:
        """thinker, plus talker and code2wav when audio output is enabled."""
        m = pipe.model
        out = {"thinker": m.thinker}
        if pipe.has_talker:
            out.update(talker=m.talker, code2wav=m.code2wav)
        return out

    def run(self, handle, *, prompt: str, out: Path, progress: bool = True, audio_out: Path | str | None = None,
            max_new_tokens: int | None = None, seed: int | None = None, **kwargs) -> Path:
        """Write the reply to `out` (text) and, with `audio_out`, the speech as a 24 kHz WAV."""
        bad = sorted(k for k, v in kwargs.items() if v is not None)
        if bad:
            raise ValueError(f"{handle.variant.name} takes --prompt, --max-new-tokens, --audio-out and --seed; "
                             f"it cannot use {', '.join('--' + k.replace('_', '-') for k in bad)}")
        pipe: Qwen3OmniPipeline = handle.pipe
        if audio_out is not None and not pipe.has_talker:
            raise ValueError(f"--audio-out needs the talker, which {handle.variant.name} was built without")
        if seed is not None:
            torch.manual_seed(seed)  # greedy decoding ignores it; kept for parity with other families
        d = handle.variant.call_defaults
        res: OmniOutput = pipe(prompt, max_new_tokens=max_new_tokens or d["max_new_tokens"],
                               return_audio=audio_out is not None,
                               **({"talker_max_new_tokens": d["talker_max_new_tokens"]} if audio_out else {}))
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(res.text + "\n", encoding="utf-8")
        if progress:
            print(f"{len(res.token_ids)} tokens: {res.token_ids}", flush=True)
        if audio_out is not None:
            write_wav(audio_out, res.audio, res.sample_rate)
            if progress:
                print(f"wrote {audio_out} ({res.audio.size / res.sample_rate:.2f} s at {res.sample_rate} Hz)", flush=True)
        return out


__all__ = ["Qwen3OmniAdapter", "Qwen3OmniPipeline", "OmniOutput", "VARIANTS", "EXPERTS_CHOICES", "EXPERTS_OP_IMPL",
           "set_experts_implementation", "experts_implementation", "thinker_text_model", "audio_tower",
           "vision_tower", "write_wav", "finish"]
