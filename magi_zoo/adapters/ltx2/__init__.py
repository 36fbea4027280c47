"""LTX-2 (joint audio + video) over diffusers' LTX2Pipeline: the published configs (`config`)
and the adapter (`adapter`)."""

from .adapter import VARIANTS, LTX2Adapter

__all__ = ["LTX2Adapter", "VARIANTS"]
