"""The Qwen3-Omni adapter: variants, build (random or from weights), the thinker's entry
points and their example inputs, and `magi-zoo run`.

The model is transformers' `Qwen3OmniMoeForConditionalGeneration`. Parts: the *thinker*
(audio encoder + vision encoder + a 48-layer MoE text decoder), the *talker* (a 20-layer MoE
decoder that turns thinker states into codec tokens, with a small code predictor) and
*Code2Wav* (the vocoder, codes -> 24 kHz speech).

Works with transformers 5.17 and 5.24: sub-configs are passed as dicts (configs.py), and
module paths that moved between versions are reached through helpers here and through
class-name keys in the spec (5.24 has `thinker.model.language_model`, 5.17 `thinker.model`).
The thinker's decoder gets `prefill` / `decode_step` methods (ops.py) so the spec can
compile the variable-length prompt pass and the fixed-shape one-token step differently.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ...engine import Preparation, progress_rename
from ...engine.compat.transformers import install_output_capturing_hooks
from ..base import Adapter, Output, Variant, init_on
from ..diffusers_pipeline import LOAD_ERRORS, weights_error
from .configs import PUBLISHED, TINY, build_config, check_voice, voices
from .inputs import read_wav
from .ops import install_prefill_decode, register_experts_impl
from .pipeline import CACHE_BUCKET, OmniOutput, Qwen3OmniPipeline, _cache_kwarg, thinker_text_model
from .regions import own_code_preparation
from .tokenizer import build_tokenizer

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
    registered as an implementation, transformers' output hooks installed."""
    model.eval()  # a freshly built model is in training mode (dropout on); from_pretrained evals
    register_experts_impl()
    # transformers 5.24 installs its output-capturing hooks lazily, under a `threading.Lock`,
    # inside the decorated forward; dynamo cannot enter a lock, so a compiled region that is a
    # model's *first* call would break there (a hard error under fullgraph=True). Installed at
    # build time, the first-call branch is never taken.
    install_output_capturing_hooks(model)
    return model


def _prefill_decode_preparation(model: nn.Module) -> Preparation:
    """The thinker decoder's forward split into `prefill` and `decode_step` (the spec
    compiles them differently); undone by restoring the library class."""

    def install(root: nn.Module):
        text_model = thinker_text_model(model.thinker)
        original = type(text_model)
        install_prefill_decode(text_model)

        def undo() -> None:
            text_model.__class__ = original
        return undo

    return Preparation("prefill/decode split",
                       "the thinker decoder's forward dispatches to prefill (prompt, any length) or "
                       "decode_step (one token, static KV cache), compiled under separate specs", install)


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


# Prompt length of `example_inputs`: the fixed prompt the thinker benchmarks used (benchmarks/results/qwen3-omni/qwen3-omni_decode_h200.md).
PROMPT_LEN = 32


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _fresh_static_cache(cfg, batch: int, length: int, dtype: torch.dtype, device: torch.device):
    """A new StaticCache of `length` tokens, allocated now (as `Qwen3OmniPipeline.static_cache`
    does, but never the pipeline's reused one: example inputs must not share state)."""
    # lazy: transformers costs seconds; listing models imports this module
    from transformers import StaticCache

    cache = StaticCache(config=cfg, max_cache_len=length)
    if hasattr(cache, "early_initialization"):  # 5.24; older versions allocate on first write
        cache.early_initialization(batch_size=batch, num_heads=cfg.num_key_value_heads, head_dim=_head_dim(cfg),
                                   dtype=dtype, device=device)
    return cache


class _TokenProgress:
    """A `generate` streamer that advances a tqdm bar per new token: transformers calls
    `put` with the prompt first, then with each new token, then `end`."""

    def __init__(self, total: int, then: str | None = None):
        from tqdm.auto import tqdm  # lazy: tqdm.auto costs ~50 ms; only `magi-zoo run` shows the bar

        self.bar = tqdm(total=total, desc="thinker tokens", unit="tok")
        self.seen_prompt = False
        self.then = then  # the stage after the thinker's last token (the talker), for the heartbeat

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.bar.update(value.numel())

    def end(self) -> None:
        self.bar.close()
        if self.then is not None:  # the talker runs next, without a bar: the heartbeat names it
            progress_rename(self.then)


class Qwen3OmniAdapter(Adapter):
    """Adapter for Qwen3-Omni: builds the model + an offline (or shipped) tokenizer."""

    family = "qwen3_omni"
    spec_file = "qwen3_omni.toml"
    variants = VARIANTS
    aliases = {"qwen3-omni": "qwen3-omni-30b-a3b", "qwen3_omni": "qwen3-omni-30b-a3b"}

    entry_points = ("prefill", "decode_step")
    run_options = ("max_new_tokens", "audio_out", "seed", "audio", "image", "voice")
    image_kinds = ("PIL", "path")  # its pipeline reads a PIL image or opens a file
    prompt_lists = False  # one conversation per call
    output_suffixes = (".txt",)

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device) -> Qwen3OmniPipeline:
        """Random init at `variant.config` (a benchmark may pass a derived variant, e.g. the
        published config with fewer thinker layers: `dataclasses.replace(variant, config=...)`)."""
        from transformers import Qwen3OmniMoeForConditionalGeneration  # lazy: transformers costs seconds

        with init_on(device, dtype):
            model = Qwen3OmniMoeForConditionalGeneration(build_config(variant.config))
        _init_fused_experts(model)
        return Qwen3OmniPipeline(finish(model), build_tokenizer())

    def load_pretrained(self, variant: Variant, source: str, local: bool, dtype: torch.dtype,
                        device: torch.device) -> Qwen3OmniPipeline:
        from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration  # lazy: costs seconds

        # A path loads strictly offline; anything else is a hub id, fetched by transformers.
        try:
            model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
                source, dtype=dtype, local_files_only=local).to(device)
        except LOAD_ERRORS() as e:
            raise weights_error(variant, source, local, e) from e
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
        except (OSError, ValueError):  # a checkpoint saved without its tokenizer
            tokenizer = build_tokenizer()
        return Qwen3OmniPipeline(finish(model), tokenizer, source if local else None)

    def preparations(self, pipe: Qwen3OmniPipeline) -> list[Preparation]:
        # The split first: it gives the thinker decoder a forward of its own, so the
        # own-code preparation leaves that class alone.
        return [_prefill_decode_preparation(pipe.model), own_code_preparation(pipe.model)]

    def call_defaults(self, variant: Variant) -> dict[str, Any]:
        return {"max_new_tokens": variant.call_defaults["max_new_tokens"]}

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """The thinker's and the talker's token budgets at most their position tables: the
        pipeline sizes each static KV cache by its budget (a budget of 10**9 asked the host for
        128 GB on the tiny variant), and no reply runs past its table."""
        caps = {}
        for key, part in (("max_new_tokens", "thinker"), ("talker_max_new_tokens", "talker")):
            n = variant.config[part]["text_config"]["max_position_embeddings"]
            caps[key] = (n, f"its {part} holds {n:,} positions")
        return caps

    def check_run(self, variant: Variant, options: dict[str, Any], out: Path | None = None) -> dict[str, Any]:
        given = super().check_run(variant, options, out)
        if given.get("audio_out") is not None and Path(given["audio_out"]).suffix.lower() != ".wav":
            raise ValueError(f"--audio-out {given['audio_out']!r}: speech is written as .wav")
        if given.get("voice") is not None:
            if given.get("audio_out") is None:
                raise ValueError("--voice picks the speech voice: add --audio-out speech.wav")
            check_voice(given["voice"], voices(variant.config))
        return given

    def check_inputs(self, given: dict[str, Any]) -> None:
        """The base checks (each file exists and is readable; an image opens), then the audio clip
        decoded as the pipeline will read it (`inputs.read_wav`), before the build: a file that
        is no sound, or a clip without samples, is refused here, not after the thinker starts."""
        super().check_inputs(given)
        audio = given.get("audio")
        # a clip is small (seconds of 16 kHz samples): decoding it twice, here and in the call,
        # costs milliseconds against a build; an array from the API is the call's own to check
        if isinstance(audio, (str, os.PathLike)) and read_wav(audio).size == 0:
            raise ValueError(f"--audio {str(audio)!r}: the clip has no samples; pass a recording")

    def entry(self, pipe: Qwen3OmniPipeline, name: str) -> tuple[nn.Module, str]:
        """The thinker's text decoder, whose `prefill` / `decode_step` the plan compiles."""
        self.check_entry(name)
        return thinker_text_model(pipe.model.thinker), name

    def example_inputs(self, pipe: Qwen3OmniPipeline, variant: Variant, entry: str, *, batch: int = 1,
                       seq_len: int | None = None, ctx_len: int | None = None, seed: int = 0) -> dict[str, Any]:
        """Keyword arguments of one thinker text-model call, exactly as the pipeline's greedy
        `generate` makes them for a text prompt (seen at the module's forward: the same
        kwargs, shapes and dtypes), so a benchmark or test compiles the graph a generation runs.

        prefill: `seq_len` prompt tokens (default PROMPT_LEN = 32, the benchmark's prompt) as
          `inputs_embeds` (the thinker embeds ids before calling its text model), no mask,
          positions 0..seq_len-1, and a fresh, empty static cache.
        decode_step: one token at position `ctx_len` (default 32) against a static cache that
          already holds `ctx_len` positions, with generate's 4-D boolean mask over the
          whole cache (True for the ctx_len cached positions and the new one).

        Both caches are sized as the pipeline sizes them: the tokens a generation of the
        variant's default `max_new_tokens` needs, rounded up to CACHE_BUCKET. The cached
        keys / values of decode_step are seeded random draws (N(0, 1), the scale of RoPE'd,
        normed keys) written through the cache's public `update`; no model call is made, so
        building inputs never runs (or compiles) the module. Every call returns a fresh cache.
        """
        self.check_entry(entry)
        if entry == "prefill":
            seq_len = PROMPT_LEN if seq_len is None else seq_len
            if ctx_len not in (None, 0):
                raise ValueError("prefill starts from an empty cache: ctx_len must be None or 0")
            n_new, n_cached = seq_len, 0
        else:
            if seq_len not in (None, 1):
                raise ValueError(f"decode_step takes one token; seq_len={seq_len} is a prefill")
            n_new, n_cached = 1, PROMPT_LEN if ctx_len is None else ctx_len
        if n_new < 1 or n_cached < 0 or batch < 1:
            raise ValueError(f"need batch >= 1, seq_len >= 1, ctx_len >= 0 (got {batch}, {n_new}, {n_cached})")
        thinker = pipe.model.thinker
        text_model = thinker_text_model(thinker)
        cfg = thinker.config.get_text_config()
        p = thinker.lm_head.weight
        g = torch.Generator(device="cpu").manual_seed(seed)
        # Tokens a generation of the default length needs from here, in the pipeline's buckets.
        need = n_cached + n_new + variant.call_defaults.get("max_new_tokens", 0)
        cache_len = -(-need // CACHE_BUCKET) * CACHE_BUCKET
        cache = _fresh_static_cache(cfg, batch, cache_len, p.dtype, p.device)
        if n_cached:
            kv_heads, head_dim = cfg.num_key_value_heads, _head_dim(cfg)
            for i in range(cfg.num_hidden_layers):
                k, v = (torch.randn(batch, kv_heads, n_cached, head_dim, generator=g).to(p.device, p.dtype)
                        for _ in range(2))
                # cache_position: what transformers 5.17's StaticLayer.update reads (5.24 ignores it).
                cache.update(k, v, i, {"cache_position": torch.arange(n_cached, device=p.device)})
        ids = torch.randint(0, cfg.vocab_size, (batch, n_new), generator=g).to(p.device)
        with torch.no_grad():
            embeds = text_model.embed_tokens(ids)  # the embedding is never compiled: no counters move
        # (4, batch, n) positions: the text row then the t/h/w rows of M-RoPE, equal for text
        # (the thinker's rope index arithmetic passes them as float32).
        pos = torch.arange(n_cached, n_cached + n_new, device=p.device, dtype=torch.float32)
        position_ids = pos.view(1, 1, -1).expand(4, batch, -1)
        mask = None
        if entry == "decode_step":
            mask = torch.zeros(batch, 1, 1, cache_len, dtype=torch.bool, device=p.device)
            mask[..., : n_cached + 1] = True
        return {"attention_mask": mask, "position_ids": position_ids, _cache_kwarg(thinker): cache,
                "inputs_embeds": embeds, "use_cache": True, "output_router_logits": False,
                "deepstack_visual_embeds": None, "visual_pos_masks": None}

    def components(self, pipe: Qwen3OmniPipeline) -> dict[str, nn.Module]:
        """thinker, plus talker and code2wav when audio output is enabled."""
        m = pipe.model
        out = {"thinker": m.thinker}
        if pipe.has_talker:
            out.update(talker=m.talker, code2wav=m.code2wav)
        return out

    def generate(self, handle, *, prompt: str, progress: bool = True, audio_out: str | None = None,
                 max_new_tokens: int | None = None, seed: int | None = None, audio: str | None = None,
                 image: str | None = None, voice: str | None = None) -> Output:
        """The reply as text, with the speech (in `voice`) when `audio_out` is given (the CLI
        writes both); `audio` (.wav) and `image` files go through the encoders first."""
        pipe: Qwen3OmniPipeline = handle.pipe
        if audio_out is not None and not pipe.has_talker:
            raise ValueError(f"--audio-out needs the talker, which {handle.variant.name} was built without")
        if seed is not None:
            torch.manual_seed(seed)  # greedy decoding ignores it; kept for parity with other families
        d = handle.variant.call_defaults
        extra = {"talker_max_new_tokens": d["talker_max_new_tokens"]} if audio_out else {}
        if progress:  # a bar over the thinker's tokens, fed by transformers' streamer protocol
            extra["thinker_streamer"] = _TokenProgress(
                max_new_tokens or d["max_new_tokens"],
                then="the talker's speech codes, then Code2Wav" if audio_out else None)
        media = {k: v for k, v in dict(audio=audio, image=image, voice=voice).items() if v is not None}
        res: OmniOutput = handle(prompt, return_audio=audio_out is not None, **media,
                                 **({"max_new_tokens": max_new_tokens} if max_new_tokens else {}), **extra)
        note = f"{len(res.token_ids)} tokens: {res.token_ids}"
        if not res.text.strip():
            note += " (they decode to no text: expected of random weights)"
        return Output("text", res.text, audio=res.audio, sample_rate=res.sample_rate, note=note)

