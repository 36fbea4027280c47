"""FLUX.2's published configuration (black-forest-labs/FLUX.2-dev, the diffusers layout) and the
tiny one, as keyword arguments of the diffusers / transformers classes, and the variants over
them (the config tables; the adapter is `adapter.py`).

Where each number comes from:
- transformer/config.json (Flux2Transformer2DModel): 128 input channels (32 latent channels x
  2x2), 8 double + 48 single blocks, 48 heads x 128 = 6144, joint_attention_dim 15360 (three
  Mistral hidden states of 5120 stacked), timestep / guidance channels 256, MLP ratio 3, RoPE
  axes (32, 32, 32, 32) at theta 2000, eps 1e-6, guidance-distilled. The same numbers are BFL's
  reference `Flux2Params` (black-forest-labs/flux2, src/flux2/model.py) and diffusers 0.42's
  class defaults.
- vae/config.json (AutoencoderKLFlux2): 4 levels (128, 256, 512, 512), 2 layers per block, 32
  latent channels, quant convs, batch-norm latent statistics (eps 1e-4, momentum 0.1), 2x2
  patches; BFL's `AutoEncoderParams` (ch 128, ch_mult (1, 2, 4, 4), z 32) agree.
- text_encoder/config.json: Mistral-Small-3.2-24B-Instruct (Mistral3ForConditionalGeneration):
  hidden 5120, FFN 32768, 40 layers, 32 heads / 8 KV heads of 128, vocab 131072, rope theta
  1e9, RMS eps 1e-5; the Pixtral vision tower 24 layers x 1024, FFN 4096, 16 heads of 64, patch
  14, image size 1540; projector gelu without bias, spatial merge 2, image token 10.
- scheduler/scheduler_config.json: FlowMatchEuler, shift 3.0 with dynamic exponential shifting
  (Flux2Pipeline computes mu itself from the token count and the step count).
- call defaults: BFL's reference CLI (scripts/cli.py): 50 steps, guidance 4.0, 1360x768; the
  text encoder's layers 10, 20, 30 and 512 tokens (src/flux2/text_encoder.py OUTPUT_LAYERS,
  MAX_LENGTH).

FLUX.2 [klein] (Flux2KleinPipeline, a Qwen3 text encoder, no guidance embedder):
- transformer: diffusers' scripts/convert_flux2_to_diffusers.py `klein-4b` (5 double + 20 single
  blocks, 24 heads, joint_attention_dim 7680 = 3 x 2560) and `klein-9b` (8 + 24, 32 heads, 12288
  = 3 x 4096), guidance_embeds false; VAE as FLUX.2-dev (the klein repositories' vae/config.json).
- text_encoder/config.json: Qwen3-4B (Qwen3ForCausalLM: hidden 2560, FFN 9728, 36 layers, 32
  heads / 8 KV heads of 128, vocab 151936, rope theta 1e6, RMS eps 1e-6, tied embeddings) for
  4B; Qwen3-8B (hidden 4096, FFN 12288, untied) for 9B. Layers 9, 18, 27 are stacked (the
  pipeline's default).
- model_index.json: FLUX.2-klein-4B is step-distilled (`is_distilled: true`: 4 steps, guidance
  unused); FLUX.2-klein-base-9B is not (50 steps, CFG at guidance 4.0: diffusers' example).
  1024x1024 is Flux2KleinPipeline's default size. The klein scheduler files were not read here:
  FLUX.2-dev's is used (the pipeline computes the shift mu itself from the token and step counts).
"""

from __future__ import annotations

from ..base import Variant

TRANSFORMER = dict(patch_size=1, in_channels=128, out_channels=None, num_layers=8, num_single_layers=48,
                   attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360,
                   timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000,
                   eps=1e-6, guidance_embeds=True)
VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
           act_fn="silu", latent_channels=32, norm_num_groups=32, sample_size=1024, use_quant_conv=True,
           use_post_quant_conv=True, mid_block_add_attention=True, batch_norm_eps=1e-4, batch_norm_momentum=0.1,
           patch_size=(2, 2))  # the published file's force_upcast: true is no AutoencoderKLFlux2 argument (0.42)
TEXT = dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
            max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000000.0))
VISION = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
              num_attention_heads=16, head_dim=64, hidden_act="silu", image_size=1540, patch_size=14, num_channels=3,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0))
ENCODER = dict(image_token_index=10, multimodal_projector_bias=False, projector_hidden_act="gelu",
               spatial_merge_size=2, vision_feature_layer=-1)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")
PUBLISHED = dict(transformer=TRANSFORMER, vae=VAE, text=TEXT, vision=VISION, encoder=ENCODER, scheduler=SCHEDULER,
                 tokenizer_vocab=4096)
CALL = dict(height=768, width=1360, num_inference_steps=50, guidance_scale=4.0, max_sequence_length=512,
            text_encoder_out_layers=(10, 20, 30))

# Tiny: widths and depths shrink, every other constant is published (tests/conformance/
# test_tiny_configs.py). 2 + 2 blocks of 2 heads x 16 (RoPE axes 4 x 4), the 32 latent
# channels and the 8x VAE (four levels) stay, so 32x32 pixels -> 2x2 packed latents -> 4
# image tokens. The encoder has 3 layers, so its three stacked hidden states are layers 1, 2, 3
# (the published 10, 20, 30 of 40): joint_attention_dim = 3 x 32.
TINY = dict(
    transformer=dict(TRANSFORMER, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=96, axes_dims_rope=(4, 4, 4, 4)),
    vae=dict(VAE, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, sample_size=32),
    text=dict(TEXT, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8),
    vision=dict(VISION, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8),
    encoder=ENCODER, scheduler=SCHEDULER, tokenizer_vocab=512,
)
TINY_CALL = dict(height=32, width=32, num_inference_steps=2, guidance_scale=4.0, max_sequence_length=512,
                 text_encoder_out_layers=(1, 2, 3))

# -- FLUX.2 [klein] ----------------------------------------------------------------------------
KLEIN_4B = dict(TRANSFORMER, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                guidance_embeds=False)
KLEIN_9B = dict(TRANSFORMER, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                guidance_embeds=False)
QWEN3_4B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
QWEN3_8B = dict(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)


def klein(transformer, text, distilled):
    return dict(transformer=transformer, vae=VAE, text=text, scheduler=SCHEDULER, tokenizer_vocab=4096,
                pipeline=dict(is_distilled=distilled))


KLEIN_CALL = dict(height=1024, width=1024, max_sequence_length=512, text_encoder_out_layers=(9, 18, 27))
# A tiny klein (the Flux2KleinPipeline path: Qwen3 encoder, no guidance embedder), built by
# tests/models/flux2 only: registered, it would repeat flux.2-tiny's compile in the conformance suite.
TINY_KLEIN = dict(klein(dict(TINY["transformer"], guidance_embeds=False), dict(QWEN3_4B, vocab_size=512, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8), False), vae=TINY["vae"], tokenizer_vocab=512)
TINY_KLEIN_CALL = dict(TINY_CALL, text_encoder_out_layers=(1, 2, 3))

# The in-process tokenizers' published pieces (a tiny or random build makes its own tokenizer).
# Mistral's instruction markers; the template writes the system and user turns as Mistral
# Small 3's chat template does ([SYSTEM_PROMPT] ... [/SYSTEM_PROMPT][INST] ... [/INST]).
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>"]
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's chat template, the parts Flux2KleinPipeline uses (a user turn, the generation prompt
# with thinking off: an empty think block).
QWEN3_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                       "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                       "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                       "{% endif %}{% endif %}")
MISTRAL_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set text = m['content'][0]['text'] if m['content'] "
                         "is not string else m['content'] %}{% if m['role'] == 'system' %}"
                         "[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
                         "{% else %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}")
# byte_bpe_tokenizer's arguments for each encoder's in-process tokenizer, and the special-token
# ids its text config takes (the tokenizer puts the specials at ids 0.. in the order above).
MISTRAL_TOKENIZER = dict(specials=MISTRAL_SPECIALS, bos="<s>", eos="</s>", pad="<pad>", unk="<unk>",
                         model_max_length=131072)
QWEN3_TOKENIZER = dict(specials=QWEN3_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", model_max_length=40960)
MISTRAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=7)
QWEN3_IDS = dict(bos_token_id=None, eos_token_id=2, pad_token_id=0)

VARIANTS = {v.name: v for v in [
    Variant(name="flux.2-dev", family="flux2", config=PUBLISHED, hub_id="black-forest-labs/FLUX.2-dev",
            description="text-to-image and image editing, 32B, Mistral-Small-3.2 text encoder", call_defaults=CALL),
    Variant(name="flux.2-klein-4b", family="flux2", config=klein(KLEIN_4B, QWEN3_4B, True),
            hub_id="black-forest-labs/FLUX.2-klein-4B", description="[klein] 4B, 4-step distilled, Qwen3-4B encoder",
            call_defaults=dict(KLEIN_CALL, num_inference_steps=4, guidance_scale=1.0)),
    Variant(name="flux.2-klein-base-9b", family="flux2", config=klein(KLEIN_9B, QWEN3_8B, False),
            hub_id="black-forest-labs/FLUX.2-klein-base-9B", description="[klein] 9B base (CFG), Qwen3-8B encoder",
            call_defaults=dict(KLEIN_CALL, num_inference_steps=50, guidance_scale=4.0)),
    Variant(name="flux.2-tiny", family="flux2", config=TINY, tiny=True,
            description="2 double + 2 single blocks, dim 32, a 3-layer Mistral; random, offline",
            call_defaults=TINY_CALL),
]}
