"""Qwen3-Omni (30B-A3B) over transformers' `Qwen3OmniMoeForConditionalGeneration`.

Modules: `configs` (published and tiny configurations, voices), `ops` (the experts op and the
prefill / decode split), `regions` (compile regions whose code is shared between parts),
`inputs` (audio and image preprocessing), `tokenizer` (the offline tokenizer), `pipeline` (the
generation loop, thinker -> talker -> Code2Wav), `adapter` (variants, build, entry points,
`magi-zoo run`).
"""

from .adapter import VARIANTS, Qwen3OmniAdapter, finish
from .ops import EXPERTS_CHOICES, EXPERTS_OP_IMPL, experts_implementation, set_experts_implementation
from .pipeline import OmniOutput, Qwen3OmniPipeline, audio_tower, thinker_text_model, vision_tower
from .regions import check_distinct_code, shared_code_regions

__all__ = ["Qwen3OmniAdapter", "Qwen3OmniPipeline", "OmniOutput", "VARIANTS", "EXPERTS_CHOICES", "EXPERTS_OP_IMPL",
           "set_experts_implementation", "experts_implementation", "thinker_text_model", "audio_tower",
           "vision_tower", "finish", "shared_code_regions", "check_distinct_code"]
