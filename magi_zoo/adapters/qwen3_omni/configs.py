"""Qwen3-Omni configs as plain dicts: the published 30B-A3B config and a tiny, coherent one.

Every nested sub-config is a plain dict on purpose: transformers 5.17's talker config
does ``Qwen3OmniMoeTalkerTextConfig(**self.text_config)`` in ``__post_init__`` and fails
on a config object; 5.24 accepts both. Dicts work in both.

Values that must agree across the parts (the defaults of the config classes do not):

- thinker text ``hidden_size`` = audio ``output_dim`` = vision ``out_hidden_size`` =
  talker ``thinker_hidden_size`` (the encoders' outputs are spliced into the thinker's
  embeddings, and the talker reads thinker hidden states);
- talker text ``hidden_size`` = code predictor ``hidden_size`` (the talker's last hidden
  state goes straight into the code predictor);
- talker ``num_code_groups`` = code predictor ``num_code_groups`` = code2wav
  ``num_quantizers``; code predictor ``vocab_size`` = code2wav ``codebook_size``;
- ``rope_parameters.mrope_section`` sums to ``head_dim / 2``;
- thinker ``vocab_size`` >= 152064 so every multimodal special id (up to 151675) exists;
- the talker text config needs ``shared_expert_intermediate_size`` and the talker config
  ``spatial_merge_size``: neither is a declared field, but the modeling code reads both.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

# -- token ids of the Qwen3-Omni tokenizer (Qwen2 vocabulary 151643 + added tokens) --------
SPECIAL_TOKENS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<|audio_start|>": 151669,
    "<|audio_end|>": 151670, "<tts_pad>": 151671, "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673, "<tts_text_bos_single>": 151674, "<|audio_pad|>": 151675,
}
# Role words at their real ids: generate(return_audio=True) looks for `<|im_start|>` followed
# by assistant_token_id (77091) and for user_token_id (872) spans in input_ids.
ROLE_TOKENS = {"user": 872, "assistant": 77091, "system": 8948}
EOS_TOKEN_ID = SPECIAL_TOKENS["<|im_end|>"]

_TOKEN_IDS = dict(im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671,
                  tts_bos_token_id=151672, tts_eos_token_id=151673, system_token_id=8948,
                  user_token_id=872, assistant_token_id=77091)
_THINKER_IDS = dict(audio_token_id=151675, image_token_id=151655, video_token_id=151656,
                    audio_start_token_id=151669, audio_end_token_id=151670, vision_start_token_id=151652,
                    vision_end_token_id=151653, user_token_id=872)
_TALKER_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                   codec_think_bos_id=2156, codec_think_eos_id=2157, audio_token_id=151675,
                   image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                   audio_start_token_id=151669, audio_end_token_id=151670)
# The speech voices of the published Instruct model (its talker config's `speaker_id`;
# generate() looks a name up lower-cased).
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
SAMPLE_RATE = 24000  # Code2Wav output rate (Hz)

# -- published Qwen/Qwen3-Omni-30B-A3B-Instruct (config boilerplate such as id2label omitted) --
_PUB_THINKER = dict(
    audio_config=dict(activation_function="gelu", conv_chunksize=500, d_model=1280, downsample_hidden_size=480,
                      encoder_attention_heads=20, encoder_ffn_dim=5120, encoder_layers=32,
                      max_source_positions=1500, n_window=50, n_window_infer=800, num_mel_bins=128,
                      output_dim=2048, scale_embedding=False),
    vision_config=dict(apply_vit_abs_pos_embed=True, deepstack_visual_indexes=[8, 16, 24], depth=27,
                       hidden_act="gelu_pytorch_tanh", hidden_size=1152, image_size=768, in_channels=3,
                       intermediate_size=4304, num_heads=16, num_position_embeddings=2304, out_hidden_size=2048,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2),
    text_config=dict(attention_bias=False, decoder_sparse_step=1, head_dim=128, hidden_act="silu",
                     hidden_size=2048, intermediate_size=768, max_position_embeddings=65536, mlp_only_layers=[],
                     moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
                     num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-6,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000, mrope_section=[24, 20, 20],
                                          interleaved=True, mrope_interleaved=True),
                     router_aux_loss_coef=0.001, shared_expert_intermediate_size=0, sliding_window=None,
                     tie_word_embeddings=False, use_qk_norm=True, use_sliding_window=False, vocab_size=152064),
    position_id_per_seconds=13, seconds_per_chunk=2, tie_word_embeddings=False, **_THINKER_IDS,
)
_PUB_TALKER = dict(
    text_config=dict(attention_bias=False, decoder_sparse_step=1, head_dim=128, hidden_act="silu", hidden_size=1024,
                     intermediate_size=2048, max_position_embeddings=65536, mlp_only_layers=[],
                     moe_intermediate_size=384, norm_topk_prob=True, num_attention_heads=16, num_experts=128,
                     num_experts_per_tok=6, num_hidden_layers=20, num_key_value_heads=2, rms_norm_eps=1e-6,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000, mrope_section=[24, 20, 20],
                                          interleaved=True),
                     router_aux_loss_coef=0.001, shared_expert_intermediate_size=768, sliding_window=None,
                     tie_word_embeddings=False, use_sliding_window=False, vocab_size=3072),
    code_predictor_config=dict(attention_bias=False, head_dim=128, hidden_act="silu", hidden_size=1024,
                               intermediate_size=3072, layer_types=["full_attention"] * 5,
                               max_position_embeddings=32768, max_window_layers=28, num_attention_heads=16,
                               num_code_groups=16, num_hidden_layers=5, num_key_value_heads=8, rms_norm_eps=1e-6,
                               rope_parameters=dict(rope_type="default", rope_theta=1000000), sliding_window=None,
                               tie_word_embeddings=False, use_sliding_window=False, vocab_size=2048),
    accept_hidden_layer=24, num_code_groups=16, thinker_hidden_size=2048, spatial_merge_size=2,
    position_id_per_seconds=13, seconds_per_chunk=2, speaker_id=dict(SPEAKERS), tie_word_embeddings=False,
    **_TALKER_IDS,
)
_PUB_CODE2WAV = dict(
    attention_bias=False, codebook_dim=512, codebook_size=2048, decoder_dim=1536, hidden_act="silu",
    hidden_size=1024, intermediate_size=3072, layer_scale_initial_scale=0.01, max_position_embeddings=8000,
    num_attention_heads=16, num_hidden_layers=8, num_key_value_heads=16, num_quantizers=16,
    num_semantic_quantizers=1, rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=10000),
    semantic_codebook_size=4096, sliding_window=72, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
    vector_quantization_hidden_dimension=512,
)
PUBLISHED = dict(thinker=_PUB_THINKER, talker=_PUB_TALKER, code2wav=_PUB_CODE2WAV, enable_audio_output=True)

# -- tiny: thinker H=64 (2 layers, 4 experts top-2), talker H=32, 4 code groups ------------------
# Every structural constant is the published one (tests/conformance/test_tiny_configs.py compares
# the two built configs field by field); the published config's fields that transformers'
# classes do not read (use_qk_norm, apply_vit_abs_pos_embed, the code2wav quantizer fields...)
# are carried too, with the published values where they are not sizes.
_H, _TH, _HEAD, _MROPE, _GROUPS = 64, 32, 16, [4, 2, 2], 4  # mrope [4,2,2] sums to head_dim/2 = 8
_TINY_THINKER = dict(
    # 128 mel bins = WhisperFeatureExtractor(feature_size=128), as published.
    audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                      downsample_hidden_size=8, num_mel_bins=128, output_dim=_H, n_window=50, n_window_infer=800,
                      conv_chunksize=500, max_source_positions=1500),
    # deepstack indexes must be < depth and no more than the thinker's text layers.
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=_H,
                       num_position_embeddings=2304, deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh",
                       apply_vit_abs_pos_embed=True, image_size=768, tokens_per_second=2),
    text_config=dict(vocab_size=152064, hidden_size=_H, intermediate_size=2 * _H, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=_HEAD,
                     num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                     norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000, mrope_section=_MROPE,
                                          interleaved=True, mrope_interleaved=True),
                     shared_expert_intermediate_size=0, tie_word_embeddings=False, use_qk_norm=True,
                     use_sliding_window=False),
    position_id_per_seconds=13, seconds_per_chunk=2, tie_word_embeddings=False, **_THINKER_IDS,
)
_TINY_TALKER = dict(
    # vocab 3072: codes < 2048, codec specials 2148..2157, speakers 2301..2303; generate()
    # suppresses ids [vocab-1024, vocab) except codec_eos, so first-group codes stay < 2048.
    text_config=dict(vocab_size=3072, hidden_size=_TH, intermediate_size=2 * _TH, moe_intermediate_size=16,
                     shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=_HEAD, num_experts=4, num_experts_per_tok=2,
                     decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=4096,
                     rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000,
                                                             mrope_section=_MROPE, interleaved=True),
                     tie_word_embeddings=False, use_sliding_window=False),
    code_predictor_config=dict(vocab_size=2048, hidden_size=_TH, intermediate_size=2 * _TH, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=_HEAD,
                               num_code_groups=_GROUPS, max_position_embeddings=512,
                               rope_parameters=dict(rope_type="default", rope_theta=1000000),
                               tie_word_embeddings=False, use_sliding_window=False),
    # accept_hidden_layer indexes the thinker's hidden_states tuple (0 = embeddings): <= layers.
    num_code_groups=_GROUPS, thinker_hidden_size=_H, accept_hidden_layer=1, spatial_merge_size=2,
    position_id_per_seconds=13, seconds_per_chunk=2, speaker_id=dict(SPEAKERS), tie_word_embeddings=False,
    **_TALKER_IDS,
)
_TINY_CODE2WAV = dict(
    codebook_size=2048, num_quantizers=_GROUPS, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, sliding_window=72, max_position_embeddings=8000, decoder_dim=32,
    upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], rope_parameters=dict(rope_type="default", rope_theta=10000),
    layer_scale_initial_scale=0.01, rms_norm_eps=1e-5, codebook_dim=32, num_semantic_quantizers=1,
    semantic_codebook_size=4096, vector_quantization_hidden_dimension=32,
)
TINY = dict(thinker=_TINY_THINKER, talker=_TINY_TALKER, code2wav=_TINY_CODE2WAV, enable_audio_output=True)


def with_thinker_layers(cfg: dict[str, Any], n: int, *, talker: bool | None = None) -> dict[str, Any]:
    """A copy of `cfg` with `n` thinker text layers (every other dimension unchanged).

    Used by the GPU benchmark: the published layer config with fewer layers. Deepstack
    indexes beyond `n` are dropped and the talker's accept layer clamped, which the
    modeling code requires. `talker=False` disables audio output."""
    out = copy.deepcopy(cfg)
    text = out["thinker"]["text_config"]
    text["num_hidden_layers"] = n
    vis = out["thinker"]["vision_config"]
    vis["deepstack_visual_indexes"] = [i for i in vis["deepstack_visual_indexes"] if i < vis["depth"]][:n]
    out["talker"]["accept_hidden_layer"] = min(out["talker"]["accept_hidden_layer"], n)
    if talker is not None:
        out["enable_audio_output"] = talker
    return out


def build_config(cfg: dict[str, Any]):
    """`Qwen3OmniMoeConfig` from one of the dict recipes above (sub-configs passed as dicts)."""
    from transformers import Qwen3OmniMoeConfig  # lazy: transformers costs seconds; listing models imports this module

    cfg = copy.deepcopy(cfg)
    return Qwen3OmniMoeConfig(thinker_config=cfg["thinker"], talker_config=cfg["talker"],
                              code2wav_config=cfg["code2wav"], enable_audio_output=cfg["enable_audio_output"],
                              **_TOKEN_IDS)


def voices(cfg: dict[str, Any] | None = None, speaker_id: dict[str, int] | None = None) -> list[str]:
    """The voices a config offers, capitalised as the official examples write them."""
    ids = speaker_id if speaker_id is not None else (cfg or {}).get("talker", {}).get("speaker_id", {})
    return [name.capitalize() for name in ids]


def check_voice(voice: str, names: list[str]) -> str:
    """`voice` if it is one of `names` (any case), else an error naming the closest ones."""
    if voice.lower() in (n.lower() for n in names):
        return voice
    close = difflib.get_close_matches(voice.capitalize(), names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown voice {voice!r}; {hint}voices of this model: {', '.join(names) or '(none)'}")
