"""BAGEL-7B-MoT, implemented natively: Qwen2.5 MoT LLM, NaViT SigLIP, FLUX AE, flow sampler.

Modules: `config` (variants' sizes), `mot` (MoT decoder layer / LLM), `vit` (ViT, varlen
custom op, connector), `packing` (patchify, positions, masks), `flow` (schedule, CFG,
timestep embedder), `model` (the Bagel module and its compiled entry points),
`checkpoint` (official key mapping), `pipeline` (understanding / text-to-image),
`adapter` (the zoo adapter).
"""

from .adapter import BagelAdapter, VARIANTS

__all__ = ["BagelAdapter", "VARIANTS"]
