"""`Qwen3OmniPipeline`: the native object of the Qwen3-Omni family -- the transformers model,
its tokenizer, and a generate loop with a reusable static KV cache for the thinker."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from .configs import EOS_TOKEN_ID, SAMPLE_RATE, check_voice, voices
from .inputs import MediaProcessor, expand_placeholders, read_image, read_wav, to_rgb
from .ops import PrefillDecodeMixin
from .regions import check_distinct_code

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
    lib_cls = next(c for c in type(thinker_text_model(thinker)).__mro__ if not issubclass(c, PrefillDecodeMixin))
    params = inspect.signature(lib_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@contextlib.contextmanager
def _talker_sees_audio_window(model: nn.Module, needed: bool):
    """Work around transformers 5.24: with an audio prompt the talker's M-RoPE index reads
    `self.config.audio_config.n_window` from the *talker* config, which has no audio config
    (AttributeError, also in plain transformers). For the call only, the talker config
    points at the thinker's audio config (the window it needs); nothing is left behind, so a
    saved config is unchanged."""
    cfg = getattr(getattr(model, "talker", None), "config", None)
    if not needed or cfg is None or "audio_config" in cfg.__dict__ or hasattr(type(cfg), "audio_config"):
        yield
        return
    cfg.audio_config = model.config.thinker_config.audio_config
    try:
        yield
    finally:
        del cfg.audio_config


@dataclasses.dataclass
class OmniOutput:
    """One generation: the reply text, its token ids, and speech when the talker ran."""

    text: str
    token_ids: list[int]
    audio: np.ndarray | None = None  # float32 mono waveform in [-1, 1]
    sample_rate: int = SAMPLE_RATE


class Qwen3OmniPipeline:
    """Call with a prompt; returns an `OmniOutput`. Greedy by default (deterministic)."""

    def __init__(self, model: nn.Module, tokenizer: Any, source: str | Path | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.source = source  # the checkpoint directory (its preprocessor config), if loaded from one
        self._media = None
        self._cache = None  # (batch, length, StaticCache), reused: a fixed address keeps CUDA graphs valid across calls

    @property
    def has_talker(self) -> bool:
        return getattr(self.model, "has_talker", False) and getattr(self.model, "talker", None) is not None

    @property
    def voices(self) -> list[str]:
        """The speech output's voices, as the checkpoint's talker config names them
        (`speaker_id`; the published Instruct model: Chelsie, Ethan, Aiden)."""
        return voices(speaker_id=getattr(self.model.config.talker_config, "speaker_id", None) or {})

    def check_voice(self, voice: str) -> str:
        """`voice` if the talker knows it (any case), else an error with the closest names."""
        return check_voice(voice, self.voices)

    def media(self):
        """The audio / image processor (made on first use: text-only runs never build it)."""
        if self._media is None:
            self._media = MediaProcessor.for_model(self.model, self.source)
        return self._media

    def encode(self, prompt: str, *, audio=None, image=None) -> dict[str, torch.Tensor]:
        """Chat-template the prompt as one user turn -- after an image and an audio clip when
        given, as the official examples order them -- and tokenize it; the media become
        the encoders' inputs and their placeholders are expanded to one token per output.

        audio: a path (.wav) or a float waveform at 16 kHz; image: a path or a PIL image."""
        content, extra, n_audio, n_image = [], {}, None, None
        if image is not None:
            img = read_image(image) if isinstance(image, (str, Path)) else to_rgb(image)
            feats, n_image = self.media().image(img)
            extra.update(feats)
            content.append({"type": "image"})
        if audio is not None:
            wav = read_wav(audio) if isinstance(audio, (str, Path)) else np.asarray(audio, np.float32)
            if wav.size == 0:
                raise ValueError("the audio clip is empty")
            feats, n_audio = self.media().audio(wav)
            extra.update(feats)
            content.append({"type": "audio"})
        content.append({"type": "text", "text": prompt})
        msgs = [{"role": "user", "content": content}]
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = dict(self.tokenizer(expand_placeholders(text, n_audio, n_image), return_tensors="pt"))
        dev = self.model.thinker.lm_head.weight.device
        dtype = self.model.thinker.lm_head.weight.dtype
        enc.update(extra)
        return {k: (v.to(dev, dtype) if v.is_floating_point() else v.to(dev)) for k, v in enc.items()}

    def static_cache(self, batch: int, length: int):
        """A StaticCache of at least `length` tokens (rounded up to CACHE_BUCKET), reused
        across calls when it is big enough; reset before reuse."""
        from transformers import StaticCache  # lazy: transformers costs seconds; listing models imports this module

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
        check_distinct_code(self.model)  # ~1 ms: a walk over the modules' instance dicts
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
        with _talker_sees_audio_window(self.model, return_audio and "input_features" in kwargs):
            return self.model.generate(input_ids, return_audio=return_audio, **gen)

    def __call__(self, prompt: str, *, max_new_tokens: int = 16, return_audio: bool | None = None,
                 audio=None, image=None, voice: str | None = None, **kwargs) -> OmniOutput:
        """Text (with an optional audio clip and image) in; text, and speech in `voice` when the
        talker is on and `return_audio` is not False, out."""
        if not isinstance(prompt, str):  # 5 was formatted into the chat template as the text "5"
            raise TypeError(f"prompt: a string, got {type(prompt).__name__}")
        return_audio = self.has_talker if return_audio is None else return_audio
        if voice is not None:
            kwargs["speaker"] = self.check_voice(voice)
        enc = self.encode(prompt, audio=audio, image=image)
        media = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        out = self.generate(enc["input_ids"], enc.get("attention_mask"), max_new_tokens=max_new_tokens,
                            return_audio=return_audio, **media, **kwargs)
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
