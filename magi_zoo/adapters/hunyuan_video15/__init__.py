"""HunyuanVideo-1.5 over diffusers' HunyuanVideo15Pipeline: the published configs (`config`)
and the adapter (`adapter`)."""

from .adapter import VARIANTS, HunyuanVideo15Adapter

__all__ = ["HunyuanVideo15Adapter", "VARIANTS"]
