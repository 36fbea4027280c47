"""`Qwen3OmniPipeline`: the native object of the Qwen3-Omni family -- the transformers model,
its tokenizer, and a generate loop with a reusable static KV cache for the thinker."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from .configs import EOS_TOKEN_ID, SAMPLE_RATE

# The thinker's static KV cache is sized in buckets of this many tokens, so prompts of
# similar length share one cache shape, hence one compiled (and CUDA-graphed) decode step.
CACHE_BUCKET = 256


def thinker_text_model(thinker: nn.Module) -> nn.Module:
    """The thinker's decoder: `thinker.model.language_model` (transformers 5.24) or
    `thinker.model` (5.17)."""
    return getattr(thinker.model, "language_model", thinker.model)


def audio_tower(thinker: nn.Module) -> nn.Module:
    """`thinker.audio_tower` (5.17) or `thinker.model.audio_tower` (5.24)."""
    return getattr(thinker, "audio_tower", None) or thinker.model.audio_tower


def vision_tower(thinker: nn.Module) -> nn.Module:
    """`thinker.visual` (5.17) or `thinker.model.visual` (5.24)."""
    return getattr(thinker, "visual", None) or thinker.model.visual


def _cache_kwarg(thinker: nn.Module) -> str:
    """The name generate() takes a Cache under: `cache` (5.24) or `past_key_values` (5.17)."""
    import inspect

    from .ops import PrefillDecodeMixin

    lib_cls = next(c for c in type(thinker_text_model(thinker)).__mro__ if not issubclass(c, PrefillDecodeMixin))
    params = inspect.signature(lib_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclasses.dataclass
class OmniOutput:
    """One generation: the reply text, its token ids, and speech when the talker ran."""

    text: str
    token_ids: list[int]
    audio: np.ndarray | None = None  # float32 mono waveform in [-1, 1]
    sample_rate: int = SAMPLE_RATE


class Qwen3OmniPipeline:
    """Call with a prompt; returns an `OmniOutput`. Greedy by default (deterministic)."""

    def __init__(self, model: nn.Module, tokenizer: Any):
        self.model = model
        self.tokenizer = tokenizer
        self._cache = None  # (batch, length, StaticCache), reused: a fixed address keeps CUDA graphs valid across calls

    @property
    def has_talker(self) -> bool:
        return getattr(self.model, "has_talker", False) and getattr(self.model, "talker", None) is not None

    def encode(self, prompt: str) -> dict[str, torch.Tensor]:
        """Chat-template the prompt as one user turn and tokenize it."""
        msgs = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = self.tokenizer(text, return_tensors="pt")
        dev = self.model.thinker.lm_head.weight.device
        return {k: v.to(dev) for k, v in enc.items()}

    def static_cache(self, batch: int, length: int):
        """A StaticCache of at least `length` tokens (rounded up to CACHE_BUCKET), reused
        across calls when it is big enough; reset before reuse."""
        from transformers import StaticCache

        need = -(-length // CACHE_BUCKET) * CACHE_BUCKET
        if self._cache is None or self._cache[0] != batch or self._cache[1] < need:
            cfg = self.model.thinker.config.get_text_config()
            cache = StaticCache(config=cfg, max_cache_len=need)
            # Allocate now rather than on the first write, inside the compiled prefill: a
            # lazily initialised cache is a different guard state on the first call than on
            # every later one, which would cost a recompile (5.24 API; older: lazy).
            if hasattr(cache, "early_initialization"):
                p = self.model.thinker.lm_head.weight
                cache.early_initialization(batch_size=batch, num_heads=cfg.num_key_value_heads,
                                           head_dim=getattr(cfg, "head_dim", None)
                                           or cfg.hidden_size // cfg.num_attention_heads,
                                           dtype=p.dtype, device=p.device)
            self._cache = (batch, need, cache)
        else:
            self._cache[2].reset()
        return self._cache[2]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 16, return_audio: bool = False, speaker: str = "Ethan",
                 talker_max_new_tokens: int = 32, ignore_eos: bool = False, **kwargs):
        """Greedy generation through `model.generate`: token ids [B, L+N], plus the waveform
        [B, 1, samples] when `return_audio`. The thinker decodes against a static cache
        (fixed decode-step shapes); transformers' own auto-compile is turned off so that
        only the magi_zoo plan compiles anything."""
        if return_audio and not self.has_talker:
            raise ValueError("this model was built without the talker (enable_audio_output=False); "
                             "audio output is not available")
        b, n = input_ids.shape
        gen = dict(thinker_max_new_tokens=max_new_tokens, thinker_do_sample=False,
                   thinker_disable_compile=True,
                   **{f"thinker_{_cache_kwarg(self.model.thinker)}": self.static_cache(b, n + max_new_tokens)},
                   thinker_eos_token_id=None if ignore_eos else EOS_TOKEN_ID)
        if return_audio:
            gen.update(speaker=speaker, talker_max_new_tokens=talker_max_new_tokens, talker_do_sample=False,
                       talker_disable_compile=True)
        gen.update(kwargs)
        if attention_mask is not None:
            gen["attention_mask"] = attention_mask
        return self.model.generate(input_ids, return_audio=return_audio, **gen)

    def __call__(self, prompt: str, *, max_new_tokens: int = 16, return_audio: bool | None = None,
                 **kwargs) -> OmniOutput:
        """Text in, text (and speech, when the talker is on and `return_audio` is not False) out."""
        return_audio = self.has_talker if return_audio is None else return_audio
        enc = self.encode(prompt)
        out = self.generate(enc["input_ids"], enc.get("attention_mask"), max_new_tokens=max_new_tokens,
                            return_audio=return_audio, **kwargs)
        seq, wav = out if return_audio else (out, None)
        seq = seq if torch.is_tensor(seq) else seq.sequences
        ids = seq[0, enc["input_ids"].shape[1]:].tolist()
        audio = None
        if wav is not None:
            wav = wav[0] if isinstance(wav, (list, tuple)) else wav
            audio = wav.reshape(-1).float().cpu().numpy()
        return OmniOutput(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids, audio=audio)

    def save_pretrained(self, path: str | Path) -> Path:
        """Model (safetensors, the official layout) and tokenizer into one directory."""
        path = Path(path)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path
